// Command etcd runs a single-member etcd server from go.etcd.io/etcd/server/v3/embed for the test
// control plane. Only the flags the harness needs are exposed.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(raw string) url.URL {
	u, err := url.Parse(raw)
	if err != nil {
		log.Fatalf("bad URL %q: %v", raw, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "", "directory for etcd data")
	clientURL := flag.String("listen-client-url", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}

	cfg := embed.NewConfig()
	cfg.Name = "fgpu-test"
	cfg.Dir = *dataDir
	cfg.LogLevel = "error"
	client, peer := mustURL(*clientURL), mustURL(*peerURL)
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	// Tests never need history; keep the database small and fast.
	cfg.UnsafeNoFsync = true

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	select {
	case <-server.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		server.Close()
		log.Fatal("etcd did not become ready within 60s")
	}
	log.Printf("etcd ready on %s", client.String())

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	select {
	case <-signals:
	case err := <-server.Err():
		log.Printf("etcd error: %v", err)
	}
	server.Close()
}
