"""FP8 base checkpoints: train on them, and write a tiny one. The two FP8 formats read (transformers'
fine-grained FP8 and compressed-tensors' float-quantized FP8) and their dequantization are
llmft/trainer/fp8_format.py's.

How ``llmft train`` uses such a base (:func:`load_plan`, called by ``llmft/trainer/model.py``):

* LoRA and full fine-tuning: dequantize to the compute dtype while loading
  (``FineGrainedFP8Config(dequantize=True)`` / ``CompressedTensorsConfig(dequantize=True)``), on CPU and
  GPU alike, so the adapter trains over the same weights everywhere and evaluation and export
  (which dequantize the same way) see the same base.
* QLoRA: transformers cannot re-quantize an FP8 checkpoint to 4-bit (``from_pretrained`` refuses a
  ``BitsAndBytesConfig`` for a model whose config says FP8). On one GPU (the config's ``device_map``) the
  base is loaded dequantized to bf16 onto the GPU and its linears are then stored in 4-bit NF4 with the
  same bitsandbytes settings (llmft/trainer/quant4bit.py; the fused MoE experts as on every QLoRA path,
  llmft/trainer/fastpath/moe.py): no copy on disk. Under DeepSpeed ZeRO-3 (no device map: the weights are
  partitioned while loading) it is first dequantized, shard by shard, into a bf16 copy (cached under
  ``$LLMFT_CACHE`` or ``$HF_HOME/llmft``), and that copy is quantized by bitsandbytes while loading.

The run log says which happened (one ``base model:`` line).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmft.trainer.errors import ConfigError
from llmft.trainer.fp8_format import FINEGRAINED, BaseFormat, QuantFormat, quant_format, read_model_config
from llmft.trainer.io import atomic_directory, is_complete, share_files
from llmft.trainer.merge import BaseCheckpoint, rewrite_checkpoint
from llmft.trainer.model_dir import check_model_files, content_hash
from llmft.trainer.output_lock import output_lock
from llmft.trainer.quant4bit import quantize_linears_4bit
from llmft.trainer.safe_files import copy_file
from llmft.trainer.tiny_model import build_tiny_model

# ----------------------------------------------------------------------------- loading for training


@dataclass
class LoadPlan:
    """How ``from_pretrained`` is called for the base model (:func:`load_plan`)."""

    path: str
    """What to load: the model as given, or the dequantized bf16 copy of an FP8 base (QLoRA)."""
    kwargs: dict
    """from_pretrained keyword arguments."""
    base: BaseFormat
    """For the run log and the manifest."""
    four_bit: Any = None
    """QLoRA over FP8 on one GPU: the BitsAndBytesConfig applied after loading (quant4bit.py)."""


def base_format(name_or_path: str, revision: str | None = None) -> QuantFormat:
    """The storage format of a base model (a local directory, or a hub id resolved offline-first)."""
    local = Path(name_or_path)
    if local.is_dir():
        return quant_format(read_model_config(local))
    try:
        # heavy: transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, revision=revision)
    except (OSError, ValueError):  # from_pretrained itself reports an unloadable model
        return QuantFormat(None)
    qc = getattr(config, "quantization_config", None)
    return quant_format({"quantization_config": qc if isinstance(qc, dict) else getattr(qc, "to_dict", dict)()})


def load_plan(name_or_path: str, revision: str | None, method: str, kwargs: dict) -> LoadPlan:
    """Where and how to load the base for ``method`` (lora, qlora, full); a dense base is unchanged."""
    fmt = base_format(name_or_path, revision)
    dtype = kwargs.get("dtype", torch.bfloat16)
    if not fmt.is_fp8:
        return LoadPlan(name_or_path, kwargs, BaseFormat(fmt.describe(), "loaded as stored"))
    if method == "qlora" and "device_map" in kwargs:  # one GPU: dequantized onto it, then its linears in 4 bits
        four_bit = kwargs.get("quantization_config")
        action = "dequantized to bfloat16 on load, re-quantized to 4-bit by bitsandbytes (no copy on disk)"
        loaded = {**kwargs, "dtype": torch.bfloat16, "quantization_config": _dequantize_config(fmt)}
        return LoadPlan(name_or_path, loaded, BaseFormat(fmt.describe(), action), four_bit=four_bit)
    if method == "qlora":
        copy = dequantized_copy(name_or_path, revision, torch.bfloat16)
        plain = {k: v for k, v in kwargs.items() if k != "revision"}
        action = "dequantized to a bfloat16 copy, re-quantized to 4-bit by bitsandbytes"
        return LoadPlan(str(copy), plain, BaseFormat(fmt.describe(), action, dequantized_copy=str(copy)))
    base = BaseFormat(fmt.describe(), f"dequantized to {_dtype_name(dtype)} on load")
    return LoadPlan(name_or_path, {**kwargs, "quantization_config": _dequantize_config(fmt)}, base)


def _dequantize_config(fmt: QuantFormat):
    if fmt.method == FINEGRAINED:
        # heavy: transformers
        from transformers import FineGrainedFP8Config

        return FineGrainedFP8Config(
            weight_block_size=fmt.block or (128, 128),
            dequantize=True,
            modules_to_not_convert=fmt.config.get("modules_to_not_convert"),
        )
    try:
        # heavy: compressed_tensors
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the base model is stored with compressed-tensors (FP8); transformers loads it only with the "
            "compressed-tensors package: pip install 'kfp-llm-finetune[fp8]'"
        ) from None
    # heavy: transformers
    from transformers import CompressedTensorsConfig

    return CompressedTensorsConfig(dequantize=True)  # the checkpoint's own config; only `dequantize` is taken


def load_base_model(name_or_path: str, revision: str | None, method: str, kwargs: dict):
    """The model of :func:`load_base` (evaluation and the local checks need no more)."""
    return load_base(name_or_path, revision, method, kwargs)[0]


def load_base(name_or_path: str, revision: str | None, method: str, kwargs: dict) -> tuple[Any, BaseFormat]:
    """``AutoModelForCausalLM.from_pretrained`` for a base in any supported format (the one call
    llmft/trainer/model.py makes), and how it was loaded. An FP8 base is dequantized (LoRA, full) or
    dequantized and re-quantized to 4-bit (QLoRA: on the GPU, or from a bf16 copy under ZeRO-3); rank 0
    prints one ``base model:`` line saying which."""
    # heavy: transformers
    from transformers import AutoModelForCausalLM

    plan = load_plan(name_or_path, revision, method, kwargs)
    check_model_files(plan.path)  # a damaged local base: one line naming the file, not an error deep in the load
    with warnings.catch_warnings():  # "the quantization_config from the model will be used": meant so
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(plan.path, **plan.kwargs)
    if plan.four_bit is not None:
        quantize_linears_4bit(model, plan.four_bit)
    if plan.path != name_or_path:  # the adapter's base stays the model the user named
        model.name_or_path = name_or_path
        model.config._name_or_path = name_or_path
    if plan.base.format != "dense" and os.environ.get("RANK", "0") == "0":
        print(f"[llmft] base model: {plan.base.format}: {plan.base.action}", flush=True)
    return model, plan.base


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- the QLoRA bf16 copy


def cache_root() -> Path:
    """``$LLMFT_CACHE``, else ``$HF_HOME/llmft`` (on the data volume in the pipeline), else ~/.cache."""
    if os.environ.get("LLMFT_CACHE"):
        return Path(os.environ["LLMFT_CACHE"])
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(hf_home) / "llmft"


def dequantized_copy(name_or_path: str, revision: str | None, dtype=torch.bfloat16) -> Path:
    """A dense ``dtype`` copy of an FP8 checkpoint, built once (shard by shard) and reused.

    Keyed by the source's content hash; ranks of one node wait on a file lock while the first builds
    it, and a copy is only used once it carries its completion marker."""

    base = BaseCheckpoint.open(name_or_path, revision)
    digest, _ = content_hash(base.directory)
    target = cache_root() / "dequantized" / f"{base.directory.name}-{_dtype_name(dtype)}-{digest[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(target):  # the one writer lock of every output (llmft/trainer/output_lock.py)
        if not is_complete(target):
            rewrite_checkpoint(base, target, dtype=dtype, kind="fp8-dequantized", force=False)
    return target


# ----------------------------------------------------------------------------- a tiny FP8 checkpoint

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) as transformers' ``Fp8Quantize._quantize_one``
    computes them: per block, scale = 448 / max|block| (1 for an all-zero block), stored inverted."""
    rows, cols = weight.shape
    bm, bn = block
    tiles = weight.to(torch.float32).reshape(rows // bm, bm, cols // bn, bn)
    max_abs = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(max_abs > 0, FP8_MAX / torch.where(max_abs > 0, max_abs, 1.0), 1.0)
    quantized = torch.clamp(tiles * scales[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(rows, cols), (1.0 / scales).to(torch.float32)


def _quantizable(name: str, tensor: torch.Tensor, block: tuple[int, int]) -> bool:
    skip = ("embed_tokens", "lm_head")
    return (
        name.endswith(".weight")
        and tensor.ndim == 2
        and not any(s in name for s in skip)
        and tensor.shape[0] % block[0] == 0
        and tensor.shape[1] % block[1] == 0
    )


def write_fp8_checkpoint(
    source: str | Path, output: str | Path, *, block: tuple[int, int] = (32, 32), force: bool = False
) -> Path:
    """Convert a dense model directory (the tiny model) into transformers' fine-grained FP8 format:
    every decoder Linear weight becomes float8_e4m3fn + ``weight_scale_inv`` (one per ``block``),
    everything else bfloat16; ``config.json`` gets the ``quantization_config`` transformers reads."""

    base = BaseCheckpoint.open(str(source))
    config = read_model_config(base.directory)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in base.tensors():
        if _quantizable(name, tensor, block):
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = quantize_blockwise(tensor, block)
        else:
            tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    config["quantization_config"] = {
        "quant_method": FINEGRAINED,
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    config["dtype"] = "bfloat16"
    with atomic_directory(output, kind="tiny-model-fp8", force=force, inputs=(base.directory,)) as tmp:
        for path in base.directory.iterdir():
            if path.is_file() and not path.name.startswith(".") and not path.name.startswith("model"):
                copy_file(path, tmp / path.name, base.directory)  # no link followed (llmft/trainer/safe_files.py)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        share_files(tmp)
    return Path(output)


def build_tiny_fp8_model(output: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """``llmft dev tiny-model --fp8``: the tiny model, stored in fine-grained FP8 (blocks of 32 x 32)."""

    with tempfile.TemporaryDirectory(prefix="llmft-tiny-dense-") as scratch:
        dense = build_tiny_model(Path(scratch) / "dense", seed=seed)
        return write_fp8_checkpoint(dense, output, force=force)
