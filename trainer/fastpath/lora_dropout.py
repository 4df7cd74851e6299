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
state and restores it on resume (trainer/checkpoint.py), so a resumed run draws the same masks, bit for
bit. :func:`keep_mask` is the same function in plain torch (CPU, and any shape the kernels don't take).
"""

from __future__ import annotations

import torch

LANES = 8  # 16-bit draws per Philox call (4 words x 2 halves)
_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def threshold(p: float) -> int:
    """16-bit draws below this are dropped."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(65535, round(p * 65536))


def draw_seeds(count: int, device: torch.device) -> torch.Tensor:
    """(count, 2) int32 seed words from torch's generator on ``device`` (no host sync)."""
    return torch.randint(-(2**31), 2**31 - 1, (count, 2), dtype=torch.int32, device=device)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` (a < 2**32, b int64 in [0, 2**32)), without int64 overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t_hi, t_lo = a_hi * b, a_lo * b  # each < 2**48
    return (t_hi + (t_lo >> 16)) >> 16, (((t_hi & 0xFFFF) << 16) + t_lo) & _M32


def philox(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2=None, c3=None) -> list[torch.Tensor]:
    """Philox-4x32-10 of counters (c0, c1, c2, c3) (default 0) under key ``seed`` (2 int32 words): four
    uint32 words (as int64). Plain tensor arithmetic: traceable, no host sync."""
    k0, k1 = (seed.to(torch.int64) & _M32).unbind(-1)
    c0, c1 = c0.to(torch.int64), c1.to(torch.int64)
    c2 = torch.zeros_like(c0) if c2 is None else c2.to(torch.int64)
    c3 = torch.zeros_like(c0) if c3 is None else c3.to(torch.int64)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return [c0, c1, c2, c3]


def keep_mask(seed: torch.Tensor, rows: int, cols: int, p: float, device=None) -> torch.Tensor:
    """Boolean (rows, cols) keep-mask of one seed pair: what the Triton kernels compute in registers.

    Column ``c`` of row ``r`` takes 16-bit half ``c % 2`` of word ``2 * ((c // 2) % 2) + c % 8 // 4`` of
    Philox(counter = (c // 8, r, 0, 0)) (the order ``tl.join`` and ``reshape`` lay the words out in)."""
    groups = -(-cols // LANES)
    c0 = torch.arange(groups, dtype=torch.int64, device=seed.device).expand(rows, groups)
    c1 = torch.arange(rows, dtype=torch.int64, device=seed.device).unsqueeze(1).expand(rows, groups)
    w = philox(seed, c0, c1)
    pairs = [torch.stack([w[0], w[2]], -1), torch.stack([w[1], w[3]], -1)]  # [.., i, j] = word 2j + i
    words = torch.stack(pairs, -2)  # (rows, groups, 2 (i), 2 (j))
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # (.., i, j, k): lane 4i + 2j + k
    draws = halves.reshape(rows, groups * LANES)[:, :cols]
    return (draws >= threshold(p)).to(device or seed.device)


def scale(p: float) -> float:
    return 1.0 / (1.0 - p)


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
