"""LoRA dropout with no stored mask: the keep-mask is a pure function of (seed, row, column).

PEFT applies ``nn.Dropout`` to the adapter's input: ``h = (x * m / (1 - p)) A^T`` with a Bernoulli(1 - p)
mask ``m`` over every element of ``x`` (tokens x d_in), applied again twice in backward. Drawn by
``native_dropout`` that costs a full pass writing the dropped input and the mask, and two more reading
them in backward (14% of the Qwen2.5-1.5B LoRA step at p = 0.05, issue 28).

Here the mask is regenerated wherever it is needed from a counter-based generator, Philox-4x32-10
(Salmon et al. 2011; the rounds of ``triton.language.random.philox_impl``): key = the call's two 32-bit
seed words, counter = (column // 8, row, 0, 0). One Philox call gives four 32-bit words = eight 16-bit
draws, one per column of the group of 8; element (row, col) is kept when its draw is >= ``round(p *
65536)`` (so the drop probability is p to within 1/65536), and the kept values are scaled by 1 / (1 - p)
as PEFT scales them. On CUDA three Triton kernels fold the mask into the adapter's thin matmuls:

- forward ``h = scale * (x * m) A^T`` (x read once, as the undropped ``x A^T`` reads it);
- backward ``dx = dx_base + scale * m * (dh A)`` (one read and one write of dx, like ``addmm``);
- backward ``dA = scale * dh^T (x * m)`` (x read once, as ``dh^T x`` reads it).

No mask is stored and no input is read an extra time. Each adapted linear (each sibling of a grouped
q/k/v or gate/up) draws its own two seed words from torch's generator when it runs, so masks follow the
generator state as ``nn.Dropout``'s do: the trainer checkpoints every rank's CPU and CUDA generator
state and restores it on resume (llmft/trainer/checkpoint.py), so a resumed run draws the same masks, bit for
bit. :func:`~llmft.trainer.fastpath.dropout_mask.keep_mask` (dropout_mask.py) is the same function in plain
torch (CPU, and any shape the kernels don't take).
"""

from __future__ import annotations

import torch

from llmft.trainer.fastpath.dropout_mask import keep_mask, scale


def draw_seeds(count: int, device: torch.device) -> torch.Tensor:
    """(count, 2) int32 seed words from torch's generator on ``device`` (no host sync)."""
    return torch.randint(-(2**31), 2**31 - 1, (count, 2), dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- a stored mask (the 4-bit path)


def drop_input(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``x`` with inverted dropout ``p`` applied, its boolean keep-mask); ``(x, None)`` when p is 0."""
    if p <= 0.0:
        return x, None
    return torch.native_dropout(x, p, True)


def redrop(x: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    """``drop(x)`` rebuilt from its mask (the backward's copy of what the forward computed)."""
    return x if mask is None else x * mask * (1.0 / (1.0 - p))


def spans(sizes) -> list[tuple[int, int]]:
    """(start, end) of consecutive blocks of ``sizes`` along one axis (siblings' rows or ranks in a group)."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


# ----------------------------------------------------------------------------- torch reference


def _ref_down(x2, a, seeds, p, rank):
    """h = scale * [(x * m_j) A_j^T for each sibling j] (A: (n * rank, d_in))."""
    outs = []
    for j in range(seeds.shape[0]):
        m = keep_mask(seeds[j], x2.shape[0], x2.shape[1], p, x2.device)
        outs.append((x2 * m) @ a[j * rank : (j + 1) * rank].t())
    return torch.cat(outs, dim=1) * scale(p)


def _ref_up_add(base, dh, a, seeds, p, rank):
    out = base.clone()
    for j in range(seeds.shape[0]):
        m = keep_mask(seeds[j], base.shape[0], base.shape[1], p, base.device)
        out += (dh[:, j * rank : (j + 1) * rank] @ a[j * rank : (j + 1) * rank]) * m * scale(p)
    return out


def _ref_grad_a(dh, x2, seeds, p, rank):
    parts = []
    for j in range(seeds.shape[0]):
        m = keep_mask(seeds[j], x2.shape[0], x2.shape[1], p, x2.device)
        parts.append(dh[:, j * rank : (j + 1) * rank].t() @ (x2 * m))
    return torch.cat(parts) * scale(p)


# ----------------------------------------------------------------------------- dispatch


def _use_triton(x2: torch.Tensor, rank: int) -> bool:
    # heavy: triton
    from llmft.trainer.fastpath import lora_dropout_triton as kernels

    return kernels.available() and x2.is_cuda and kernels.supports(x2, rank)


def dropped_down(x2, a, seeds, p: float, rank: int) -> torch.Tensor:
    """(tokens, n * rank): ``scale * (x * m_j) A_j^T`` side by side for the n seed pairs in ``seeds``."""
    if _use_triton(x2, rank):
        return torch.ops.llmft.lora_drop_down(x2, a, seeds, p, rank)
    return _ref_down(x2, a, seeds, p, rank)


def dropped_up_add(base, dh, a, seeds, p: float, rank: int) -> torch.Tensor:
    """``base + scale * sum_j m_j * (dh_j A_j)`` (the input gradient through the dropped adapters)."""
    if _use_triton(base, rank):
        return torch.ops.llmft.lora_drop_up_add(base, dh, a, seeds, p, rank)
    return _ref_up_add(base, dh, a, seeds, p, rank)


def dropped_grad_a(dh, x2, seeds, p: float, rank: int) -> torch.Tensor:
    """(n * rank, d_in) in float32 or wider: ``scale * dh_j^T (x * m_j)`` stacked (the adapters' A gradients)."""
    if _use_triton(x2, rank):
        return torch.ops.llmft.lora_drop_grad_a(dh, x2, seeds, p, rank)
    return _ref_grad_a(dh, x2, seeds, p, rank).to(torch.promote_types(dh.dtype, torch.float32))
