#!/usr/bin/env bash
# Writes the chart's templated copy of a CRD (stdout) from its one source (the argument): the
# source's header comment out, the object under `{{- if .Values.crds.enabled }}`, the
# `helm.sh/resource-policy: keep` annotation under `{{- if .Values.crds.keep }}` and the
# release's labels beside the source's, so that `helm upgrade` applies the CRD and
# `helm uninstall` leaves it (and every OmniStage).
# Usage: crds/chart-template.sh crds/omnistages.omnistage.io.yaml   (run by `make generate`)
set -euo pipefail
src="$1"
if grep -q '{{' "$src"; then
  echo "$src contains '{{', which helm would read as a template action" >&2
  exit 1
fi
grep -q '^  name: ' "$src" || { echo "$src: no metadata.name line" >&2; exit 1; }
grep -q '^  labels:$' "$src" || { echo "$src: no metadata.labels block" >&2; exit 1; }
printf '{{- /* Generated from %s by `make generate`: edit the source, not this file. */}}\n' "$src"
printf '{{- if .Values.crds.enabled }}\n'
awk '
  /^apiVersion:/ { body = 1 }
  !body { next }
  { print }
  !done && /^  name: / {
    print "  {{- if .Values.crds.keep }}"
    print "  annotations:"
    print "    helm.sh/resource-policy: keep"
    print "  {{- end }}"
    done = 1
  }
  !labelled && /^  labels:$/ {
    print "    app.kubernetes.io/instance: {{ .Release.Name }}"
    print "    app.kubernetes.io/managed-by: {{ .Release.Service }}"
    print "    helm.sh/chart: {{ include \"omnistage.chart\" . }}"
    labelled = 1
  }
' "$src"
printf '{{- end }}\n'
