"""torch.compile of the decoder layers only, in place.

Each decoder layer (the module classes whose name ends in ``DecoderLayer``)
is compiled with ``nn.Module.compile``, so PEFT and DDP wrappers, parameter
names and state dicts are unchanged. All layers share one code object, so
Dynamo compiles the layer once and reuses it for every layer (parameters are
graph inputs). Inductor fuses the elementwise work between the matmuls
(RMSNorm, rotary embedding, SiLU * up, residual adds, the LoRA scaling); the
varlen attention and the fused LoRA autograd node are traced through.

Packed batches change their token count every step: the first change marks
the sequence dimension dynamic (``dynamic=None``, Dynamo's automatic dynamic
shapes) and later steps reuse that graph. ``cache_dir`` points Inductor's
on-disk cache at a persistent folder (e.g. on the PVC) so a restarted job
compiles warm.
"""

from __future__ import annotations

import os

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (modules whose class name ends in 'DecoderLayer')."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def compile_decoder_layers(
    model: torch.nn.Module,
    *,
    dynamic: bool | None = None,
    mode: str | None = None,
    backend: str = "inductor",
    cache_dir: str | None = None,
) -> int:
    """Compile every decoder layer in place; returns how many were compiled."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # the config names it: it wins over the environment
        os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
        os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: found no *DecoderLayer modules to compile")
    # Every layer runs the same code: allow one graph per layer-shape variant without hitting the limit.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(dynamic=dynamic, mode=mode, backend=backend)
    return len(layers)
