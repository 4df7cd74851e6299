"""Shared pieces of the training benchmark's arms (run on the GPU machine).

Model shapes (random init: nothing can be downloaded there), the seeded
synthetic SFT data, batch plans shared by every arm (same samples,
same order, same samples per optimizer step), timing and memory summaries.
Imports numpy at module level only; torch/transformers inside functions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from llmft.trainer import flops as flop_count

IGNORE_INDEX = -100

MODEL_SHAPES = {
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen2.5-1.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "llama-3-8b": dict(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=5e5,
    ),
    # Qwen/Qwen3-30B-A3B's config.json; 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        rope_theta=1e6,
    ),
}
# 4 of its 48 layers, for checks on one-GPU machines (a 7 GB checkpoint instead of 61 GB).
MODEL_SHAPES["qwen3-30b-a3b-4layers"] = {**MODEL_SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 4}

# Length profiles: log-normal lengths, first 35% of each sample masked from the loss.
PROFILES = {
    "short": dict(median=180, sigma=0.70, low=16, high=2048),
    "long": dict(median=600, sigma=0.90, low=16, high=4096),
}
PROMPT_FRACTION = 0.35


def hf_config(model: str, attn_implementation: str | None = None):
    """A transformers config of the named shape."""
    # heavy: transformers
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    spec = dict(MODEL_SHAPES[model])
    arch = spec.pop("arch")
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[arch]
    config = cls(max_position_embeddings=8192, rms_norm_eps=1e-6, use_cache=False, **spec)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return config


def build_model(model: str, attn_implementation: str, seed: int = 0, dtype: str = "bfloat16"):
    """Random-init model of the named shape, built directly on the GPU (seeded: equal across arms)."""
    # heavy: torch
    import torch

    # heavy: transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(model)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=getattr(torch, dtype)
        )
    return net


def sample_lengths(count: int, profile: str, seed: int) -> np.ndarray:
    spec = PROFILES[profile]
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(spec["median"]), sigma=spec["sigma"], size=count)
    return np.clip(np.round(raw), spec["low"], spec["high"]).astype(np.int64)


@dataclass
class Samples:
    """Synthetic SFT samples: token ids and unshifted labels (prompt part = -100)."""

    lengths: np.ndarray
    input_ids: list[np.ndarray]
    labels: list[np.ndarray]


def make_samples(count: int, profile: str, vocab: int, seed: int = 1234) -> Samples:
    lengths = sample_lengths(count, profile, seed)
    rng = np.random.default_rng(seed + 1)
    ids, labels = [], []
    for n in lengths:
        tokens = rng.integers(0, vocab, size=int(n), dtype=np.int64)
        lab = tokens.copy()
        lab[: int(PROMPT_FRACTION * n)] = IGNORE_INDEX
        ids.append(tokens)
        labels.append(lab)
    return Samples(lengths=lengths, input_ids=ids, labels=labels)


def supervised_targets(labels: np.ndarray) -> np.ndarray:
    """Next-token targets inside one document: target[i] = labels[i+1]; the last has none."""
    out = np.full_like(labels, IGNORE_INDEX)
    out[:-1] = labels[1:]
    return out


@dataclass
class StepTimer:
    """Wall times of optimizer steps (device synchronized at each step end)."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    supervised: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    _last: float | None = None

    def start(self) -> None:
        # heavy: torch
        import torch

        torch.cuda.synchronize()
        self._last = time.perf_counter()

    def step(self, tokens: int, supervised: int, loss: float | None = None) -> None:
        # heavy: torch
        import torch

        torch.cuda.synchronize()
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        self.tokens.append(int(tokens))
        self.supervised.append(int(supervised))
        if loss is not None:
            self.losses.append(float(loss))


def summarize(timer: StepTimer, warmup: int, flops_per_step: list[float], peak: float | None) -> dict:
    """Throughput over the steps after ``warmup``; first-step time reported as compile/warm-up."""
    # heavy: torch
    import torch

    timed = slice(warmup, None)
    seconds = sum(timer.times[timed])
    tokens = sum(timer.tokens[timed])
    supervised = sum(timer.supervised[timed])
    flops = sum(flops_per_step[timed])
    steps = np.array(timer.times[timed]) if timer.times[timed] else np.array([float("nan")])
    return {
        "steps_timed": len(timer.times[timed]),
        "tokens_per_s": tokens / seconds if seconds else None,
        "supervised_tokens_per_s": supervised / seconds if seconds else None,
        "tflops_per_s": flops / seconds / 1e12 if seconds else None,
        "mfu": flop_count.mfu(flops, seconds, peak),
        "step_s_p50": float(np.percentile(steps, 50)),
        "step_s_p90": float(np.percentile(steps, 90)),
        "first_step_s": timer.times[0] if timer.times else None,
        "warmup_s": sum(timer.times[:warmup]),
        "tokens_per_step_mean": float(np.mean(timer.tokens)) if timer.tokens else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_mem_gib": torch.cuda.max_memory_reserved() / 2**30,
        "first_losses": timer.losses[:5],
    }


def device_info() -> dict:
    # heavy: torch
    import torch

    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    for name in ("transformers", "peft", "triton", "liger_kernel", "deepspeed"):
        try:
            info[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:  # optional packages
            info[name] = None
    return info


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_jsonable))
    tmp.replace(path)


def remove_run_dir(run_dir: Path) -> None:
    """Delete a run folder an arm created for itself (``<work>/runs/<arm>-<time>``: checkpoints, final/,
    logs already copied out), so a call's later arms keep the disk. Nothing else: a path outside a
    ``runs`` folder or a symlink is left alone."""

    run_dir = Path(run_dir)
    if run_dir.parent.name != "runs" or run_dir.is_symlink() or not run_dir.is_dir():
        return
    shutil.rmtree(run_dir, ignore_errors=True)


def write_data_manifest(out: Path, max_length: int, note: str) -> Path:
    """The ``manifest.json`` the trainer's loader reads beside benchmark shards (written last: the
    folder counts as written once it is there)."""
    manifest = {"cache_key": f"bench-{out.name}", "max_length": int(max_length), "packed": True, "note": note}
    write_json(out / "manifest.json", manifest)
    return out


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def add_arm_arguments(parser, micro_help: str) -> None:
    """Command-line options every packed arm (fastpath, project) takes."""
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--method", default="lora", choices=["lora", "qlora", "full"])
    parser.add_argument("--profile", default="short", choices=sorted(PROFILES))
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--micro", type=int, default=64, help=micro_help)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true")


def kernel_path(fast_path: dict | None, lora_dropout: float | None = None) -> str:
    """One line naming the kernels a trainer run took (its ``fast_path`` record, llmft/trainer/fastpath/resolve.py)
    and how its LoRA dropout ran: in the fused adapter matmuls from Philox seeds (fastpath/lora_dropout.py)
    or PEFT's ``nn.Dropout`` (a stored mask)."""
    if not fast_path:
        return "no fast_path record"
    parts = []
    for name, piece in fast_path.items():
        if not isinstance(piece, dict) or "on" not in piece:
            continue
        count = next((f" {piece[u]} {u}" for u in ("modules", "groups", "layers") if u in piece), "")
        label = f"attention {piece.get('value')}" if name == "attention" else name
        parts.append(f"{label}{count}" if piece["on"] else f"no {label} ({piece.get('why')})")
    micro = fast_path.get("micro_batch")
    if micro:
        parts.append(f"micro {micro.get('sequences')} seq")
    if lora_dropout:
        fused = (fast_path.get("fused_lora") or {}).get("on")
        parts.append(
            f"dropout {lora_dropout} {'in-kernel (Philox seeds)' if fused else 'PEFT nn.Dropout (stored mask)'}"
        )
    return "; ".join(parts)
