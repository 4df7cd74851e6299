"""Float tolerances from the arithmetic, never from one machine's run.

Two computations of the same numbers that differ only in rounding (another summation order,
kernel, thread count, BLAS or CPU) differ by about the rounding error of the reductions behind
them. A sum of n terms in a dtype with machine epsilon eps is off by at most (n - 1)·eps·Σ|terms|
and, its rounding errors being of either sign, typically by √n·eps·Σ|terms| (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., §2.8 and §4.2). :func:`rounding_bound` is
SAFETY·√n·eps; :func:`close` applies it relative to the magnitude of the compared values (``atol``
scales with the largest reference value), so an element that cancels to near zero is held to the
scale of its terms, not to its own small size.

``n`` is the summed length of the reductions along a value's forward and backward path
(:func:`decoder_reduction_length`). Where a computation is ill-conditioned, compare in float64
(tests/fastpath/test_moe.py) or use :func:`assert_adam_runs_agree` for trained weights.
"""

from __future__ import annotations

import math

import torch

SAFETY = 16  # headroom over the √n typical case; still far below the (n - 1) worst case for n > 256


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def rounding_bound(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative rounding error of a value computed through reductions of total length ``n``."""
    return SAFETY * math.sqrt(n) * eps(dtype)


def close(reference: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> dict:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` against ``reference``."""
    bound = rounding_bound(n, dtype)
    return {"rtol": bound, "atol": bound * float(reference.detach().abs().max())}


def decoder_reduction_length(config, tokens: int) -> int:
    """Summed inner dimensions along a decoder's forward and backward path for ``tokens`` tokens:
    per layer the q/k/v projections (hidden), attention scores (head dim) and weighted sum (tokens),
    the output projection (hidden), the MLP (hidden, intermediate); then the head (hidden), the loss
    (vocabulary, tokens) and a weight gradient's sum over the tokens."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    per_layer = hidden + head_dim + tokens + hidden + hidden + config.intermediate_size
    return layers * per_layer + hidden + config.vocab_size + 2 * tokens


def adam_step_bound(betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Largest |update| / lr of one Adam step: (1 - β1)/√(1 - β2) when that exceeds 1, else 1
    (Kingma & Ba 2015, "Adam", §2.1)."""
    beta1, beta2 = betas
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def assert_adam_runs_agree(a: dict, b: dict, lrs: list[float], n: int, betas=(0.9, 0.999)) -> None:
    """Weights ``a`` and ``b`` trained by two Adam runs whose gradients differ only by rounding.

    Adam divides each gradient element by its running RMS. An element whose gradient stays far above
    its own rounding error gets an update off by at most about 2·δ of a step (δ = rounding_bound(n)),
    so it ends within ``fine`` = 2·δ·s·Σ lr_t of the other run (s = :func:`adam_step_bound`). An
    element whose gradient cancels to within its rounding error can move either way, up to s·lr_t
    a step in each run: no elementwise tolerance holds for it, only ``hard`` = 2·s·Σ lr_t. Such
    elements are isolated (a wrong kernel changes every element of the block it computes), so at
    most √N of a tensor's N elements may exceed ``fine``, and none ``hard``.
    """
    assert a.keys() == b.keys()
    step = adam_step_bound(betas) * sum(lrs)
    fine, hard = 2 * rounding_bound(n) * step, 2 * step
    for name in a:
        diff = (a[name].double() - b[name].double()).abs()
        largest = float(diff.max())
        assert largest <= hard, f"{name}: off by {largest:.3g} > Adam's bound {hard:.3g}"
        outliers = int((diff > fine).sum())
        assert outliers <= math.isqrt(diff.numel()), (
            f"{name}: {outliers} of {diff.numel()} elements off by more than {fine:.3g} (largest {largest:.3g})"
        )
