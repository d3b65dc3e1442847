{{/* The release's base name: fgpu unless overridden. */}}
{{- define "fgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "fgpu.name" . -}}
{{- end -}}
{{- end -}}

{{- define "fgpu.labels" -}}
app.kubernetes.io/name: {{ include "fgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component (kubelet-plugin, controller): never change across upgrades. */}}
{{- define "fgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fgpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "fgpu.pluginServiceAccount" -}}
{{- printf "%s-kubelet-plugin" (include "fgpu.fullname" .) -}}
{{- end -}}

{{- define "fgpu.controllerServiceAccount" -}}
{{- printf "%s-controller" (include "fgpu.fullname" .) -}}
{{- end -}}

{{/* The API server address for host-network pods without a service network (values apiServer). */}}
{{- define "fgpu.apiServerEnv" -}}
{{- if or .Values.apiServer.host .Values.apiServer.port }}
{{- if not (and .Values.apiServer.host .Values.apiServer.port) }}
{{- fail "apiServer.host and apiServer.port go together" }}
{{- end }}
- {name: KUBERNETES_SERVICE_HOST, value: {{ .Values.apiServer.host | quote }}}
- {name: KUBERNETES_SERVICE_PORT, value: {{ .Values.apiServer.port | quote }}}
{{- end }}
{{- end -}}

{{- define "fgpu.mockNvml" -}}
{{- hasPrefix "mock:" .Values.nvml -}}
{{- end -}}

{{/* The featureGates map as Kubernetes components take it: Name=true,Other=false. */}}
{{- define "fgpu.featureGates" -}}
{{- $gates := list -}}
{{- range $name, $enabled := .Values.featureGates -}}
{{- $gates = append $gates (printf "%s=%v" $name $enabled) -}}
{{- end -}}
{{- join "," $gates -}}
{{- end -}}

{{/* The webhook's objects' name: its Deployment, Service, ServiceAccount and configuration. */}}
{{- define "fgpu.webhookName" -}}
{{- printf "%s-webhook" (include "fgpu.fullname" .) -}}
{{- end -}}

{{/* Where the webhook's serving certificate comes from (docs/admission.md, "Certificates"):
  self-managed (the webhook keeps it in a Secret it makes), cert-manager, or existing-secret. */}}
{{- define "fgpu.webhookCertMode" -}}
{{- $w := .Values.webhook -}}
{{- if and $w.certManager.enabled $w.tls.existingSecret -}}
{{- fail "webhook.certManager.enabled and webhook.tls.existingSecret: choose one" -}}
{{- else if $w.certManager.enabled -}}
cert-manager
{{- else if $w.tls.existingSecret -}}
existing-secret
{{- else if $w.tls.caBundle -}}
{{- fail "webhook.tls.caBundle goes with webhook.tls.existingSecret (the Secret its certificate is in)" -}}
{{- else -}}
self-managed
{{- end -}}
{{- end -}}

{{/* Whether the webhook writes its configurations' caBundle: self-managed (from its Secret), or an
  existing Secret whose CA it copies. */}}
{{- define "fgpu.webhookWritesCaBundle" -}}
{{- $mode := include "fgpu.webhookCertMode" . -}}
{{- if or (eq $mode "self-managed") (and (eq $mode "existing-secret") (not .Values.webhook.tls.caBundle)) -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the webhook gates pods of opt-in claims (a MutatingWebhookConfiguration): only where
  the controller runs, which lifts the gate. */}}
{{- define "fgpu.webhookGatesPods" -}}
{{- if and .Values.webhook.gatePods.enabled .Values.controller.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the webhook gives pods whose claims ask for fgpu's devices the toleration of the nodes
  kept for pods with GPUs (webhook.gpuPodsToleration, a taint key). */}}
{{- define "fgpu.webhookToleratesGpuNodes" -}}
{{- if .Values.webhook.gpuPodsToleration -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the webhook reads the claims and templates pods name at create (POST /mutate): to gate
  pods of opt-in claims, or to give pods with fgpu's claims the toleration. */}}
{{- define "fgpu.webhookReadsPodClaims" -}}
{{- if or (include "fgpu.webhookGatesPods" .) (include "fgpu.webhookToleratesGpuNodes" .) -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the controller places the pods without claims of the namespaces that opt in (with the
  webhook: it gates them). */}}
{{- define "fgpu.controllerPlacesPods" -}}
{{- if and .Values.controller.enabled .Values.controller.placePods.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the webhook has a MutatingWebhookConfiguration: it gates pods of opt-in claims or gives
  pods with fgpu's claims a toleration, gates pods without claims for the controller to place, or
  sizes new claims. */}}
{{- define "fgpu.webhookMutates" -}}
{{- if or (include "fgpu.webhookReadsPodClaims" .) (include "fgpu.controllerPlacesPods" .) .Values.webhook.rightsize.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the webhook calls the API server: to write a caBundle, to read claims and templates, or
  (automatic sizing) pods, namespaces and the usage histories. */}}
{{- define "fgpu.webhookUsesApi" -}}
{{- if or (include "fgpu.webhookWritesCaBundle" .) (include "fgpu.webhookReadsPodClaims" .) .Values.webhook.rightsize.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* A Deployment's replicas kept apart and kept up through voluntary disruptions (a node drained,
  an autoscaler consolidating nodes: Karpenter and Cluster Autoscaler evict through the Eviction
  API, which honours PodDisruptionBudgets). Called with (dict "root" . "component" C "values" V). */}}
{{- define "fgpu.spreadAcrossNodes" -}}
{{- if .values.spreadAcrossNodes }}
topologySpreadConstraints:
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "fgpu.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "fgpu.disruptionBudget" -}}
{{- with .values.maxUnavailable }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "fgpu.fullname" $.root }}-{{ $.component }}
  namespace: {{ $.root.Release.Namespace }}
  labels:
    {{- include "fgpu.labels" $.root | nindent 4 }}
    app.kubernetes.io/component: {{ $.component }}
spec:
  maxUnavailable: {{ . }}
  selector:
    matchLabels:
      {{- include "fgpu.selectorLabels" $ | nindent 6 }}
{{- end }}
{{- end -}}
