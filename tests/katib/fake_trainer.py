"""A stand-in for `python -m llmft train` used by the fast local-sweep tests (the real trainer is
exercised in test_local_sweep_real.py). Run as ``fake_trainer.py -m llmft train key=value ...``.

eval_loss is a known function of the overrides, printed at three "evals" the way the trainer
prints it; ``lora.r=64`` exits 1 (a crashing trial); FAKE_SILENT=1 prints no metric."""

from __future__ import annotations

import math
import os
import sys


def main(argv: list[str]) -> int:
    assert argv[:3] == ["-m", "llmft", "train"], argv
    args = argv[3:]
    if args[:1] == ["--config"]:  # llmft train takes its options before the key=value items
        print(f"config {args[1]}")
        args = args[2:]
    overrides = dict(a.split("=", 1) for a in args)
    print(f"args {' '.join(args)}")
    print(f"parent_run={os.environ.get('LLMFT_MLFLOW_PARENT_RUN_ID', '')}")
    if overrides.get("lora.r") == "64":
        print("RuntimeError: CUDA out of memory", file=sys.stderr)
        return 1
    if os.environ.get("FAKE_SILENT"):
        return 0
    lr = float(overrides.get("optim.lr", "2e-4"))
    rank = float(overrides.get("lora.r", "16"))
    best = (math.log10(lr) + 3.5) ** 2 + rank / 100
    for step, extra in ((10, 0.5), (20, 0.1), (30, 0.2)):
        print(f"step {step}: eval_loss={best + extra:.6f} perplexity={math.exp(best + extra):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
