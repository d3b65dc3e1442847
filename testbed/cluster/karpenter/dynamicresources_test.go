package main

import (
	"os"
	"path/filepath"
	"testing"
)

// A two-device template as `fgpu slice-template --format karpenter -o json` prints it: a whole GPU
// and its MPS device drawing on one counter set, and a binding of their parent's UUID.
const template = `{
  "resourceSliceTemplates": [
    {"driver": "gpu.fgpu.dev", "pool": {"name": "m"},
     "sharedCounters": [{"name": "gpu-0-counters", "counters": {"memory-slice-0": {"value": "1"}}}]},
    {"driver": "gpu.fgpu.dev", "pool": {"name": "m"}, "devices": [
      {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
       "capacity": {"memory": {"value": "80Gi"}},
       "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": {"memory-slice-0": {"value": "1"}}}]},
      {"name": "gpu-0-mps", "allowMultipleAllocations": true, "attributes": {"type": {"string": "mps"}},
       "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi"}}},
       "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": {"memory-slice-0": {"value": "1"}}}]}
    ]}
  ],
  "attributeBindings": [{"attribute": "gpu.fgpu.dev/parentUUID", "devices": [
    {"driver": "gpu.fgpu.dev", "pool": "m", "device": "gpu-0"},
    {"driver": "gpu.fgpu.dev", "pool": "m", "device": "gpu-0-mps"}]}]
}`

func writeTemplate(t *testing.T, text string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "dgx-h100.json"), []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestReadDynamicResources(t *testing.T) {
	found, err := readDynamicResources(writeTemplate(t, template), false)
	if err != nil {
		t.Fatal(err)
	}
	resources, ok := found["dgx-h100"]
	if !ok || len(resources.ResourceSliceTemplates) != 2 || len(resources.AttributeBindings) != 1 {
		t.Fatalf("want the file's 2 templates and 1 binding under its name, got %+v", found)
	}
	counters, devices := resources.ResourceSliceTemplates[0], resources.ResourceSliceTemplates[1]
	if counters.Pool.Name.Value() != "m" || len(counters.SharedCounters) != 1 || len(counters.Devices) != 0 {
		t.Errorf("counter template: %+v", counters)
	}
	whole, mps := devices.Devices[0], devices.Devices[1]
	if whole.Name.Value() != "gpu-0" || whole.AllowMultipleAllocations || len(whole.ConsumesCounters) != 1 {
		t.Errorf("whole GPU: %+v", whole)
	}
	if !mps.AllowMultipleAllocations || len(mps.ConsumesCounters) != 1 || mps.Capacity["memory"].RequestPolicy == nil {
		t.Errorf("MPS device: %+v", mps)
	}
	if attr := mps.Attributes["type"]; attr.StringValue == nil || *attr.StringValue != "mps" {
		t.Errorf("MPS device's type: %+v", attr)
	}
	binding := resources.AttributeBindings[0]
	if binding.Attribute != "gpu.fgpu.dev/parentUUID" || binding.Devices[1].Device.Value() != "gpu-0-mps" {
		t.Errorf("binding: %+v", binding)
	}
}

func TestShareCountersOnceLeavesOutOnlyTheSharesCounters(t *testing.T) {
	found, err := readDynamicResources(writeTemplate(t, template), true)
	if err != nil {
		t.Fatal(err)
	}
	devices := found["dgx-h100"].ResourceSliceTemplates[1].Devices
	if len(devices[0].ConsumesCounters) != 1 || len(devices[1].ConsumesCounters) != 0 {
		t.Errorf("want the whole GPU's counters kept and the MPS device's left out: %+v", devices)
	}
}

func TestATemplateWithDevicesAndCountersIsRefused(t *testing.T) {
	both := `{"resourceSliceTemplates": [{"driver": "d", "pool": {"name": "p"},
	  "devices": [{"name": "a"}], "sharedCounters": [{"name": "c", "counters": {}}]}]}`
	if _, err := readDynamicResources(writeTemplate(t, both), false); err == nil {
		t.Error("want an error: Karpenter would drop the devices")
	}
}
