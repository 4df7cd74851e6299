"""Full fine-tuning: every weight of the model trains.

setup() -> train() -> cleanup(). Under DDP the weights and AdamW state stay
float32 and bf16 autocast does the compute on CUDA; under DeepSpeed ZeRO-2/3
the engine keeps float32 master weights of bf16 parameters and shards them
(ZeRO-3 also partitions the weights while loading). Checkpoints and
output_dir/final/ hold the full weights as safetensors. FLOPs per token for
MFU: 6N + attention per document.
"""

from __future__ import annotations

import functools

from llmft.trainer import loop
from llmft.trainer.config import TrainConfig
from llmft.trainer.distributed import init_distributed
from llmft.trainer.model import autocast, resolve_dtype


class FullFinetuneRecipe:
    """One full fine-tuning run on this rank."""

    def __init__(self, cfg: TrainConfig, warnings: list[str] | None = None):
        self.cfg, self.warnings = cfg, warnings or []
        self.run = None

    def setup(self) -> None:
        cfg = self.cfg
        loop.install_sigterm_handler()
        info = init_distributed(cfg.distributed.comm_backend, cfg.distributed.timeout_s)
        compute = resolve_dtype(cfg.model.dtype, info.device)
        autocast_ctx = functools.partial(autocast, info.device, compute, cfg.distributed.backend == "ddp")
        self.run, self.tokenizer, self.base_identity, counts, resume_path = loop.build_run(
            cfg, info, lora=False, autocast_ctx=autocast_ctx
        )
        loop.announce(self.run, counts, resume_path, self.warnings)

    def train(self) -> dict:
        loop.train_loop(self.run)
        final_dir = loop.write_final(self.run, self.tokenizer, self.base_identity)
        return loop.finish(self.run, final_dir, self.base_identity)

    def save_checkpoint(self, step: int) -> None:
        loop.save_now(self.run, step)

    def cleanup(self) -> None:
        loop.close_run(self.run)
