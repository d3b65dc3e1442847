// Command allocate is the reference allocator: it runs k8s.io/dynamic-resource-allocation/structured,
// the code kube-scheduler runs, over DeviceClasses, ResourceSlices, ResourceClaims (and optionally
// Nodes) read from YAML or JSON files, and prints what it allocates. It is the oracle that fgpu's
// own allocator and benchmarks are compared against.
//
// Claims are allocated one at a time in file order, each on the first node (sorted by name, or
// --node) where it fits, and count as allocated for the claims after it, as the scheduler does for
// a stream of pods.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	resourcedefaults "k8s.io/kubernetes/pkg/apis/resource/v1"
)

type inputs struct {
	classes []*resourceapi.DeviceClass
	slices  []*resourceapi.ResourceSlice
	claims  []*resourceapi.ResourceClaim
	nodes   []*v1.Node
}

type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, class := range l {
		out = append(out, class)
	}
	return out, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if class, ok := l[name]; ok {
		return class, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Group: "resource.k8s.io", Resource: "deviceclasses"}, name)
}

type claimResult struct {
	Claim      string                        `json:"claim"`
	Node       string                        `json:"node,omitempty"`
	Allocation *resourceapi.AllocationResult `json:"allocation,omitempty"`
	Error      string                        `json:"error,omitempty"`
	Seconds    float64                       `json:"seconds"`
}

type output struct {
	Results   []claimResult `json:"results"`
	Allocated int           `json:"allocated"`
	Failed    int           `json:"failed"`
	Seconds   float64       `json:"seconds"`
}

func main() {
	node := flag.String("node", "", "allocate on this node only (default: every node in turn)")
	batch := flag.Bool("batch", false, "read one JSON scenario a line from stdin ({objects, verify}), answer one JSON line each")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: allocate [--node NAME] FILE... | allocate --batch\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *batch {
		if err := serveBatch(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintf(os.Stderr, "allocate: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	in, err := readInputs(flag.Args())
	if err != nil {
		fmt.Fprintf(os.Stderr, "allocate: %v\n", err)
		os.Exit(2)
	}
	out, err := allocate(context.Background(), in, *node)
	if err != nil {
		fmt.Fprintf(os.Stderr, "allocate: %v\n", err)
		os.Exit(1)
	}
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	if err := encoder.Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "allocate: %v\n", err)
		os.Exit(1)
	}
}

func readInputs(paths []string) (*inputs, error) {
	in := &inputs{}
	for _, path := range paths {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		decoder := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var obj map[string]any
			if err := decoder.Decode(&obj); err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				return nil, fmt.Errorf("%s: %w", path, err)
			}
			if obj == nil {
				continue
			}
			if err := in.add(obj); err != nil {
				return nil, fmt.Errorf("%s: %w", path, err)
			}
		}
	}
	return in, nil
}

func (in *inputs) add(obj map[string]any) error {
	kind, _ := obj["kind"].(string)
	if strings.HasSuffix(kind, "List") {
		items, _ := obj["items"].([]any)
		for _, item := range items {
			if m, ok := item.(map[string]any); ok {
				if err := in.add(m); err != nil {
					return err
				}
			}
		}
		return nil
	}
	name := (&unstructured.Unstructured{Object: obj}).GetName()
	switch kind {
	case "DeviceClass":
		return decodeInto(obj, kind, name, &in.classes, nil)
	case "ResourceSlice":
		return decodeInto(obj, kind, name, &in.slices, resourcedefaults.SetObjectDefaults_ResourceSlice)
	case "ResourceClaim":
		// The API server's defaults (count 1, ExactCount ...), as on objects read back from it.
		return decodeInto(obj, kind, name, &in.claims, resourcedefaults.SetObjectDefaults_ResourceClaim)
	case "Node":
		return decodeInto(obj, kind, name, &in.nodes, nil)
	default:
		return fmt.Errorf("unsupported kind %q", kind)
	}
}

// decodeInto converts obj to a T, applies defaults if given, and appends it to list.
func decodeInto[T any](obj map[string]any, kind, name string, list *[]*T, defaults func(*T)) error {
	typed := new(T)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(obj, typed, true); err != nil {
		return fmt.Errorf("%s %s: %w", kind, name, err)
	}
	if defaults != nil {
		defaults(typed)
	}
	*list = append(*list, typed)
	return nil
}

// nodes are the Node objects given, plus a bare Node for every nodeName a slice names.
func (in *inputs) nodeList(only string) []*v1.Node {
	byName := map[string]*v1.Node{}
	for _, node := range in.nodes {
		byName[node.Name] = node
	}
	for _, slice := range in.slices {
		if name := ptrString(slice.Spec.NodeName); name != "" && byName[name] == nil {
			node := &v1.Node{}
			node.Name = name
			byName[name] = node
		}
	}
	names := make([]string, 0, len(byName))
	for name := range byName {
		if only == "" || name == only {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	out := make([]*v1.Node, 0, len(names))
	for _, name := range names {
		out = append(out, byName[name])
	}
	return out
}

func ptrString(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

type allocatedState struct{ structured.AllocatedState }

func newAllocatedState() *allocatedState {
	return &allocatedState{structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}}
}

// record mirrors kube-scheduler's foreachAllocatedDevice with consumable capacity enabled.
func (s *allocatedState) record(allocation *resourceapi.AllocationResult) {
	for _, result := range allocation.Devices.Results {
		if result.AdminAccess != nil && *result.AdminAccess {
			continue
		}
		deviceID := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
		if result.ShareID != nil {
			s.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(deviceID, result.ShareID))
			if result.ConsumedCapacity != nil {
				s.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(deviceID, result.ConsumedCapacity))
			}
			continue
		}
		s.AllocatedDevices.Insert(deviceID)
	}
}

func allocate(ctx context.Context, in *inputs, only string) (*output, error) {
	features := structured.Features{
		AdminAccess:            true,
		ConsumableCapacity:     true,
		DeviceBindingAndStatus: true,
		DeviceTaints:           true,
		PartitionableDevices:   true,
		PrioritizedList:        true,
	}
	classes := classLister{}
	for _, class := range in.classes {
		classes[class.Name] = class
	}
	celCache := cel.NewCache(1000, cel.Features{EnableConsumableCapacity: true})
	state := newAllocatedState()
	var pending []*resourceapi.ResourceClaim
	for _, claim := range in.claims {
		if claim.Status.Allocation != nil {
			state.record(claim.Status.Allocation)
		} else {
			pending = append(pending, claim)
		}
	}
	nodes := in.nodeList(only)
	out := &output{Results: []claimResult{}}
	start := time.Now()
	for _, claim := range pending {
		claimStart := time.Now()
		result := claimResult{Claim: claim.Namespace + "/" + claim.Name}
		var lastErr error
		for _, node := range nodes {
			allocator, err := structured.NewAllocator(ctx, features, state.AllocatedState, classes, in.slices, celCache)
			if err != nil {
				return nil, err
			}
			allocations, err := allocator.Allocate(ctx, node, []*resourceapi.ResourceClaim{claim})
			if err != nil {
				lastErr = err
				continue
			}
			if len(allocations) == 1 {
				result.Node = node.Name
				result.Allocation = &allocations[0]
				state.record(result.Allocation)
				break
			}
		}
		if result.Allocation == nil {
			result.Error = "cannot allocate all claims on any node"
			if only != "" {
				result.Error = "cannot allocate all claims on node " + only
			}
			if lastErr != nil {
				result.Error = lastErr.Error()
			}
			out.Failed++
		} else {
			out.Allocated++
		}
		result.Seconds = time.Since(claimStart).Seconds()
		out.Results = append(out.Results, result)
	}
	out.Seconds = time.Since(start).Seconds()
	return out, nil
}
