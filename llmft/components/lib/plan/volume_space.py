"""The plan step's estimate of what a run writes on the data volume, against that volume's size.

A checkpoint holds the trained weights (the LoRA adapter in float32, or every parameter as float32
master weights for full fine-tuning) and AdamW's two float32 moments per trained parameter, so
12 bytes per trained parameter (full: 12 N). The trainer keeps ``keep_last`` complete checkpoints
besides the best one and writes the next before pruning, so ``keep_last + 2`` exist at once; then
``final/`` and the promoted copy hold the weights once each, and a merged serving form (a full bf16
copy of the base, 2 N) comes on top. Parameter counts come from the model's ``config.json``
(llmft/trainer/sizing/memory.py's model: ``parameter_counts``, ``adapter_parameters``).

The pipeline mounts an existing PVC (``volume_pvc_name``) at ``volume_path`` and requests no size itself, so
the plan step compares the estimate with the free space of the mounted volume
(``shutil.disk_usage``) and refuses, in one line, a run that cannot fit: a full volume found at the
first checkpoint costs the GPU time up to it. Where ``volume_path`` is not mounted (render-job, unit
tests) or the model's config.json is not readable (a hub id that is not in the local cache), the
check is skipped with a note. Torch-free (the pipeline image).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmft.trainer.errors import ConfigError
from llmft.trainer.flops import ALL_LINEAR, shape_from_config
from llmft.trainer.sizing.memory import Setup, adapter_parameters, parameter_counts
from llmft.trainer.storage import human

FP32 = 4
MOMENTS = 2 * FP32


@dataclass(frozen=True)
class Footprint:
    """Bytes a run writes on the volume, by part."""

    checkpoint: int
    checkpoints_at_once: int
    weights: int
    merged: int

    @property
    def total(self) -> int:
        return self.checkpoint * self.checkpoints_at_once + 2 * self.weights + self.merged

    def describe(self) -> str:
        merged = f" + merged model {human(self.merged)}" if self.merged else ""
        return (
            f"{self.checkpoints_at_once} checkpoints x {human(self.checkpoint)} (weights and AdamW moments) + final/ "
            f"and the promoted copy 2 x {human(self.weights)}{merged}"
        )


def model_config(name_or_path: str, hub_cache: str, revision: str | None = None) -> dict | None:
    """``config.json`` of a model directory, or of a hub id in the hub cache ``hub_cache`` (the volume's,
    where the data steps download); None when not readable here."""
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        path = cached_hub_file(hub_cache, name_or_path, "config.json", revision) or path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def cached_hub_file(hub_cache: str, repo_id: str, filename: str, revision: str | None = None) -> Path | None:
    """``filename`` of model ``repo_id`` at ``revision`` (default main) in a huggingface_hub cache, read
    without huggingface_hub (the pipeline image has none): ``models--<org>--<name>/refs/<revision>`` names the
    commit, ``snapshots/<commit>/<filename>`` is the file, as huggingface_hub 2.4.0 file_download.py
    ``try_to_load_from_cache`` resolves it (lines 1584-1613). None when not there."""
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    commit = revision or "main"
    ref = repo / "refs" / commit
    if ref.is_file():
        commit = ref.read_text().strip()
    file = repo / "snapshots" / commit / filename
    return file if "/" not in commit and file.is_file() else None


def estimate(config: dict, *, method: str, lora_rank: int, targets: tuple[str, ...], keep_last: int, merged: bool):
    """The :class:`Footprint` of a run on the model ``config`` (a config.json dict)."""
    shape = shape_from_config(config)
    _, total = parameter_counts(shape, bool(config.get("tie_word_embeddings", False)))
    if method == "full":
        trained = total
    else:
        names = ALL_LINEAR if not targets or "all-linear" in targets else targets
        trained = adapter_parameters(Setup(shape=shape, method=method, lora_rank=lora_rank, lora_targets=names))
    return Footprint(
        checkpoint=trained * (FP32 + MOMENTS),
        checkpoints_at_once=keep_last + 2,
        weights=trained * FP32,
        merged=2 * total if merged else 0,
    )


def run_footprint(plan, config) -> tuple[Footprint | None, str]:
    """(the run's :class:`Footprint`, "") from the model's config.json, or (None, why it could not be read)."""
    model = model_config(plan.trainer.model, plan.layout.hf_env()["HF_HUB_CACHE"], config.model.revision)
    if model is None:
        return None, f"config.json of {plan.trainer.model} is not readable here"
    try:
        footprint = estimate(
            model,
            method=plan.trainer.method,
            lora_rank=config.lora.r,
            targets=tuple(config.lora.target_modules),
            keep_last=config.keep_last,
            merged=plan.serving.serving_mode == "merged" or bool(plan.serving.form_note),
        )
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"{plan.trainer.model}'s config.json has no usable shape ({exc})"
    return footprint, ""


def check_volume_space(plan, config, data_root: str) -> str:
    """ConfigError (one line) when the run's estimated footprint exceeds the free space at ``volume_path``;
    else a note for the plan step's log (what was estimated, or why nothing was; '' where no volume is mounted)."""
    root = Path(data_root)
    if not root.is_dir():
        return ""
    footprint, why_not = run_footprint(plan, config)
    if footprint is None:
        return f"volume space not checked: {why_not}"
    usage = shutil.disk_usage(root)
    summary = f"about {human(footprint.total)} ({footprint.describe()})"
    if footprint.total > usage.free:
        raise ConfigError(
            f"the data volume at {data_root} has {usage.free} bytes ({human(usage.free)}) free of "
            f"{human(usage.total)}, but this run writes {summary}. Free space on the PVC (volume_pvc_name), resize it, "
            "or keep fewer checkpoints (finetune_overrides keep_last=1)"
        )
    return f"volume: this run writes {summary}; {human(usage.free)} free of {human(usage.total)} at {data_root}"
