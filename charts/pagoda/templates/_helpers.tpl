{{/* Chart name, overridable. */}}
{{- define "pagoda.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: "<release>-<chart>" unless the release name already holds the chart name. */}}
{{- define "pagoda.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.operatorName" -}}
{{- printf "%s-operator" (include "pagoda.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "pagoda.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pagoda.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagoda
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector of the operator pods; never changes across upgrades. */}}
{{- define "pagoda.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "pagoda.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagoda.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "pagoda.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) -}}
{{- end -}}

{{/* Namespaces the operator watches in namespaced mode. */}}
{{- define "pagoda.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson .Values.watch.namespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* The restricted Pod Security Standard, for every container the chart runs. */}}
{{- define "pagoda.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pagoda.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- /* Namespaced rules: what the operator reads and writes next to each InferenceDeployment. */}}
{{- define "pagoda.namespacedRules" -}}
- apiGroups: ["pagoda.dev"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["pagoda.dev"]
  resources: ["inferencedeployments/status", "inferencedeployments/scale"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# the router in front of the engines (spec.routing)
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# spec.autoscaling: an HPA on the InferenceDeployment's scale subresource, or a KEDA ScaledObject
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# spec.gateway: the InferencePool (the Gateway API Inference Extension's CRDs are installed by whoever runs the
# gateway, never by this chart)
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# a replica spanning nodes (spec.parallelism, or a model larger than a node's GPUs): a LeaderWorkerSet (its CRDs
# are installed by whoever runs LeaderWorkerSet, never by this chart)
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# engine pods: read their terminations (re-fit after out-of-memory), delete a crash-looping one of an old plan
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
# after an engine image change: the memory a Ready engine measured (GET /pagoda/memory via the pod proxy)
- apiGroups: [""]
  resources: ["pods/proxy"]
  verbs: ["get"]
# hf:// and s3:// models: the cache claim, the download Job and its progress (the log's JSON lines)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
{{- end -}}
{{- /* Cluster-scoped reads: GPU discovery from node labels, and whether the ServiceMonitor / KEDA CRDs exist. */}}
{{- define "pagoda.clusterReadRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- end -}}
