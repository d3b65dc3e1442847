package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unique"

	resourcev1 "k8s.io/api/resource/v1"

	"sigs.k8s.io/karpenter/pkg/cloudprovider"
)

// templateFile is `fgpu slice-template --format karpenter -o json`: DynamicResources in the
// resource.k8s.io API's field names.
type templateFile struct {
	ResourceSliceTemplates []sliceTemplate    `json:"resourceSliceTemplates"`
	AttributeBindings      []attributeBinding `json:"attributeBindings"`
}

type sliceTemplate struct {
	Driver         string                  `json:"driver"`
	Pool           poolRef                 `json:"pool"`
	Devices        []resourcev1.Device     `json:"devices"`
	SharedCounters []resourcev1.CounterSet `json:"sharedCounters"`
}

type poolRef struct {
	Name string `json:"name"`
}

type attributeBinding struct {
	Attribute resourcev1.QualifiedName `json:"attribute"`
	Devices   []deviceRef              `json:"devices"`
}

type deviceRef struct {
	Driver string `json:"driver"`
	Pool   string `json:"pool"`
	Device string `json:"device"`
}

// readDynamicResources reads every <instance type>.json in dir; an empty dir reads nothing.
// sharesWithoutCounters: see Options.ShareCountersOnce.
func readDynamicResources(dir string, sharesWithoutCounters bool) (map[string]cloudprovider.DynamicResources, error) {
	found := map[string]cloudprovider.DynamicResources{}
	if dir == "" {
		return found, nil
	}
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	for _, path := range paths {
		resources, err := readTemplateFile(path, sharesWithoutCounters)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		found[strings.TrimSuffix(filepath.Base(path), ".json")] = resources
	}
	return found, nil
}

func readTemplateFile(path string, sharesWithoutCounters bool) (cloudprovider.DynamicResources, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return cloudprovider.DynamicResources{}, err
	}
	var file templateFile
	if err := json.Unmarshal(raw, &file); err != nil {
		return cloudprovider.DynamicResources{}, err
	}
	resources := cloudprovider.DynamicResources{}
	for _, slice := range file.ResourceSliceTemplates {
		template, err := toTemplate(slice, sharesWithoutCounters)
		if err != nil {
			return cloudprovider.DynamicResources{}, err
		}
		resources.ResourceSliceTemplates = append(resources.ResourceSliceTemplates, template)
	}
	for _, binding := range file.AttributeBindings {
		bound := &cloudprovider.AttributeBinding{Attribute: binding.Attribute}
		for _, ref := range binding.Devices {
			bound.Devices = append(bound.Devices, cloudprovider.DeviceID{
				Driver: unique.Make(ref.Driver), Pool: unique.Make(ref.Pool), Device: unique.Make(ref.Device),
			})
		}
		resources.AttributeBindings = append(resources.AttributeBindings, bound)
	}
	return resources, nil
}

func toTemplate(slice sliceTemplate, sharesWithoutCounters bool) (*cloudprovider.ResourceSliceTemplate, error) {
	// Karpenter drops a template's devices when it also has counters: say so rather than lose them.
	if len(slice.Devices) > 0 && len(slice.SharedCounters) > 0 {
		return nil, errors.New("a slice template has both devices and sharedCounters")
	}
	template := &cloudprovider.ResourceSliceTemplate{
		Driver:         unique.Make(slice.Driver),
		Pool:           cloudprovider.ResourcePool{Name: unique.Make(slice.Pool.Name)},
		SharedCounters: slice.SharedCounters,
	}
	for _, device := range slice.Devices {
		multiple := device.AllowMultipleAllocations != nil && *device.AllowMultipleAllocations
		counters := device.ConsumesCounters
		if multiple && sharesWithoutCounters {
			counters = nil
		}
		template.Devices = append(template.Devices, cloudprovider.Device{
			Name:                     unique.Make(device.Name),
			Attributes:               device.Attributes,
			Capacity:                 device.Capacity,
			AllowMultipleAllocations: multiple,
			ConsumesCounters:         counters,
		})
	}
	return template, nil
}
