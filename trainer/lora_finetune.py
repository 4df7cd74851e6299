"""LoRA, QLoRA and DoRA fine-tuning: the frozen base model plus a PEFT adapter.

setup() -> train() -> cleanup(). The base stays in the compute dtype (4-bit NF4
for QLoRA, CUDA only), the adapter in float32; only the adapter is trained,
checkpointed (adapter_model.safetensors + adapter_config.json) and shipped in
output_dir/final/. FLOPs per token for MFU: 4N for the frozen matmuls (no weight
gradients) + 6 x adapter parameters + attention per document.
"""

from __future__ import annotations

import contextlib

from llmft.trainer import loop
from llmft.trainer.config import TrainConfig
from llmft.trainer.distributed import init_distributed
from llmft.trainer.model import check_method_supported


class LoRAFinetuneRecipe:
    """One LoRA / QLoRA / DoRA run on this rank."""

    def __init__(self, cfg: TrainConfig, warnings: list[str] | None = None):
        self.cfg, self.warnings = cfg, warnings or []
        self.run = None

    def setup(self) -> None:
        cfg = self.cfg
        loop.install_sigterm_handler()
        info = init_distributed(cfg.distributed.comm_backend, cfg.distributed.timeout_s)
        check_method_supported(cfg, info.device)  # QLoRA without CUDA fails here, before any loading
        # The adapter trains in float32 beside the frozen base in its compute dtype: no autocast.
        self.run, self.tokenizer, self.base_identity, counts, resume_path = loop.build_run(
            cfg, info, lora=True, autocast_ctx=contextlib.nullcontext
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
