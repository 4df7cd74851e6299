#!/usr/bin/env bash
# Issue 46 (speed, round five, one H200): device calls with absolute deadlines (bash SECONDS). Run from the tree
# under test (the device sends the lead's checkout; this tree travels in .speed/, the code before the MoE changes
# in .speed/.before/: `git archive` of the commit the results name). Wheels (bitsandbytes) are installed by the
# call's command line before it changes into this tree. usage: bash llmft/benchmarks/gpu/round6.sh PLAN
#   call1  the product's 1.5B LoRA row profiled (while the 30B-A3B FP8 checkpoint is written beside it), then the
#          shipped 30B-A3B QLoRA config with the code before (.before/) and after the MoE changes, each with one
#          profiled step and synchronized step marks (5 steps: 1-2 compile, 3 profiled, 4-5 timed).
#   call2  (cold) the 30B FP8 and 8B checkpoints written beside the 0.5B LoRA product row, then the 30B-A3B QLoRA
#          config with the final code (profiled as in call 1), then the 7B config on the 8B shape (step-marked).
#   call3  (warm, after call2) the MoE GPU check (check_moe.py: grouped, rows compiled, 4-bit, against an fp32
#          copy), then the 1.5B full config.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
OUT=${OUT:-/tmp/out}; W=/tmp/wb; mkdir -p "$OUT" "$W"
bench() { python3 -m llmft bench train --work "$W" "$@" 2>&1 | tee -a "$OUT/bench.log"; }
left() { echo $(( $1 - SECONDS )); }
MOE="project-product:qwen3-30b-a3b:qlora"
MOE_ARGS=(--steps 5 --warmup 3 --product-extra="--marks --profile-step 3")

nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/bench.log"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/bench.log"
import torch, transformers, peft, bitsandbytes, triton
print("versions", torch.__version__, transformers.__version__, peft.__version__, bitsandbytes.__version__, triton.__version__)
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [a @ b for _ in range(10)]; e.record(); torch.cuda.synchronize()
print(f"matmul 8192^3 bf16: {10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s")
EOF
df -h /tmp | tail -1 | tee -a "$OUT/bench.log"

case "${1:?plan}" in
  call1)
    (python3 -m llmft.benchmarks.gpu.fp8_checkpoint --out /tmp/llmft-project/models > "$W/ckpt.log" 2>&1
     echo "fp8 checkpoint rc=$? at ${SECONDS}s" >> "$W/ckpt.log") &
    CKPT=$!
    bench --out "$OUT" --label r6-prof --jobs "project-product:qwen2.5-1.5b:lora" --steps 30 --warmup 10 \
      --product-extra="--profile-step 5" --deadline-s 170 --arm-timeout-s 165
    wait $CKPT; cat "$W/ckpt.log" | tee -a "$OUT/bench.log"; du -sh /tmp/llmft-project/models/* | tee -a "$OUT/bench.log"
    bench --out "$OUT" --label r6-after --jobs "$MOE" "${MOE_ARGS[@]}" --deadline-s $(left 370) --arm-timeout-s $(left 370)
    (cd .before && python3 -m llmft bench train --work "$W" --out "$W/before" --label r6-before --jobs "$MOE" \
       "${MOE_ARGS[@]}" --deadline-s $(left 565) --arm-timeout-s $(left 565)) 2>&1 | tee -a "$OUT/bench.log"
    bench --out "$OUT" --jobs "" --merge-from "$W/before"
    ;;
  call2)
    (python3 -m llmft.benchmarks.gpu.fp8_checkpoint --out /tmp/llmft-project/models > "$W/ckpt.log" 2>&1
     echo "fp8 checkpoint rc=$? at ${SECONDS}s" >> "$W/ckpt.log") &
    CKPT=$!
    (python3 -c "from pathlib import Path; from llmft.benchmarks.gpu.arm_project import write_model_dir; \
write_model_dir('llama-3-8b', Path('/tmp/llmft-project/models'))" > "$W/ckpt8b.log" 2>&1
     echo "8b checkpoint rc=$? at ${SECONDS}s" >> "$W/ckpt8b.log") &
    CKPT8=$!
    bench --out "$OUT" --label r6 --jobs "project-product:qwen2.5-0.5b:lora" --steps 30 --warmup 10 \
      --deadline-s 140 --arm-timeout-s 135
    wait $CKPT $CKPT8; cat "$W/ckpt.log" "$W/ckpt8b.log" | tee -a "$OUT/bench.log"
    bench --out "$OUT" --label r6-final --jobs "$MOE" "${MOE_ARGS[@]}" --deadline-s $(left 370) --arm-timeout-s $(left 370)
    bench --out "$OUT" --label r6 --jobs "project-product:llama-3-8b:lora" --steps 5 --warmup 3 --product-extra="--marks" \
      --deadline-s $(left 565) --arm-timeout-s $(left 565)
    ;;
  call3)
    timeout 150 python3 -m llmft.benchmarks.gpu.check_moe --layers 2 --tokens 8192 --json-out "$OUT/check-moe.json" \
      > "$W/check_moe.log" 2>&1; echo "check_moe rc=$?" | tee -a "$OUT/bench.log"
    bench --out "$OUT" --label r6 --jobs "project-product:qwen2.5-1.5b:full" --steps 30 --warmup 10 \
      --deadline-s $(left 330) --arm-timeout-s $(left 330)
    ;;
  *) echo "unknown plan $1"; exit 2 ;;
esac
grep -h "\[profile\]\|fast path:\|base model:\|steps of\|MFU\|tokens_per_s=" "$W"/*.log 2>/dev/null | cut -c1-400 > "$OUT/summary.log"
tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='./models' --exclude='./data' --exclude='./runs' . \
  2>/dev/null
df -h /tmp | tail -1; echo "done at ${SECONDS}s"
