"""What training needs to know about a mixture-of-experts model, on the fast path or not.

Where the MoE parts are (the sparse blocks, the experts module under PEFT's wrappers, the config),
which LoRA targets such a model takes (the router never, the fused experts opt-in: see
llmft/trainer/fastpath/moe.py's module doc for why PEFT's own ``all-linear`` is not used) and the routers
frozen. llmft/trainer/model.py applies the targets; llmft/trainer/fastpath/moe.py (grouped experts) and
llmft/trainer/moe_aux.py (the load-balancing loss) read the layout.
"""

from __future__ import annotations

from typing import Any

import torch

from llmft.trainer.errors import ConfigError

EXPERT_TARGETS = {
    "experts": ("experts.gate_up_proj", "experts.down_proj"),
    "experts.gate_up_proj": ("experts.gate_up_proj",),
    "experts.down_proj": ("experts.down_proj",),
}
"""``lora.target_modules`` names that put LoRA on the fused expert tensors (PEFT target_parameters)."""

ROUTER_NAMES = ("gate", "router", "gate.weight")
DENSE_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------- finding the pieces


def moe_blocks(model) -> list[Any]:
    """The sparse MoE blocks: modules with an ``experts`` child and a ``gate`` (router) child (duck-typed)."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate") and m is not model]


def base_experts(module) -> Any:
    """The transformers experts module under any PEFT ``ParamWrapper`` nesting."""
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def model_config(model):
    """The transformers config of ``model`` (under a PEFT wrapper too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "config", None)


def is_moe(model) -> bool:
    return bool(moe_blocks(model))


def config_is_moe(config) -> bool:
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    return int(get("num_experts", 0) or get("num_local_experts", 0) or 0) > 0


# ----------------------------------------------------------------------------- LoRA targets


def peft_targets(target_modules, model, dropout: float) -> dict:
    """``target_modules`` / ``target_parameters`` for PEFT's LoraConfig on an MoE model.

    ``all-linear`` -> the decoder's ``nn.Linear`` leaf names (the attention projections; never the
    router or lm_head); ``experts`` (or one expert tensor) -> PEFT ``target_parameters``.
    Raises ConfigError for the router, for dense-MLP names the model does not have, and for
    expert LoRA with dropout (PEFT's ParamWrapper cannot apply dropout).
    """
    return resolve_targets(list(target_modules), _linear_leaf_names(model), dropout)


def check_lora_config(cfg) -> None:
    """The same checks from the model's config.json alone, before any weights load (no-op for a
    dense model, or when the config cannot be read here: loading then reports that)."""
    if cfg.method == "full":
        return
    try:
        # heavy: transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            cfg.model.name_or_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError, KeyError):  # not loadable here, or an architecture this transformers lacks
        return
    if not config_is_moe(config):
        return
    linear = {"q_proj", "k_proj", "v_proj", "o_proj"}
    layers, step = int(config.num_hidden_layers), int(getattr(config, "decoder_sparse_step", 1) or 1)
    if any(i in (getattr(config, "mlp_only_layers", None) or ()) or (i + 1) % step for i in range(layers)):
        linear |= set(DENSE_MLP_NAMES)
    resolve_targets(list(cfg.lora.target_modules), linear, cfg.lora.dropout)


def resolve_targets(names: list[str], linear: set[str], dropout: float) -> dict:
    where = f"lora.target_modules={names}"
    linear = set(linear) - set(ROUTER_NAMES)  # a router that is an nn.Linear is still the router
    router = sorted(set(names) & set(ROUTER_NAMES))
    if router:
        raise ConfigError(
            f"{where}: {router} is the MoE router, which stays frozen (vLLM has no LoRA layer for it either); remove it"
        )
    dense = sorted((set(names) & set(DENSE_MLP_NAMES)) - linear)
    if dense:
        raise ConfigError(
            f"{where}: this mixture-of-experts model has no {dense} layers (its experts are fused 3-D tensors); "
            "use `experts` to put LoRA on the experts, or list attention projections only"
        )
    parameters = [p for n in names if n in EXPERT_TARGETS for p in EXPERT_TARGETS[n]]
    modules = [n for n in names if n not in EXPERT_TARGETS]
    if "all-linear" in modules:
        modules = sorted((set(modules) - {"all-linear"}) | linear)
    if parameters and dropout > 0:
        raise ConfigError(
            f"{where}: LoRA on the experts takes no dropout (PEFT applies it to the fused expert weight, where "
            f"dropout cannot act on the input); set lora.dropout=0 (it is {dropout})"
        )
    if not modules and not parameters:
        raise ConfigError(f"{where}: names no attention projection and no `experts`")
    return {"target_modules": modules or None, "target_parameters": sorted(set(parameters)) or None}


def _linear_leaf_names(model) -> set[str]:
    """Leaf names of the decoder's nn.Linear modules (lm_head and anything outside the layers excluded)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and "lora_" not in name:
            names.add(name.rsplit(".", 1)[-1])
    return names


def freeze_routers(model) -> int:
    """Every router's parameters frozen; raises ConfigError if one carries an adapter."""
    count = 0
    for block in moe_blocks(model):
        if hasattr(block.gate, "lora_A") or hasattr(block.gate, "base_layer"):
            raise ConfigError("a LoRA adapter sits on the MoE router; the router must stay frozen")
        block.gate.requires_grad_(False)
        count += 1
    return count
