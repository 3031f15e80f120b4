{{/*
RBAC rules of the operator, exactly what the operator needs (see the README's RBAC section).
Namespaced rules are rendered once into a ClusterRole (rbac.scope=Cluster) or into a Role in each
served namespace (rbac.scope=Namespaced). Adding a rule here widens what a compromised operator
can do: keep tests/unit/test_chart_rbac.py in step and say why in a comment.
*/}}
{{- define "omnistage.rbac.stageRules" -}}
# OmniStages: read the desired state; patch/update only for kopf's finalizer and progress
# annotations on the object itself.
- apiGroups: ["omnistage.io"]
  resources: ["omnistages"]
  verbs: ["get", "list", "watch", "patch", "update"]
# OmniStage status: the operator is the only writer of observed facts (ACKs, memory, conditions).
- apiGroups: ["omnistage.io"]
  resources: ["omnistages/status"]
  verbs: ["get", "patch", "update"]
# OmniPipelines: read the stages and batch policy (an index and an event handler, no writes to
# the object); status is the operator's alone (stages, queue per stage, swaps, batches).
- apiGroups: ["omnistage.io"]
  resources: ["omnipipelines"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["omnistage.io"]
  resources: ["omnipipelines/status"]
  verbs: ["get", "patch"]
# Worker pods: one per stage; deleted when the stage goes and when a stage is fenced after a
# failed sleep ACK. No update/patch: a pod is replaced, never edited; no pods/exec, pods/log.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Worker Services: the stable gRPC address of each stage.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# Worker token: the operator copies its token into each stage namespace as the Secret
# "omnistage-worker-token". Kubernetes cannot limit "create" by name, so create is granted
# alone; reading and changing is limited to that one name. No list/watch of Secrets at all.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: ["omnistage-worker-token"]
  verbs: ["get", "patch", "update"]
# Events: one per stage transition (kopf posts core events; newer clients events.k8s.io).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# DRA placement: one shared ResourceClaim per colocation group, deleted with its last stage.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get", "list", "watch", "create", "delete"]
{{- if .Values.leaderElection.enabled }}
# Namespace claims (with leader election): the leader claims each served namespace before it
# orders a worker there, in one Lease of that namespace, so two releases serving one namespace
# never both order it. "create" cannot be limited by name, so it is granted alone; reading and
# writing (conditional patches) is limited to the claim's one name. No list/watch, no delete.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: ["omnistage-namespace-claim"]
  verbs: ["get", "patch"]
{{- end }}
{{- if and .Values.peering.enabled (not (include "omnistage.watchNamespaces" . | fromJsonArray | empty)) }}
# kopf peering (namespaced operator): find and mark live peers in each served namespace.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{/*
Cluster-scoped rules needed whatever the scope: kopf lists CRDs to learn the resource and
namespaces to resolve its namespace list; the operator lists ResourceSlices (cluster-scoped
objects) for device identities; and the cluster-wide peering object.
*/}}
{{- define "omnistage.rbac.frameworkRules" -}}
# kopf: discover the OmniStage resource definition.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# kopf: follow namespaces to serve the ones it was told to.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
# DRA placement: read the ResourceSlices (cluster-scoped) of the driver that allocated a group's
# claim, to learn the allocated devices' UUIDs and check the workers report those devices.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceslices"]
  verbs: ["list"]
{{- if and .Values.peering.enabled (include "omnistage.watchNamespaces" . | fromJsonArray | empty) }}
# kopf peering (cluster-wide operator): find and mark live peers.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{/*
Leader election, in the release namespace only: the replicas' Lease (named after the release)
and the Events on it. "create" cannot be limited by name, so it is granted alone; reading and
writing (merge patches carrying the resourceVersion) is limited to the one Lease. No list/watch.
*/}}
{{- define "omnistage.rbac.leaderElectionRules" -}}
# Leader election: create the Lease the first time.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
# Leader election: read, renew and take over only this release's Lease.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "omnistage.fullname" . | quote }}]
  verbs: ["get", "patch"]
# Leader election: the last granted epoch outlives the Lease (a re-created Lease continues
# above it), in one ConfigMap named after the Lease.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["configmaps"]
  resourceNames: [{{ printf "%s-epoch" (include "omnistage.fullname" .) | quote }}]
  verbs: ["get", "patch"]
# Leader election: LeaderElected/LeaderLost Events on the Lease.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
