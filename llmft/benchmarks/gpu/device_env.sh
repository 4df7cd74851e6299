# Sourced by the GPU session scripts (scaleout.sh, round5.sh) on the device machine, from the repo root: the
# environment every arm runs in (offline; NVLink multicast off, benchmarks/NOTES.md; DeepSpeed's op builder reads
# TORCH_CUDA_ARCH_LIST=9.0, not the image's 9.0a), the carried wheels (.whl/) on PYTHONPATH, and $OUT / $W.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}; W=/tmp/wb; mkdir -p "$OUT" "$W"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
