// Command pause is the pod sandbox process of the test-bed node's image fgpu.test/pause:1: it holds
// the pod's namespaces by sleeping forever, reaps zombies (it is PID 1 when the pod shares its PID
// namespace), and exits 0 on SIGINT or SIGTERM. Built statically (CGO_ENABLED=0) from the standard
// library alone, so the image needs no registry and no libc.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("pause (fgpu test bed)")
		return
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "warning: pause should be the first process")
	}

	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Fprintf(os.Stderr, "shutting down, got signal %v\n", sig)
		os.Exit(0)
	}
}

// reap collects every exited child; one SIGCHLD may stand for several exits.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
