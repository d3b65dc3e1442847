package main

import (
	"context"
	"strings"
	"time"

	"github.com/samber/lo"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

const (
	kwokAnnotation = "kwok.x-k8s.io/node"
	kwokProviderID = "kwok://"
	untaintEvery   = 500 * time.Millisecond
)

// notReadyLifter does the node-lifecycle controller's one job that Karpenter waits for: once kwok
// reports a node Ready, the not-ready taint (set at creation by the TaintNodesByCondition admission
// plugin) goes.
func notReadyLifter(kubeClient client.Client) manager.RunnableFunc {
	return func(ctx context.Context) error {
		ticker := time.NewTicker(untaintEvery)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-ticker.C:
				liftNotReadyTaints(ctx, kubeClient)
			}
		}
	}
}

func liftNotReadyTaints(ctx context.Context, kubeClient client.Client) {
	nodes := &corev1.NodeList{}
	if err := kubeClient.List(ctx, nodes); err != nil {
		log.FromContext(ctx).Error(err, "listing nodes")
		return
	}
	for i := range nodes.Items {
		node := &nodes.Items[i]
		if !strings.HasPrefix(node.Spec.ProviderID, kwokProviderID) || node.Annotations[kwokAnnotation] == "" || !ready(node) {
			continue
		}
		kept := lo.Reject(node.Spec.Taints, func(t corev1.Taint, _ int) bool { return t.Key == corev1.TaintNodeNotReady })
		if len(kept) == len(node.Spec.Taints) {
			continue
		}
		stored := node.DeepCopy()
		node.Spec.Taints = kept
		// Optimistic: Karpenter syncs its own taints onto the same list.
		if err := kubeClient.Patch(ctx, node, client.MergeFromWithOptions(stored, client.MergeFromWithOptimisticLock{})); err != nil {
			log.FromContext(ctx).V(1).Info("lifting not-ready taint, retrying", "node", node.Name, "error", err.Error())
		}
	}
}

func ready(node *corev1.Node) bool {
	return lo.SomeBy(node.Status.Conditions, func(c corev1.NodeCondition) bool {
		return c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue
	})
}
