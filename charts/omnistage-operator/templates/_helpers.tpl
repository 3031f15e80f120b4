{{/*
Chart name, truncated to the 63 characters a label value allows.
*/}}
{{- define "omnistage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every object: fullnameOverride, else <release>-<chart> (just <release> when
the release name already contains the chart name).
*/}}
{{- define "omnistage.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "omnistage.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select the operator pod. The NetworkPolicy uses the same set to let only the
operator reach the workers, so keep them stable across upgrades.
*/}}
{{- define "omnistage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omnistage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "omnistage.labels" -}}
helm.sh/chart: {{ include "omnistage.chart" . }}
{{ include "omnistage.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: omnistage
{{- end }}

{{- define "omnistage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omnistage.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Operator image reference: repository:tag, or repository:tag@digest when a digest is pinned.
*/}}
{{- define "omnistage.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding the worker bearer token (generated or given).
*/}}
{{- define "omnistage.tokenSecretName" -}}
{{- default (printf "%s-worker-token" (include "omnistage.fullname" .)) .Values.workerToken.existingSecret }}
{{- end }}

{{- define "omnistage.peeringName" -}}
{{- default (include "omnistage.fullname" .) .Values.peering.name }}
{{- end }}

{{/*
Namespaces the operator serves, as a JSON list; empty means every namespace. In Namespaced RBAC
scope an empty watch.namespaces means the release namespace only.
*/}}
{{- define "omnistage.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- .Values.watch.namespaces | uniq | toJson }}
{{- else if eq .Values.rbac.scope "Namespaced" }}
{{- list .Release.Namespace | toJson }}
{{- else }}
{{- list | toJson }}
{{- end }}
{{- end }}

{{/*
Namespaces that get the worker NetworkPolicy, as a JSON list: networkPolicy.namespaces, else the
served namespaces, else (operator serving every namespace) the release namespace.
*/}}
{{- define "omnistage.networkPolicyNamespaces" -}}
{{- $watch := include "omnistage.watchNamespaces" . | fromJsonArray }}
{{- if .Values.networkPolicy.namespaces }}
{{- .Values.networkPolicy.namespaces | uniq | toJson }}
{{- else if $watch }}
{{- $watch | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/*
Checks of value combinations the JSON schema cannot express.
*/}}
{{- define "omnistage.validate" -}}
{{- if eq (int .Values.ports.metrics) (int .Values.ports.liveness) }}
{{- fail "ports.metrics and ports.liveness must differ" }}
{{- end }}
{{- if and (eq .Values.workerCredentials.mode "kubernetes") (not (include "omnistage.watchNamespaces" . | fromJsonArray)) }}
{{- fail "workerCredentials.mode=kubernetes needs watch.namespaces: the chart creates the workers' ServiceAccount omnistage-worker in each" }}
{{- end }}
{{- $le := .Values.leaderElection }}
{{- if and (not $le.enabled) (gt (int .Values.replicaCount) 1) }}
{{- fail "replicaCount > 1 needs leaderElection.enabled: two operators without a leader could both wake stages of one group" }}
{{- end }}
{{- if $le.enabled }}
{{- if not (gt (float64 $le.leaseDuration) (float64 $le.renewDeadline)) }}
{{- fail "leaderElection.renewDeadline must be below leaderElection.leaseDuration (the leader must stop before a standby may take over)" }}
{{- end }}
{{- if not (gt (float64 $le.renewDeadline) (float64 $le.retryPeriod)) }}
{{- fail "leaderElection.retryPeriod must be below leaderElection.renewDeadline" }}
{{- end }}
{{- end }}
{{- end }}
