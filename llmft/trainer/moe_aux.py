"""The MoE load-balancing loss under packing: per document, weighted per supervised token.

transformers' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6) pools every row it is
given: on a packed row that mixes documents (and would count padding), so one document's routing
balances another's. Here it is taken per document ``d`` of the packed row, over the L MoE layers
and the n_d tokens of ``d`` only:

    f_de = (1 / (L n_d)) * sum_l sum_{t in d} [e in topk_l(t)]      (share of routing slots)
    P_de = (1 / (L n_d)) * sum_l sum_{t in d} softmax(z_lt)_e        (mean router probability)
    aux_d = E * sum_e f_de P_de                                       (= load_balancing_loss_func on d alone)

and enters the step's objective weighted by the document's supervised targets ``w_d``, with the
same global normaliser as the language-model loss (the supervised target count G of the whole
global batch, over every rank and micro batch):

    loss = (sum_t nll_t + coef * sum_d w_d aux_d) / G

so a document counts as much as its supervised tokens do, whatever packing, micro batch or rank
it lands in. Tokens outside every document (``cu_seqlens[-1]`` short of the row) count nowhere.

:func:`with_router_aux_loss` wraps a ``loss(model, batch)`` function (trainer.loss): while the
wrapped function runs a training forward, forward hooks on the routers record their logits and
top-k choices; the returned value stays the NLL sum (the number the trainer logs and compares
with eval loss) while its gradient carries the auxiliary term (``x + (a - a.detach())``). The
term itself is accumulated on the device and read by :func:`router_aux_metrics` at log steps
(``router_aux_loss``: the supervised-token-weighted mean of aux_d, before ``coef``).
``coef`` comes from the model config (``output_router_logits`` true ->
``router_aux_loss_coef``), as transformers reads it; off otherwise.
"""

from __future__ import annotations

import functools

import torch

from llmft.trainer.data.shards import IGNORE_INDEX
from llmft.trainer.moe_model import base_experts, model_config, moe_blocks

ATTRIBUTE = "_llmft_router_aux"


class RouterAux:
    """Router records of the forward in flight, and the device-side running sums for logging."""

    def __init__(self, coef: float, num_experts: int, top_k: int):
        self.coef, self.num_experts, self.top_k = float(coef), int(num_experts), int(top_k)
        self.armed = False
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.window = None  # tensor [sum_d w_d aux_d, sum_d w_d] since the last log step

    def hook(self, module, args, output) -> None:
        if self.armed:  # off in eval, and during activation-checkpoint recomputation in backward
            self.records.append((output[0], output[2]))

    def document_sum(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_d w_d aux_d, sum_d w_d) over the recorded layers, for the packed row ``batch``."""
        logits = self.records[0][0]
        device, tokens = logits.device, logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 sums for bf16 logits
        doc, docs = _document_ids(batch, tokens, device)
        ones = torch.ones(tokens * self.top_k, device=device, dtype=dtype)
        rows = torch.zeros(docs + 1, device=device, dtype=dtype).index_add_(0, doc, ones[:tokens])
        rows = rows * len(self.records)
        slots = torch.zeros((docs + 1) * self.num_experts, device=device, dtype=dtype)
        probs = torch.zeros(docs + 1, self.num_experts, device=device, dtype=dtype)
        for layer_logits, chosen in self.records:
            probs = probs.index_add(0, doc, torch.softmax(layer_logits.to(dtype), dim=-1))
            flat = doc.repeat_interleave(chosen.shape[-1]) * self.num_experts + chosen.reshape(-1)
            slots.index_add_(0, flat, ones[: flat.numel()])
        rows = rows.clamp(min=1).unsqueeze(-1)
        aux = self.num_experts * ((slots.view(docs + 1, -1) / rows) * (probs / rows)).sum(-1)
        supervised = (batch["targets"].reshape(-1)[:tokens] != IGNORE_INDEX).to(dtype)
        weight = torch.zeros(docs + 1, device=device, dtype=dtype).index_add_(0, doc, supervised)[:docs]
        return (weight * aux[:docs]).sum(), weight.sum()


def _document_ids(batch: dict, tokens: int, device) -> tuple[torch.Tensor, int]:
    """Document index of every token of the packed row (``docs`` for tokens outside every document)."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        cu = torch.tensor([0, tokens], device=device)
    cu = cu.to(device=device, dtype=torch.long)
    positions = torch.arange(tokens, device=device)
    return torch.searchsorted(cu[1:], positions, right=True), cu.numel() - 1


def install_router_aux(model, coef: float | None = None) -> float:
    """Hook every router of ``model`` when the load-balancing loss is on; returns the coefficient
    (0.0 = off). ``coef`` None reads the model config the way transformers does."""
    config = model_config(model)
    if coef is None:
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        coef = coef if getattr(config, "output_router_logits", False) else 0.0
    if not coef or find_router_aux(model) is not None:
        return float(coef)
    aux = RouterAux(coef, config.num_experts, config.num_experts_per_tok)
    for block in moe_blocks(model):
        base_experts(block.gate).register_forward_hook(aux.hook)
    for target in {id(model): model, id(_unwrap(model)): _unwrap(model)}.values():
        object.__setattr__(target, ATTRIBUTE, aux)
    return float(coef)


def _unwrap(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP, DeepSpeed
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def find_router_aux(model) -> RouterAux | None:
    while True:
        aux = model.__dict__.get(ATTRIBUTE) if hasattr(model, "__dict__") else None
        if aux is not None or not isinstance(getattr(model, "module", None), torch.nn.Module):
            return aux
        model = model.module


def with_router_aux_loss(loss_fn):
    """``loss_fn(model, batch)`` plus, in training forwards of a model with the load-balancing loss
    armed, the gradient of ``coef * sum_d w_d aux_d`` (the value returned stays the NLL sum)."""

    @functools.wraps(loss_fn)
    def loss_with_router_aux(model, batch, *args, **kwargs):
        aux = find_router_aux(model)
        if aux is None or not model.training:
            return loss_fn(model, batch, *args, **kwargs)
        aux.records.clear()
        aux.armed = True
        try:
            nll = loss_fn(model, batch, *args, **kwargs)
        finally:
            aux.armed = False
        if not aux.records:
            return nll
        term, weight = aux.document_sum(batch)
        aux.records.clear()
        window = torch.stack([term.detach(), weight]).float()
        aux.window = window if aux.window is None else aux.window + window
        scaled = aux.coef * term
        return nll + (scaled - scaled.detach()).to(nll.dtype)

    return loss_with_router_aux


def router_aux_metrics(model, *, reduce=None) -> dict:
    """``{"router_aux_loss": value}`` since the last call (supervised-token-weighted mean of the
    per-document aux, before coef), then reset; ``{}`` when the loss is off. ``reduce`` (e.g.
    trainer.distributed.all_reduce_sum) sums the window over ranks first. Syncs with the device."""
    aux = find_router_aux(model)
    if aux is None or aux.window is None:
        return {}
    window = reduce(aux.window.clone()) if reduce is not None else aux.window
    aux.window = None
    total, weight = window.tolist()
    return {"router_aux_loss": total / weight if weight else float("nan")}
