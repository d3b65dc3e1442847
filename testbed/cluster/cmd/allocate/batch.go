package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/cel"
)

// scenario is one line of --batch input: objects as in the files, whether to verify the
// allocations the claims already carry instead of allocating, and the one node to allocate on
// (default: every node in turn).
type scenario struct {
	Objects []map[string]any `json:"objects"`
	Verify  bool             `json:"verify"`
	Node    string           `json:"node,omitempty"`
}

type batchAnswer struct {
	*output
	Problems []string `json:"problems,omitempty"`
	Error    string   `json:"error,omitempty"`
}

func serveBatch(in io.Reader, out io.Writer) error {
	reader := bufio.NewReaderSize(in, 1<<20)
	encoder := json.NewEncoder(out)
	for {
		line, err := reader.ReadBytes('\n')
		if len(line) > 0 {
			if encodeErr := encoder.Encode(answer(line)); encodeErr != nil {
				return encodeErr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func answer(line []byte) batchAnswer {
	var sc scenario
	if err := json.Unmarshal(line, &sc); err != nil {
		return batchAnswer{Error: err.Error()}
	}
	in := &inputs{}
	for _, obj := range sc.Objects {
		if err := in.add(obj); err != nil {
			return batchAnswer{Error: err.Error()}
		}
	}
	if sc.Verify {
		return batchAnswer{output: &output{Results: []claimResult{}}, Problems: verify(in)}
	}
	out, err := allocate(context.Background(), in, sc.Node)
	if err != nil {
		return batchAnswer{Error: err.Error()}
	}
	return batchAnswer{output: out}
}

// verify checks the allocations the claims carry against the slices, with upstream's types and
// CEL: every device exists in its pool's newest generation and matches the class and request
// selectors, no device is given exclusively twice, no counter or consumable capacity is overdrawn.
func verify(in *inputs) []string {
	var problems []string
	classes := map[string]*resourceapi.DeviceClass{}
	for _, class := range in.classes {
		classes[class.Name] = class
	}
	type deviceRef struct {
		device *resourceapi.Device
		slice  *resourceapi.ResourceSlice
	}
	newest := map[string]int64{}
	for _, slice := range in.slices {
		key := slice.Spec.Driver + "/" + slice.Spec.Pool.Name
		newest[key] = max(newest[key], slice.Spec.Pool.Generation)
	}
	devices := map[string]deviceRef{}
	counters := map[string]resource.Quantity{}
	for _, slice := range in.slices {
		pool := slice.Spec.Driver + "/" + slice.Spec.Pool.Name
		if slice.Spec.Pool.Generation != newest[pool] {
			continue
		}
		for i := range slice.Spec.Devices {
			devices[pool+"/"+slice.Spec.Devices[i].Name] = deviceRef{&slice.Spec.Devices[i], slice}
		}
		for _, set := range slice.Spec.SharedCounters {
			for name, counter := range set.Counters {
				counters[pool+"/"+set.Name+"/"+name] = counter.Value.DeepCopy()
			}
		}
	}
	celCache := cel.NewCache(100, cel.Features{EnableConsumableCapacity: true})
	exclusive := map[string]string{}
	shared := map[string]map[resourceapi.QualifiedName]resource.Quantity{}
	drawn := map[string]bool{}
	for _, claim := range in.claims {
		if claim.Status.Allocation == nil {
			continue
		}
		name := claim.Namespace + "/" + claim.Name
		for _, result := range claim.Status.Allocation.Devices.Results {
			id := result.Driver + "/" + result.Pool + "/" + result.Device
			ref, ok := devices[id]
			if !ok {
				problems = append(problems, fmt.Sprintf("%s: device %s does not exist", name, id))
				continue
			}
			problems = append(problems, selectorProblems(celCache, classes, claim, result, ref.device)...)
			if result.AdminAccess != nil && *result.AdminAccess {
				continue
			}
			if result.ShareID == nil {
				if other, taken := exclusive[id]; taken {
					problems = append(problems, fmt.Sprintf("%s: device %s is already allocated to %s", name, id, other))
				}
				if _, sharedToo := shared[id]; sharedToo {
					problems = append(problems, fmt.Sprintf("%s: device %s is shared and exclusive at once", name, id))
				}
				exclusive[id] = name
			} else {
				if !ptrBool(ref.device.AllowMultipleAllocations) {
					problems = append(problems, fmt.Sprintf("%s: device %s has a shareID but no allowMultipleAllocations", name, id))
				}
				if shared[id] == nil {
					shared[id] = map[resourceapi.QualifiedName]resource.Quantity{}
				}
				for capName, value := range result.ConsumedCapacity {
					sum := shared[id][capName]
					sum.Add(value)
					shared[id][capName] = sum
				}
			}
			if drawn[id] {
				continue // a shared device draws its counters once
			}
			drawn[id] = true
			for _, consumption := range ref.device.ConsumesCounters {
				for counterName, counter := range consumption.Counters {
					key := result.Driver + "/" + result.Pool + "/" + consumption.CounterSet + "/" + counterName
					left := counters[key]
					left.Sub(counter.Value)
					counters[key] = left
					if left.Sign() < 0 {
						problems = append(problems, fmt.Sprintf("%s: device %s overdraws counter %s", name, id, key))
					}
				}
			}
		}
	}
	for id, consumed := range shared {
		for capName, value := range consumed {
			capacity, ok := devices[id].device.Capacity[capName]
			if !ok || value.Cmp(capacity.Value) > 0 {
				problems = append(problems, fmt.Sprintf("device %s: consumed %s %s exceeds its capacity", id, value.String(), capName))
			}
		}
	}
	return problems
}

func selectorProblems(celCache *cel.Cache, classes map[string]*resourceapi.DeviceClass, claim *resourceapi.ResourceClaim,
	result resourceapi.DeviceRequestAllocationResult, device *resourceapi.Device) []string {
	var selectors []resourceapi.DeviceSelector
	className := ""
	for _, request := range claim.Spec.Devices.Requests {
		if request.Exactly != nil && request.Name == result.Request {
			className, selectors = request.Exactly.DeviceClassName, request.Exactly.Selectors
		}
		for _, sub := range request.FirstAvailable {
			if request.Name+"/"+sub.Name == result.Request {
				className, selectors = sub.DeviceClassName, sub.Selectors
			}
		}
	}
	class, ok := classes[className]
	if !ok {
		return []string{fmt.Sprintf("%s/%s: request %s has no class %q", claim.Namespace, claim.Name, result.Request, className)}
	}
	input := cel.Device{Driver: result.Driver, AllowMultipleAllocations: device.AllowMultipleAllocations, Attributes: device.Attributes, Capacity: device.Capacity}
	for _, selector := range append(append([]resourceapi.DeviceSelector{}, class.Spec.Selectors...), selectors...) {
		if selector.CEL == nil {
			continue
		}
		compiled := celCache.GetOrCompile(selector.CEL.Expression)
		if compiled.Error != nil {
			return []string{fmt.Sprintf("%s/%s: selector %q: %v", claim.Namespace, claim.Name, selector.CEL.Expression, compiled.Error)}
		}
		matches, _, err := compiled.DeviceMatches(context.Background(), input)
		if err != nil || !matches {
			return []string{fmt.Sprintf("%s/%s: device %s does not match %q (%v)", claim.Namespace, claim.Name, result.Device, selector.CEL.Expression, err)}
		}
	}
	return nil
}

func ptrBool(b *bool) bool { return b != nil && *b }
