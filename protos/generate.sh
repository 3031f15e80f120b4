#!/usr/bin/env bash
# Regenerates the committed Python stubs (messages, gRPC, and their type stubs) from the protos.
# Usage: protos/generate.sh [PYTHON]   (CI runs it and fails if git sees a difference)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-${PYTHON:-python3}}"
bindir="$(dirname "$(command -v "$py" || echo "$py")")"
out="$here/gen/python"
rm -rf "$out/omnistage"
mkdir -p "$out"
PATH="$bindir:$PATH" "$py" -m grpc_tools.protoc \
  --proto_path="$here" \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --mypy_out="$out" \
  --mypy_grpc_out="$out" \
  "$here"/omnistage/worker/v1/*.proto
for d in "$out/omnistage" "$out/omnistage/worker" "$out/omnistage/worker/v1"; do
  printf '"""Generated from protos/omnistage/worker/v1 by protos/generate.sh; do not edit."""\n' >"$d/__init__.py"
done
touch "$out/omnistage/py.typed"
