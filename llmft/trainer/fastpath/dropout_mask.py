"""The LoRA dropout keep-mask as a pure function of (seed, row, column): Philox-4x32-10 in plain torch.

Key = the call's two 32-bit seed words, counter = (column // 8, row, 0, 0) (Salmon et al. 2011; the
rounds of ``triton.language.random.philox_impl``). One Philox call gives four 32-bit words = eight
16-bit draws, one per column of the group of 8; element (row, col) is kept when its draw is >=
:func:`threshold` ``(p)``, and kept values are scaled by :func:`scale` ``(p) = 1 / (1 - p)``.

The bottom of the LoRA dropout: lora_dropout.py (the torch reference and the dispatch) and
lora_dropout_triton.py (the same mask made in registers) both import it; it imports neither.
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
