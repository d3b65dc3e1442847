package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/samber/lo"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kwok "sigs.k8s.io/karpenter/kwok/cloudprovider"
	v1 "sigs.k8s.io/karpenter/pkg/apis/v1"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/scheduling"
)

// nodeMetadata is what the test bed adds to an instance type in kwok's instance types file (kwok's
// reader ignores the fields): labels every node of the type carries (as single-valued instance
// type requirements, so NodePools and pods can select on them) and annotations.
type nodeMetadata struct {
	Name        string            `json:"name"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

func readNodeMetadata(path string) (map[string]nodeMetadata, error) {
	found := map[string]nodeMetadata{}
	if path == "" {
		return found, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var entries []nodeMetadata
	if err := json.Unmarshal(raw, &entries); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, entry := range entries {
		found[entry.Name] = entry
	}
	return found, nil
}

// CloudProvider is Karpenter's kwok provider given instance types with DRA devices and node
// labels; its Create adds the chosen type's annotations. Everything else is kwok's.
type CloudProvider struct {
	*kwok.CloudProvider
	instanceTypes []*cloudprovider.InstanceType
	metadata      map[string]nodeMetadata
}

func NewCloudProvider(ctx context.Context, kubeClient client.Client, instanceTypes []*cloudprovider.InstanceType,
	devices map[string]cloudprovider.DynamicResources, metadata map[string]nodeMetadata) *CloudProvider {
	enriched := make([]*cloudprovider.InstanceType, 0, len(instanceTypes))
	for _, it := range instanceTypes {
		it = it.DeepCopy()
		if resources, ok := devices[it.Name]; ok {
			it.DynamicResources = resources
		}
		for key, value := range metadata[it.Name].Labels {
			// kwok labels a node with its type's single-valued requirements.
			it.Requirements.Add(scheduling.NewRequirement(key, corev1.NodeSelectorOpIn, value))
			v1.WellKnownLabels.Insert(key) // selectable by pods without a NodePool naming it
		}
		enriched = append(enriched, it)
	}
	// kwok builds its nodes from the instance types it holds: it gets the enriched ones.
	inner := kwok.NewCloudProvider(ctx, kubeClient, enriched)
	return &CloudProvider{CloudProvider: inner, instanceTypes: enriched, metadata: metadata}
}

// Create launches through kwok. When the candidate instance types carry annotations, it first
// picks the one kwok would (the cheapest available compatible offering), so the node gets that
// type's annotations.
func (c *CloudProvider) Create(ctx context.Context, nodeClaim *v1.NodeClaim) (*v1.NodeClaim, error) {
	candidates := c.candidates(nodeClaim)
	if !lo.SomeBy(candidates, func(it *cloudprovider.InstanceType) bool { return len(c.metadata[it.Name].Annotations) > 0 }) {
		return c.CloudProvider.Create(ctx, nodeClaim)
	}
	chosen := cheapest(candidates, scheduling.NewNodeSelectorRequirementsWithMinValues(nodeClaim.Spec.Requirements...))
	if chosen == nil {
		return nil, cloudprovider.NewInsufficientCapacityError(fmt.Errorf("no available offering for nodeclaim %s", nodeClaim.Name))
	}
	narrowed := nodeClaim.DeepCopy()
	for i, requirement := range narrowed.Spec.Requirements {
		if requirement.Key == corev1.LabelInstanceTypeStable {
			narrowed.Spec.Requirements[i].Values = []string{chosen.Name}
		}
	}
	narrowed.Annotations = lo.Assign(narrowed.Annotations, c.metadata[chosen.Name].Annotations)
	return c.CloudProvider.Create(ctx, narrowed)
}

func (c *CloudProvider) candidates(nodeClaim *v1.NodeClaim) []*cloudprovider.InstanceType {
	requirement, found := lo.Find(nodeClaim.Spec.Requirements, func(r v1.NodeSelectorRequirementWithMinValues) bool {
		return r.Key == corev1.LabelInstanceTypeStable
	})
	if !found {
		return nil
	}
	return lo.Filter(c.instanceTypes, func(it *cloudprovider.InstanceType, _ int) bool {
		return lo.Contains(requirement.Values, it.Name)
	})
}

func cheapest(candidates []*cloudprovider.InstanceType, requirements scheduling.Requirements) *cloudprovider.InstanceType {
	var chosen *cloudprovider.InstanceType
	price := 0.0
	for _, it := range candidates {
		for _, offering := range it.Offerings.Available().Compatible(requirements) {
			if chosen == nil || offering.Price < price {
				chosen, price = it, offering.Price
			}
		}
	}
	return chosen
}
