// Karpenter's operator and controllers with Karpenter's kwok cloud provider, wrapped so that each
// instance type describes the DRA devices fgpu publishes on that machine type (from `fgpu
// slice-template --format karpenter` outputs) and its nodes carry fgpu's machine label: what the
// test bed's autoscaling tests run (testbed/cluster/karpenter_manager.py).
package main

import (
	"github.com/samber/lo"
	"sigs.k8s.io/controller-runtime/pkg/log"

	kwok "sigs.k8s.io/karpenter/kwok/cloudprovider"
	kwokoptions "sigs.k8s.io/karpenter/kwok/options"
	"sigs.k8s.io/karpenter/pkg/cloudprovider/overlay"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/node/health"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"
)

func main() {
	ctx, op := operator.NewOperator()
	logger := log.FromContext(ctx)
	instanceTypes := lo.Must(kwok.ConstructInstanceTypes(ctx))
	devices := lo.Must(readDynamicResources(optionsFrom(ctx).DynamicResourcesDir, optionsFrom(ctx).ShareCountersOnce))
	metadata := lo.Must(readNodeMetadata(kwokoptions.FromContext(ctx).InstanceTypesFilePath))
	for name, resources := range devices {
		logger.Info("instance type devices", "instance-type", name,
			"slice-templates", len(resources.ResourceSliceTemplates), "attribute-bindings", len(resources.AttributeBindings))
	}

	withDevices := NewCloudProvider(ctx, op.GetClient(), instanceTypes, devices, metadata)
	cloudProvider := overlay.Decorate(withDevices, op.GetClient(), op.InstanceTypeStore)
	repairPolicies := lo.Must(health.NewRepairPolicyMatcher(ctx, cloudProvider))
	clusterState := state.NewCluster(op.Clock, op.GetClient(), cloudProvider, state.WithRepairPolicyMatcher(repairPolicies))
	if optionsFrom(ctx).LiftNotReadyTaint {
		lo.Must0(op.Add(notReadyLifter(op.GetClient())))
	}
	op.WithControllers(ctx, controllers.NewControllers(
		ctx, op.Manager, op.Clock, op.GetClient(), op.EventRecorder, cloudProvider, withDevices,
		clusterState, op.InstanceTypeStore, op.PredictionStore,
	)...).Start(ctx)
}
