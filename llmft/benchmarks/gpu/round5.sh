#!/usr/bin/env bash
# Issue 37 (speed, round four), device calls by priority with absolute deadlines (bash SECONDS); arms write no
# checkpoints where they fine-tune fully (arm_product.product_command). usage, repo root on the GPU machine:
#   bash llmft/benchmarks/gpu/round5.sh zero3   (nvidia-h100-x2) item 1: the shipped llama-3-8b-full-zero3-4xh100.yaml on
#       2 GPUs, the product path (`llmft bench train`, project-product); then item 3's dropout arms (tuned at 0.05
#       and 0, the product 1.5B LoRA) and the 0.5B product row, two 1-GPU arms at a time.
#   bash llmft/benchmarks/gpu/round5.sh h100    (nvidia-h100-x2) the 8B full row on 2 H100s, then the 7B LoRA and 1.5B full
#       configs (one GPU each).
#   bash llmft/benchmarks/gpu/round5.sh h100mem (2 H200s, warm) the 8B full row with the GPUs' free memory held down to an
#       H100's (llmft/benchmarks/gpu/hold_memory.py): the plan made for an 80 GB card, tried for fit.
#   bash llmft/benchmarks/gpu/round5.sh rows    (same host, warm) items 4 and 5: the 30B-A3B QLoRA config (GPU 0; its load
#       peak apart from training's), the 7B LoRA config on the 8B shape (GPU 1), the 1.5B full config (GPU 2).
set -uo pipefail
. llmft/benchmarks/gpu/device_env.sh
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; cat COMMIT 2>/dev/null
bench() { python3 -m llmft bench train --work "$W" "$@" 2>&1 | tee -a "$OUT/bench.log"; }
left() { echo $(( $1 - SECONDS )); }
model() { CUDA_VISIBLE_DEVICES=$1 python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import \
write_model_dir; write_model_dir('$2', Path('/tmp/llmft-project/models'))" && echo "$2 checkpoint written at ${SECONDS}s"; }

case "${1:?plan}" in
  zero3)  # 2 GPUs (nvidia-h100-x2; 4-GPU kinds were not lent when this ran): the 8B row first, then pairs of 1-GPU arms
    if [ ! -d /tmp/site/deepspeed ]; then
      (DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
        .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1; echo "deepspeed install rc=$?" >> "$W/ds_install.log") &
    fi
    model 0 llama-3-8b &
    model 1 qwen2.5-1.5b; model 1 qwen2.5-0.5b; wait; cat "$W/ds_install.log"
    bench --out "$OUT" --label r5-2gpu --jobs "project-product:llama-3-8b:full" --steps 14 --warmup 10 \
      --extra "--nproc 2" --deadline-s $(left 320) --arm-timeout-s $(left 320)
    # item 3's arms in one call: the product 1.5B LoRA (GPU 1) beside the tuned arm at 0.05 (GPU 0), then the
    # tuned arm at 0 beside the 0.5B product row. The drop0 arm's 31 steps give it its own data folder.
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --work "$W" --out "$W/g1" --label r5 --steps 30 --warmup 10 \
       --jobs "project-product:qwen2.5-1.5b:lora,project-product:qwen2.5-0.5b:lora" --deadline-s $(left 560) \
       --arm-timeout-s 130 > "$W/g1.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5-drop05 --steps 30 --warmup 5 --jobs "project:qwen2.5-1.5b:lora" \
      --extra "--override lora.dropout=0.05" --deadline-s $(left 500) --arm-timeout-s 120
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5-drop0 --steps 31 --warmup 5 --jobs "project:qwen2.5-1.5b:lora" \
      --deadline-s $(left 570) --arm-timeout-s $(left 570)
    wait; tail -n 5 "$W/g1.log"; bench --out "$OUT" --jobs "" --merge-from "$W/g1"
    ;;
  h100)  # 2 H100s: the 8B full row (item 1) on the card it is named for, then the 7B LoRA config on the 8B shape
    # (GPU 0) beside the 1.5B full config (GPU 1) (item 5)
    if [ ! -d /tmp/site/deepspeed ]; then
      (DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
        .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1; echo "deepspeed install rc=$?" >> "$W/ds_install.log") &
    fi
    model 0 llama-3-8b &
    model 1 qwen2.5-1.5b; wait; cat "$W/ds_install.log"
    bench --out "$OUT" --label r5-2gpu --jobs "project-product:llama-3-8b:full" --steps 14 --warmup 10 \
      --extra "--nproc 2" --deadline-s $(left 330) --arm-timeout-s $(left 330)
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --work "$W" --out "$W/g1" --label r5 --steps 30 --warmup 10 \
       --jobs "project-product:qwen2.5-1.5b:full" --deadline-s $(left 560) --arm-timeout-s $(left 570) > "$W/g1.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5 --steps 14 --warmup 10 --jobs "project-product:llama-3-8b:lora" \
      --deadline-s $(left 560) --arm-timeout-s $(left 575)
    wait; tail -n 5 "$W/g1.log"; bench --out "$OUT" --jobs "" --merge-from "$W/g1"
    ;;
  h100mem)  # 2 H200s offering an H100's free memory (hold_memory.py): does the 8B full plan for an 80 GB card fit?
    [ -d /tmp/site/deepspeed ] || DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation \
      --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz > "$W/ds_install.log" 2>&1
    model 0 llama-3-8b
    python3 -m llmft.benchmarks.gpu.hold_memory --free-gib 77.7 > "$W/hold.log" 2>&1 &
    HOLD=$!; for i in $(seq 60); do grep -q held "$W/hold.log" && break; sleep 1; done; cat "$W/hold.log"
    bench --out "$OUT" --label r5-2gpu-h100mem --jobs "project-product:llama-3-8b:full" --steps 14 --warmup 10 \
      --extra "--nproc 2" --deadline-s $(left 540) --arm-timeout-s $(left 540)
    kill $HOLD; nvidia-smi --query-gpu=memory.used --format=csv
    ;;
  h100pair)  # 2 H100s, warm, about 5 minutes: item 3's arm pair (GPU 0) beside the 1-GPU product rows (GPU 1)
    model 0 qwen2.5-1.5b & model 1 qwen2.5-0.5b; wait
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --work "$W" --out "$W/h1" --label r5-h100 --steps 30 \
       --warmup 10 --jobs "project-product:qwen2.5-1.5b:lora,project-product:qwen2.5-1.5b:full,project-product:qwen2.5-0.5b:lora" \
       --deadline-s $(left 270) --arm-timeout-s 110 > "$W/h1.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5-h100-drop05 --steps 30 --warmup 5 --jobs "project:qwen2.5-1.5b:lora" \
      --extra "--override lora.dropout=0.05" --deadline-s $(left 200) --arm-timeout-s 120
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5-h100-drop0 --steps 31 --warmup 5 --jobs "project:qwen2.5-1.5b:lora" \
      --deadline-s $(left 300) --arm-timeout-s $(left 300)
    wait; tail -n 5 "$W/h1.log"; bench --out "$OUT" --jobs "" --merge-from "$W/h1"
    ;;
  rows)
    model 0 qwen3-30b-a3b &
    model 1 llama-3-8b; model 2 qwen2.5-1.5b; wait
    (CUDA_VISIBLE_DEVICES=1 python3 -m llmft bench train --work "$W" --out "$W/g1" --label r5 --steps 14 --warmup 10 \
       --jobs "project-product:llama-3-8b:lora" --deadline-s $(left 560) --arm-timeout-s $(left 560) > "$W/g1.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=2 python3 -m llmft bench train --work "$W" --out "$W/g2b" --label r5 --steps 30 --warmup 10 \
       --jobs "project-product:qwen2.5-1.5b:full" --deadline-s $(left 560) --arm-timeout-s $(left 560) > "$W/g2b.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 bench --out "$OUT" --label r5 --jobs "project-product:qwen3-30b-a3b:qlora" --steps 14 \
      --warmup 10 --deadline-s $(left 570) --arm-timeout-s $(left 570)
    wait; tail -n 5 "$W/g1.log" "$W/g2b.log"
    bench --out "$OUT" --jobs "" --merge-from "$W/g1"; bench --out "$OUT" --jobs "" --merge-from "$W/g2b"
    ;;
esac
tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='./models' --exclude='./data' --exclude='./runs' \
  --exclude='./g*/*.json' . 2>/dev/null
df -h /tmp | tail -1; echo "done at ${SECONDS}s"
