"""Where the MoE parts of a model are: its sparse blocks, the experts module under PEFT's wrappers,
and its config. moe.py (what runs on them) and moe_aux.py (the router loss) both read these."""

from __future__ import annotations

from typing import Any


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
