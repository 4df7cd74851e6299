#!/usr/bin/env bash
# Issues 19 and 28, one call, by priority with absolute deadlines (bash SECONDS). On a host of 4 GPUs
# (nvidia-h100-x4), issue 28's order (the ZeRO-3 fix first; arms one after another where they share GPUs,
# each deadline leaving time for loading and compiling; arms write no checkpoints, llmft/benchmarks/gpu/trainer_entry.py):
#   1. Llama-3-8B full fine-tuning with DeepSpeed ZeRO-3 on 2 GPUs (GPUs 2,3) beside Llama-3-8B LoRA on
#      1 GPU (GPU 0), then ZeRO-3 on 4 GPUs;
#   2. Llama-3-8B LoRA DDP on 4 GPUs (weak scaling: 64 samples per GPU per step, the tuned project arm), then
#      on 2 GPUs (GPUs 0,1) as time allows;
#   3. the multi-node path (two torchrun "nodes" of 2 GPUs against one node of 4, SIGTERM, restart) last.
# On a host of 2 GPUs (nvidia-h100-x2 / nvidia-h200-x2; what is lent while 4-GPU kinds are withheld) the same
# steps at half the width: 8B LoRA on 1 then 2 GPUs, two "nodes" of 1 GPU against one node of 2, ZeRO-3 8B
# full on 2 GPUs, then the Qwen2.5-1.5B shape (LoRA, full) on 1 and 2 GPUs as time allows.
# usage (repo root on the GPU machine): bash llmft/benchmarks/gpu/scaleout.sh   (writes under $OUT)
set -uo pipefail
. llmft/benchmarks/gpu/device_env.sh
(DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
  .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1; echo "deepspeed install rc=$?" >> "$W/ds_install.log") &
nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m | head -8
GPUS=$(nvidia-smi --list-gpus | wc -l); echo "GPUs: $GPUS"
bench() { python3 -m llmft bench train --work "$W" "$@" 2>&1 | tee -a "$OUT/bench.log"; }
left() { echo $(( $1 - SECONDS )); }


if [ "$GPUS" -eq 2 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import write_model_dir; \
write_model_dir('llama-3-8b', Path('/tmp/llmft-project/models'))" && echo "8B checkpoint written at ${SECONDS}s"
  # 1. 8B LoRA: 1 GPU, then DDP over 2 (64 samples per GPU per step).
  CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label 1gpu --jobs "check,project:llama-3-8b:lora" --steps 14 --warmup 4 \
    --deadline-s $(left 150) --arm-timeout-s $(left 150)
  bench --out "$OUT" --label ddp-2gpu --jobs "project:llama-3-8b:lora" --steps 14 --warmup 4 --extra "--nproc 2" \
    --deadline-s $(left 250) --arm-timeout-s $(left 250)
  # 2. The multi-node path: two "nodes" of 1 GPU against one node of 2 (Qwen2.5-0.5B shape, uncompiled).
  timeout $(left 390) python3 -m llmft.benchmarks.gpu.multinode --model qwen2.5-0.5b --gpus-per-node 1 --steps 30 \
    --preempt-at 10 --timeout 80 --logs "$W/multinode-logs" --json-out "$OUT/multinode.json" 2>&1 | tail -n 40
  echo "multinode done at ${SECONDS}s"
  # 3. ZeRO-3 full fine-tuning of the 8B shape on 2 GPUs (fused loss with the gathered head; layers uncompiled).
  wait; cat "$W/ds_install.log"
  Z3="--override distributed.backend=deepspeed --override distributed.zero_stage=3 --no-compile"
  bench --out "$OUT" --label zero3-2gpu --jobs "project:llama-3-8b:full" --steps 8 --warmup 3 --extra "--nproc 2 $Z3" \
    --deadline-s $(left 520) --arm-timeout-s $(left 520)
  # 4. Qwen2.5-1.5B LoRA on 1 and 2 GPUs with the current code, as time allows.
  CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label 1gpu --jobs "project:qwen2.5-1.5b:lora" --steps 20 \
    --deadline-s $(left 555) --arm-timeout-s $(left 555)
  bench --out "$OUT" --label ddp-2gpu --jobs "project:qwen2.5-1.5b:lora" --steps 20 --extra "--nproc 2" \
    --deadline-s $(left 588) --arm-timeout-s $(left 588)
  tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' .
  echo "done at ${SECONDS}s"; exit 0
fi

# Second 4-GPU call (`bash llmft/benchmarks/gpu/scaleout.sh zero3-multinode`): ZeRO-3 8B full on 2 then 4 GPUs, both
# with gradient checkpointing (the 2-GPU arm ran out of memory without it), then the multi-node path.
if [ "${1:-}" = "zero3-multinode" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import write_model_dir; \
write_model_dir('llama-3-8b', Path('/tmp/llmft-project/models'))" && echo "8B checkpoint written at ${SECONDS}s"
  wait; cat "$W/ds_install.log"
  Z3="--override distributed.backend=deepspeed --override distributed.zero_stage=3 --no-compile"
  Z3="$Z3 --override model.gradient_checkpointing=true"
  CUDA_VISIBLE_DEVICES=0,1 bench --out "$OUT" --label zero3-ckpt-2gpu --jobs "project:llama-3-8b:full" --steps 8 \
    --warmup 3 --extra "--nproc 2 $Z3" --deadline-s $(left 250) --arm-timeout-s $(left 250)
  bench --out "$OUT" --label zero3-ckpt-4gpu --jobs "project:llama-3-8b:full" --steps 8 --warmup 3 \
    --extra "--nproc 4 $Z3" --deadline-s $(left 420) --arm-timeout-s $(left 420)
  timeout $(left 570) python3 -m llmft.benchmarks.gpu.multinode --model qwen2.5-0.5b --gpus-per-node 2 --steps 30 \
    --preempt-at 10 --timeout 80 --logs "$W/multinode-logs" --json-out "$OUT/multinode.json" 2>&1 | tail -n 40
  tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='./models' --exclude='./data' --exclude='./runs' .
  echo "done at ${SECONDS}s"; exit 0
fi

# The 8B checkpoint once, before the arms read it.
CUDA_VISIBLE_DEVICES=0 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import write_model_dir; \
write_model_dir('llama-3-8b', Path('/tmp/llmft-project/models'))" && echo "8B checkpoint written at ${SECONDS}s"
wait; cat "$W/ds_install.log"; df -h /tmp | tail -1
Z3="--override distributed.backend=deepspeed --override distributed.zero_stage=3 --no-compile"

# 1. ZeRO-3 8B full on GPUs 2,3 (separate result folder, merged below) beside 8B LoRA on GPU 0; then ZeRO-3 on 4.
(CUDA_VISIBLE_DEVICES=2,3 python3 -m llmft bench train --work "$W" --out "$W/z2out" --label zero3-2gpu \
  --jobs "project:llama-3-8b:full" --steps 8 --warmup 3 --extra "--nproc 2 $Z3" \
  --deadline-s $(left 330) --arm-timeout-s $(left 330) > "$W/z2.log" 2>&1) &
Z2=$!
CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label 1gpu --jobs "check,project:llama-3-8b:lora" --steps 14 --warmup 4 \
  --deadline-s $(left 300) --arm-timeout-s $(left 300)
wait $Z2; tail -n 30 "$W/z2.log"; bench --out "$OUT" --jobs "" --merge-from "$W/z2out"; df -h /tmp | tail -1
bench --out "$OUT" --label zero3-4gpu --jobs "project:llama-3-8b:full" --steps 8 --warmup 3 --extra "--nproc 4 $Z3" \
  --deadline-s $(left 450) --arm-timeout-s $(left 450)

# 2. 8B LoRA DDP on 4 GPUs, then 2.
bench --out "$OUT" --label ddp-4gpu --jobs "project:llama-3-8b:lora" --steps 14 --warmup 4 --extra "--nproc 4" \
  --deadline-s $(left 565) --arm-timeout-s $(left 565)
[ $(left 585) -gt 90 ] && CUDA_VISIBLE_DEVICES=0,1 bench --out "$OUT" --label ddp-2gpu --jobs "project:llama-3-8b:lora" \
  --steps 14 --warmup 4 --extra "--nproc 2" --deadline-s $(left 585) --arm-timeout-s $(left 585)

# 3. The multi-node path (Qwen2.5-0.5B shape, uncompiled: correctness and the restart, not speed), if time remains.
[ $(left 590) -gt 100 ] && timeout $(left 590) python3 -m llmft.benchmarks.gpu.multinode --model qwen2.5-0.5b \
  --gpus-per-node 2 --steps 30 --preempt-at 10 --timeout 90 --logs "$W/multinode-logs" \
  --json-out "$OUT/multinode.json" 2>&1 | tail -n 40
tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='./models' --exclude='./data' --exclude='./runs' .
echo "done at ${SECONDS}s"
