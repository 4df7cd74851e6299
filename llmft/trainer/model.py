"""Loading the base model and tokenizer, applying the method (LoRA / QLoRA / full).

Works unchanged for a hub id, a downloaded snapshot or the project's tiny model:
everything goes through ``AutoTokenizer`` / ``AutoModelForCausalLM`` with
safetensors only, ``trust_remote_code`` off unless configured, and the
HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE flags honoured by transformers itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import BitsAndBytesConfig
from transformers.integrations import HfDeepSpeedConfig

import llmft.trainer.fastpath  # noqa: F401 - registers its attention kernels
from llmft.trainer import moe_model
from llmft.trainer.config import LoraConfig, ModelConfig, TrainConfig
from llmft.trainer.distributed import import_deepspeed
from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath import apply_kernels, moe
from llmft.trainer.fastpath.settings import enable_checkpointing, run_settings
from llmft.trainer.fp8 import load_base
from llmft.trainer.loss import BUILTIN_ATTENTION
from llmft.trainer.model_dir import content_hash

if TYPE_CHECKING:
    from llmft.trainer.fastpath.resolve import FastPath

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def check_method_supported(cfg: TrainConfig, device: torch.device) -> None:
    """Fail before any weights load when the method cannot run here."""
    if cfg.method != "qlora":
        return
    if device.type != "cuda":
        raise ConfigError(
            "method=qlora quantizes the base model to 4-bit NF4 with bitsandbytes, which needs a CUDA GPU; "
            "none was found. Use method=lora on CPU, or run on a GPU node."
        )
    try:
        # heavy: bitsandbytes
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("method=qlora needs the bitsandbytes package: pip install 'kfp-llm-finetune[gpu]'") from None


def _load_kwargs(cfg: TrainConfig, device: torch.device, dtype: torch.dtype, zero3: bool, attention: str) -> dict:
    kwargs: dict[str, Any] = {
        "revision": cfg.model.revision,
        "trust_remote_code": cfg.model.trust_remote_code,
        "attn_implementation": attention,
        "dtype": dtype,
        "use_safetensors": True,
    }
    if cfg.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.qlora.quant_type,
            bnb_4bit_use_double_quant=cfg.qlora.double_quant,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=DTYPES.get(cfg.qlora.quant_storage, torch.uint8),
        )
        if not zero3:
            kwargs["device_map"] = {"": device.index or 0}
    return kwargs


def load_model(cfg: TrainConfig, device: torch.device, *, ds_config: dict | None = None) -> tuple[Any, FastPath]:
    """The base model with the method applied, on ``device``, in training mode, and its fast-path decision.

    For full fine-tuning under DDP the weights stay float32 (bf16 autocast does the
    compute); LoRA/QLoRA keep the frozen base in the compute dtype and the adapter
    in float32. Under DeepSpeed ZeRO-3, weights are partitioned while loading.

    The ``auto`` settings (attention, kernels.*, gradient checkpointing) are resolved first
    (trainer.fastpath.settings: from config.json, no weights; a ``true`` that cannot apply fails
    here); the returned :class:`~llmft.trainer.fastpath.resolve.FastPath` says what was switched
    on, why anything is off, and what applying did.
    """
    check_method_supported(cfg, device)

    moe_model.check_lora_config(cfg)  # MoE LoRA targets checked from config.json first

    settings = run_settings(cfg, device)
    fast = settings.fast
    register_attention(fast.attention)
    compute = resolve_dtype(cfg.model.dtype, device)
    deepspeed = cfg.distributed.backend == "deepspeed"
    weights = torch.float32 if (cfg.method == "full" and not deepspeed) else compute
    zero3 = deepspeed and cfg.distributed.zero_stage == 3
    keep_alive = _zero3_init(ds_config) if zero3 else None  # must live through from_pretrained
    try:
        model, base = load_base(
            cfg.model.name_or_path,
            cfg.model.revision,
            cfg.method,
            _load_kwargs(cfg, device, weights, zero3, fast.attention),
        )
    except OSError as exc:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: cannot load ({exc})") from None
    del keep_alive
    model.config.use_cache = False
    if cfg.method == "qlora" and not zero3:  # bnb leaves fused 3-D MoE experts in bf16
        moe.quantize_experts_4bit(model, quant_type=cfg.qlora.quant_type, double_quant=cfg.qlora.double_quant)
    if cfg.method != "qlora" and not zero3:
        model.to(device)

    checkpointed = enable_checkpointing(model, settings.memory.checkpointed_layers)
    if cfg.method == "full":
        model.requires_grad_(True)
    else:
        model = apply_lora(model, cfg.lora, qlora=cfg.method == "qlora")
    applied = {}
    if fast.compile.on or fast.fused_lora.on:
        applied = apply_fastpath_kernels(
            model,
            compile_layers=fast.compile.on,
            fuse_lora=fast.fused_lora.on,
            group_lora=fast.grouped_lora.on,
            compile_cache_dir=cfg.kernels.compile_cache_dir or None,
        )
    decision = fast.applied(applied, dataclasses.replace(settings.memory, checkpointed_layers=checkpointed))
    decision = dataclasses.replace(decision, base=base)
    if cfg.kernels.fused_lora is True and not decision.fused_lora.on:
        raise ConfigError(f"kernels.fused_lora=true: {decision.fused_lora.why}; set it to auto or false")
    moe_report = moe.apply_moe(
        model,
        fuse_lora=cfg.kernels.fused_lora is not False,
        freeze_router=cfg.method != "full",
        compile_rows=fast.compile.on and device.type == "cuda",
    )
    if moe_report is not None:  # frozen router, grouped experts, load-balancing loss
        decision = dataclasses.replace(decision, moe=moe_report)
    model.train()
    return model, decision


def apply_fastpath_kernels(
    model, *, compile_layers: bool, fuse_lora: bool, group_lora: bool = True, compile_cache_dir: str | None = None
) -> dict:
    """kernels.compile / kernels.fused_lora: trainer.fastpath changes the model in place
    (parameter names, and so checkpoints, stay the same)."""

    return apply_kernels(
        model,
        compile_layers=compile_layers,
        fuse_lora=fuse_lora,
        group_lora=group_lora,
        compile_cache_dir=compile_cache_dir,
    )


def register_attention(name: str) -> None:
    """An attention implementation other than transformers' own comes from trainer.fastpath, which
    registers it (AttentionInterface) on import; an unknown name is transformers' error at load time."""
    if name in BUILTIN_ATTENTION or name.startswith("kernels-community/"):
        return


def _zero3_init(ds_config: dict | None):
    """While the returned object lives, from_pretrained partitions weights over ranks (zero.Init)."""
    import_deepspeed()

    return HfDeepSpeedConfig(ds_config)


def apply_lora(model, lora: LoraConfig, *, qlora: bool = False):
    """PEFT LoRA on the frozen base (checkpointing, when planned, is already on: settings.enable_checkpointing).

    QLoRA: the base is only frozen. PEFT's ``prepare_model_for_kbit_training`` would also cast every
    bf16 parameter that is not 4-bit (embeddings, norms, lm_head) to float32 (peft 0.21,
    peft/utils/other.py lines 204-209), which makes every activation float32 from the embeddings on
    (the float32 [tokens, 8960] buffers measured on an H100); QLoRA computes in bf16 end to end, like LoRA."""
    # heavy: peft
    from peft import LoraConfig as PeftLoraConfig

    # heavy: peft
    from peft import get_peft_model

    if qlora:
        model.requires_grad_(False)
    targets: dict[str, Any] = {
        "target_modules": "all-linear" if tuple(lora.target_modules) == ("all-linear",) else list(lora.target_modules)
    }
    if moe_model.is_moe(model):  # on MoE models, router never, experts opt-in
        targets = moe_model.peft_targets(lora.target_modules, model, lora.dropout)
    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; it divides by r, a float works
        lora_dropout=lora.dropout,
        **targets,
        use_dora=lora.use_dora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules={list(lora.target_modules)}: {exc}") from None
    check_rank_fits(peft_model, lora.r)
    return peft_model


def check_rank_fits(model, r: int) -> None:
    """Refuse (exit 1, before the first step) a ``lora.r`` above min(in, out) features of a targeted
    layer: B @ A of such a layer has rank at most min(in, out), so the extra rank only adds parameters,
    optimizer state and memory (``lora.r=4096`` on a hidden size of 128 is a typo, not a choice)."""
    sizes = [
        (min(m.in_features, m.out_features), name.removeprefix("base_model.model."), m.in_features, m.out_features)
        for name, m in model.named_modules()
        if hasattr(m, "lora_A") and isinstance(getattr(m, "in_features", None), int)
    ]
    if not sizes:
        return
    fits, name, fan_in, fan_out = min(sizes)
    if r > fits:
        raise ConfigError(
            f"lora.r={r} is larger than the targeted layer {name} ({fan_in} -> {fan_out} features) allows: an "
            f"adapter's rank is at most min(in, out) = {fits}, so the rest only costs memory. Set lora.r <= {fits} "
            "(or leave that layer out of lora.target_modules)"
        )


def autocast(device: torch.device, dtype: torch.dtype, enabled: bool):
    """bf16/fp16 autocast for full fine-tuning of float32 weights on CUDA; a no-op otherwise."""
    if enabled and device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- accounting


def parameter_counts(model) -> dict[str, int]:
    """total / trainable / matmul (base linear layers incl. lm_head) / adapter parameter counts."""
    total = trainable = matmul = 0
    for param in model.parameters():
        n = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
        total += n
        trainable += n if param.requires_grad else 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            matmul += module.in_features * module.out_features
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return {"total": total, "trainable": trainable, "matmul": matmul, "adapter": adapter}


def base_model_identity(model_cfg: ModelConfig, model) -> dict:
    """Base model id plus revision (hub commit) or a content hash (local directory)."""
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    ident = {
        "name_or_path": model_cfg.name_or_path,
        "revision": model_cfg.revision,
        "commit_hash": getattr(config, "_commit_hash", None),
    }
    local = Path(model_cfg.name_or_path)
    if local.is_dir():
        ident["content_hash"], ident["content_hash_method"] = content_hash(local)
    return ident


def save_tokenizer_and_generation(model, tokenizer, directory: Path) -> None:
    """Tokenizer (with its chat template) and the generation config, beside the weights."""
    tokenizer.save_pretrained(directory)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    generation = getattr(base, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
    if getattr(tokenizer, "chat_template", None) and not (directory / "chat_template.jinja").exists():
        (directory / "chat_template.jinja").write_text(tokenizer.chat_template)


def describe(model) -> str:
    counts = parameter_counts(model)
    return json.dumps({k: f"{v:,}" for k, v in counts.items()})
