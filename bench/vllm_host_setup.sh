# Source on the GPU host: joins the slimmed vLLM staged by bench/vllm_bundle.py into /tmp/vsite
# (once per warm machine) and sets the environment a run of it needs.
# The calls before this one carried .vllm1 and .vllmdeps and copied them to /tmp/vs; this one
# carries .vllm2.
S=/tmp/vsite
if [ ! -f $S/.ok ]; then
  mkdir -p $S
  cat /tmp/vs/kernels.part.aa .vllm2/kernels.part.ab | xz -dc | tar x -C $S || return 1
  xz -dc .vllm2/vllm.tar.xz | tar x -C $S || return 1
  D=.vllm2/deps.tar.xz; [ -f $D ] || D=/tmp/vs/deps.tar.xz  # older bundles kept it in .vllm2
  xz -dc $D | tar x -C $S || return 1
  touch $S/.ok
fi
# The slimmed wheel has no FlashAttention libraries: the package reports them unavailable
# (FA2_AVAILABLE false) instead of raising at import, so the Triton attention backend runs.
sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # omnistage: slimmed wheel/' \
  $S/vllm/vllm_flash_attn/__init__.py || return 1
export PYTHONPATH=$S${PYTHONPATH:+:$PYTHONPATH}
# vLLM's kernels link libcudart.so.13, which PyTorch's cu13 wheels ship
NV=$(python3 -c "import os, nvidia; print(os.path.dirname(list(nvidia.__path__)[0]))")
for d in $(find "$NV/nvidia" -name 'libcudart.so.13*' -printf '%h\n' 2>/dev/null | sort -u); do
  export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
export VLLM_USE_FLASHINFER_SAMPLER=0  # no FlashInfer in the slimmed staging
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
