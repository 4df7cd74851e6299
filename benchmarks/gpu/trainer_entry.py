"""`python -m benchmarks.gpu.trainer_entry [trainer args]`: `python -m trainer` for the benchmark.

It registers trainer/fastpath's attention first and wraps
trainer.model.load_model only to print when the model is ready (compile time =
first step record - that moment). The trainer applies the fast path itself
(kernels.compile / kernels.fused_lora); for an older trainer without
trainer.model.apply_fastpath_kernels the harness applies it. Everything else is
the trainer's own code path, unchanged.
"""
from __future__ import annotations

import sys
import time


def main() -> int:
    from trainer import model as trainer_model
    from trainer.__main__ import main as trainer_main
    from trainer.fastpath import apply_kernels
    from trainer.fastpath.attention import register

    register()
    # The trainer applies trainer.fastpath itself (kernels.compile / kernels.fused_lora) when it
    # has trainer.model.apply_fastpath_kernels; only older trainers need the harness to do it.
    hooked = hasattr(trainer_model, "apply_fastpath_kernels")
    original = trainer_model.load_model

    def load_model(cfg, device, **kwargs):
        model = original(cfg, device, **kwargs)
        if cfg.kernels.compile and not hooked:
            print(f"[trainer_entry] fast path applied by the harness: {apply_kernels(model, compile_layers=True)}", flush=True)
        if device.type == "cuda":
            import torch

            segments = torch.cuda.memory._snapshot()["segments"]
            print(f"[trainer_entry] expandable segments: {any(s.get('is_expandable') for s in segments)}", flush=True)
        print(f"[trainer_entry] loaded={time.time()}", flush=True)  # compile time = first step record - this
        return model

    trainer_model.load_model = load_model
    return trainer_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
