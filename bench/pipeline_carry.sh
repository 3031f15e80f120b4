#!/bin/bash
# The files bench/pipeline.py imports, from this checkout, as one tar.xz for the device tool
# (with the 58 MiB .gpubundle, a full tree copy is over the 64 MiB a call carries).
#   bench/pipeline_carry.sh /work/main/.dev-pipe-tar   # -> code.tar.xz (about 0.4 MB)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: $0 OUTDIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$src"
for d in operator/src worker_image/src protos/gen/python crds tests/cluster tests/worker tests/fakegpu tests/scale; do
  git ls-files -z "$d" | grep -zv '/test_[^/]*\.py$' | grep -zv '\.pyi$' | xargs -0 -I{} cp --parents {} "$tmp/"
done
mkdir -p "$tmp/bench"
for f in __init__ pipeline pipeline_run pipeline_host gpu_e2e gpu_e2e_analysis gpu_e2e_children gpu_e2e_cluster gpu_e2e_host gpu_e2e_models gpu_e2e_squeeze gpu_e2e_summary qwen_image_like worker_sleep sleep_limits sleep_models serving_models operator_switch reporting; do
  cp "bench/$f.py" "$tmp/bench/"
done
cp tests/__init__.py pyproject.toml "$tmp/"
dirty=$(git status --porcelain --untracked-files=no)
echo "$(git rev-parse HEAD)${dirty:+ (with uncommitted changes)}" > "$tmp/COMMIT"
mkdir -p "$out"
tar cJf "$out/code.tar.xz" -C "$tmp" .
ls -la "$out/code.tar.xz"
