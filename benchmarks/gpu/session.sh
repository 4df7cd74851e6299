#!/usr/bin/env bash
# Device-call wrapper: install the carried wheels, then run one named plan of benchmark jobs.
# usage (on the GPU machine, repo root): bash benchmarks/gpu/session.sh PLAN  (writes under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}; W=/tmp/wb; mkdir -p "$OUT" "$W"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
# The trainer defaults PyTorch's allocator to expandable segments; fall back if this machine refuses them.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -c "import torch; torch.empty(2**30, device='cuda'); print('expandable segments:', [s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']])" \
  || export PYTORCH_CUDA_ALLOC_CONF=""
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}  # kept between calls on a warm machine
bench() { python3 -m llmft bench train --out "$OUT" --work "$W" "$@" 2>&1 | tee -a "$OUT/bench.log"; }
P="--steps 30"  # our trainer: 30 steps, logged every step (per-step times and the first five losses)
fast() { local name=$1; shift; timeout "${T:-200}" python3 -m llmft.benchmarks.gpu.arm_fast --json-out "$W/$name.json" "$@" > "$W/$name.log" 2>&1; echo "[$name] rc=$? $(tail -c 600 "$W/$name.log" | tail -n 2)"; }
case "${1:?plan}" in
  diag)
    bench --jobs "check" --deadline-s 120
    fast fast15_profile --model qwen2.5-1.5b --method lora --profile-steps 2
    fast fast15_native --model qwen2.5-1.5b --method lora --gqa-mode native
    bench --jobs "project:qwen2.5-1.5b:lora,fastpath:qwen2.5-1.5b:full,peer:qwen2.5-1.5b:lora" --deadline-s 330 --arm-timeout-s 240
    ;;
  final1)  # one GPU: arms (a) + (c) on every shape, then issue 3's GPU check (100 steps)
    bench --label final --jobs "check,naive:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora,project:qwen2.5-1.5b:full,project:llama-3-8b:lora" --deadline-s 430 --arm-timeout-s 200
    timeout 130 python3 -m llmft.benchmarks.gpu.arm_project --model qwen2.5-0.5b --method lora --steps 100 --warmup 10 \
      --log-every 5 --arm-name gpu-check --json-out "$W/gpu_check.json" > "$W/gpu_check.log" 2>&1; echo "[gpu-check] rc=$?"
    left=$((570 - SECONDS)); [ $left -gt 70 ] && bench --label spp128 --jobs "project:qwen2.5-0.5b:lora" --samples-per-step 128 --extra "--micro 128" --deadline-s $left --arm-timeout-s $left
    ;;
  x2)  # two GPUs: 2-GPU scaling first, then one-GPU baselines on GPU0 while the peer arm compiles on GPU1
    export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1
    python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"; nvidia-smi topo -m
    Z3="--override distributed.backend=deepspeed --override distributed.zero_stage=3 --override kernels.fused_loss=false --override kernels.compile=false --override kernels.fused_lora=false"
    bench --label ddp-2gpu --jobs "project:qwen2.5-1.5b:lora" --extra "--nproc 2" --deadline-s 130 --arm-timeout-s 130
    bench --label zero3-2gpu --jobs "project:qwen2.5-1.5b:full" --steps 12 --extra "--nproc 2 $Z3" --deadline-s 150 --arm-timeout-s 150
    left=$((575 - SECONDS))
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --out "$W/bg" --work "$W/bgw" --label gpu1 --jobs "peer:qwen2.5-1.5b:lora" --steps 12 --deadline-s $left --arm-timeout-s $left > "$W/peer_bg.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --label gpu0 --jobs "check,naive:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:lora" --deadline-s 200 --arm-timeout-s 120
    CUDA_VISIBLE_DEVICES=0 bench --label zero3-1gpu --jobs "project:qwen2.5-1.5b:full" --steps 12 --extra "$Z3" --deadline-s $((570 - SECONDS)) --arm-timeout-s 150
    wait
    bench --jobs "" --merge-from "$W/bg"
    ;;
  one-a)  # one GPU, first call: calibration and the peer arm with most of the call (its flex-attention
           # compile took 226-256 s before its first step), then as many of our arms as time allows
    bench --jobs "check,peer:qwen2.5-1.5b:lora" --steps 12 --deadline-s 560 --arm-timeout-s 530
    bench --jobs "${A_THEN:-project:qwen2.5-1.5b:lora,naive:qwen2.5-1.5b:lora}" $P --deadline-s $((585 - SECONDS)) --arm-timeout-s 150
    ;;
  one-b)  # one GPU, second call on the same machine (warm Inductor cache): the other shapes and methods
    bench --jobs "${B_FIRST:-}project:qwen2.5-0.5b:lora,project:qwen2.5-1.5b:full" $P --deadline-s 330 --arm-timeout-s 150
    bench --jobs "project:llama-3-8b:lora" --steps 30 --extra=--micro=16 --deadline-s $((585 - SECONDS)) --arm-timeout-s 200
    if [ -n "${PEER_AGAIN:-}" ]; then  # the first call's peer arm did not finish: again, with its compile cache
      bench --label warm --jobs "peer:qwen2.5-1.5b:lora" --steps 12 --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    fi
    ;;
  ddp2)  # two GPUs: one-GPU baselines on GPU 0 of this host, then DDP over both (64 samples per GPU per step)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi topo -m
    CUDA_VISIBLE_DEVICES=0 bench --label 1gpu --jobs "check,project:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:full" $P --deadline-s 300 --arm-timeout-s 140
    bench --label ddp-2gpu --jobs "project:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:full" --steps 30 --extra=--nproc=2 \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s 150
    ;;
  ddp2full)  # two GPUs: full fine-tuning, one-GPU baseline on GPU 0, then DDP with fp32 and bf16 gradient all-reduce
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    CUDA_VISIBLE_DEVICES=0 bench --label 1gpu --jobs "check,project:qwen2.5-1.5b:full" $P --deadline-s 200 --arm-timeout-s 140
    bench --label ddp-2gpu --jobs "project:qwen2.5-1.5b:full" --steps 30 --extra=--nproc=2 --deadline-s $((500 - SECONDS)) --arm-timeout-s 150
    bench --label ddp-2gpu-bf16-reduce --jobs "project:qwen2.5-1.5b:full" --steps 30 \
      --extra="--nproc=2 --override=distributed.grad_reduce_dtype=bf16" --deadline-s $((585 - SECONDS)) --arm-timeout-s 150
    ;;
  peer)  # one GPU: our trainer, then the peer arm with the rest of the call and stack dumps every 100 s
    bench --jobs "check,project:qwen2.5-1.5b:lora" $P --deadline-s 160 --arm-timeout-s 120
    BENCH_STACK_EVERY=100 TORCH_LOGS=recompiles bench --jobs "peer:qwen2.5-1.5b:lora" --steps 10 \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    ;;
  peer-eager)  # one GPU: calibration, our trainer, naive, then the peer with its flex block mask built uncompiled
    bench --jobs "check,project:qwen2.5-1.5b:lora,naive:qwen2.5-1.5b:lora" $P --deadline-s 220 --arm-timeout-s 120
    BENCH_STACK_EVERY=100 bench --jobs "peer-eagermask:qwen2.5-1.5b:lora" --steps 12 \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    ;;
  peer-first)  # one GPU: calibration, the peer (transformers' block mask uncompiled) with most of the call, then ours and naive
    bench --jobs "check" --deadline-s 60
    BENCH_STACK_EVERY=100 bench --jobs "peer-eagermask:qwen2.5-1.5b:lora" --steps 12 --deadline-s 400 --arm-timeout-s 390
    bench --jobs "project:qwen2.5-1.5b:lora,naive:qwen2.5-1.5b:lora" $P --deadline-s $((590 - SECONDS)) --arm-timeout-s 110
    ;;
  profile)  # one GPU: ours on 1.5B and 0.5B LoRA, the previous trainer (.prev, carried) for A/B, then one profiled step of each
    bench --jobs "check,project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora" $P --deadline-s 200 --arm-timeout-s 110
    [ -d .prev ] && (cd .prev && bench --label prev --jobs "project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora" $P --deadline-s 180 --arm-timeout-s 100)
    BENCH_PROFILE_STEPS=20:20 BENCH_PROFILE_OUT=$W bench --label profiled --jobs "project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora" \
      --steps 22 --deadline-s $((585 - SECONDS)) --arm-timeout-s 100
    ;;
  grouped)  # one GPU: grouped q/k/v + gate/up (default) against the same code with kernels.grouped_lora=false, A/B on 1.5B and 0.5B, then 8B
    bench --jobs "check,project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora" $P --deadline-s 200 --arm-timeout-s 110
    bench --label ungrouped --jobs "project:qwen2.5-1.5b:lora,project:qwen2.5-0.5b:lora" $P --extra=--override=kernels.grouped_lora=false --deadline-s 160 --arm-timeout-s 90
    BENCH_PROFILE_STEPS=20:20 BENCH_PROFILE_OUT=$W bench --label profiled --jobs "project:qwen2.5-1.5b:lora" --steps 22 --deadline-s 80 --arm-timeout-s 75
    bench --jobs "project:llama-3-8b:lora" $P --extra=--micro=16 --deadline-s $((588 - SECONDS)) --arm-timeout-s $((585 - SECONDS))
    ;;
  table)  # one GPU, one call: every arm of the issue's table on the same GPU (8B last, as time allows)
    bench --jobs "check,project:qwen2.5-1.5b:lora,naive:qwen2.5-1.5b:lora" $P --deadline-s 190 --arm-timeout-s 110
    bench --jobs "peer-eagermask:qwen2.5-1.5b:lora" --steps 12 --deadline-s 110 --arm-timeout-s 105
    bench --jobs "project:qwen2.5-0.5b:lora,project:qwen2.5-1.5b:full" $P --deadline-s 190 --arm-timeout-s 105
    bench --jobs "project:llama-3-8b:lora" $P --extra=--micro=16 --deadline-s $((588 - SECONDS)) --arm-timeout-s $((585 - SECONDS))
    ;;
  *) echo "unknown plan $1"; exit 2 ;;
esac
tar czf "$OUT/logs.tgz" -C "$W" .
