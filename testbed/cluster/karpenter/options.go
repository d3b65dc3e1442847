package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"sigs.k8s.io/karpenter/pkg/operator/options"
	"sigs.k8s.io/karpenter/pkg/utils/env"
)

// Options are this binary's own flags, parsed with Karpenter's (its flag set refuses unknown flags).
type Options struct {
	// DynamicResourcesDir holds one `fgpu slice-template --format karpenter -o json` output per
	// instance type, named <instance type>.json.
	DynamicResourcesDir string
	// LiftNotReadyTaint removes node.kubernetes.io/not-ready from kwok's Ready nodes: the test bed
	// runs no node-lifecycle controller, and Karpenter waits for that taint to go before a node
	// counts as initialized.
	LiftNotReadyTaint bool
	// ShareCountersOnce leaves out the shared counters of devices that take many allocations
	// (allowMultipleAllocations: MPS and time-sliced shares). kube-scheduler deducts such a
	// device's counters once, however many shares it holds; Karpenter v1.15.0's allocator deducts
	// them on every allocation (tryDevice -> deductAllocatingCounters), so it plans one share per
	// GPU on a new node. Without them its plan packs shares by capacity, as kube-scheduler does,
	// but no longer sees that a GPU's shares exclude its whole and MIG devices.
	ShareCountersOnce bool
}

type optionsKey struct{}

func init() {
	options.Injectables = append(options.Injectables, &Options{})
}

func (o *Options) AddFlags(fs *options.FlagSet) {
	fs.StringVar(&o.DynamicResourcesDir, "dynamic-resources-dir", env.WithDefaultString("DYNAMIC_RESOURCES_DIR", ""),
		"directory of <instance type>.json files: each instance type's DRA devices (Karpenter's DynamicResources)")
	fs.BoolVarWithEnv(&o.LiftNotReadyTaint, "lift-not-ready-taint", "LIFT_NOT_READY_TAINT", false,
		"remove the not-ready taint from kwok's Ready nodes (for clusters without a node-lifecycle controller)")
	fs.BoolVarWithEnv(&o.ShareCountersOnce, "share-counters-once", "SHARE_COUNTERS_ONCE", false,
		"leave out the counters of multi-allocatable template devices, which Karpenter deducts per allocation")
}

func (o *Options) Parse(fs *options.FlagSet, args ...string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		return fmt.Errorf("parsing flags, %w", err)
	}
	return nil
}

func (o *Options) ToContext(ctx context.Context) context.Context {
	return context.WithValue(ctx, optionsKey{}, o)
}

func optionsFrom(ctx context.Context) *Options {
	return ctx.Value(optionsKey{}).(*Options)
}
