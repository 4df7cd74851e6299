"""Triton kernels of lora_dropout.py: the LoRA dropout mask made in registers from Philox, folded into
the adapter's thin matmuls. Registered as torch custom ops (``torch.ops.llmft.lora_drop_*``), so
compiled decoder layers call them as opaque kernels. Up to 3 siblings (q/k/v) share one read of x.

The mask of element (row, col) is dropout_mask.keep_mask's: llmft/benchmarks/gpu/check_kernels.py compares
the two bit for bit on the device, and tests/fastpath/test_lora_dropout.py checks the torch reference
against PEFT on CPU.
"""

import torch

MAX_SIBLINGS = 3
RANKS = (16, 32, 64)

try:
    import triton
    import triton.language as tl
    from triton.language.random import philox_impl
except ImportError:  # CPU installs: lora_dropout.py's torch reference runs instead
    triton = None


def available() -> bool:
    """Triton importable and a CUDA device present (the custom ops are registered at import)."""
    return triton is not None and torch.cuda.is_available()


def supports(x2: torch.Tensor, rank: int) -> bool:
    return rank in RANKS and x2.dtype in (torch.bfloat16, torch.float16) and x2.shape[1] % 8 == 0


if triton is not None:

    @triton.jit
    def _keep_tile(k0, k1, offs_m, g0, thresh, BM: tl.constexpr, BK: tl.constexpr):
        groups = (g0 + tl.arange(0, BK // 8)).to(tl.uint32)
        zero = tl.zeros([BM, BK // 8], dtype=tl.uint32)
        c0 = zero + groups[None, :]
        c1 = zero + offs_m.to(tl.uint32)[:, None]
        r0, r1, r2, r3 = philox_impl(c0, c1, zero, zero, k0, k1)
        words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [.., i, j] = word 2j + i
        halves = tl.join(words & 0xFFFF, words >> 16)  # [.., i, j, k]: lane 4i + 2j + k
        draws = halves.reshape(BM, BK).to(tl.int32)
        return draws >= thresh

    @triton.jit
    def _seed_words(seed_ptr, j):
        k0 = tl.load(seed_ptr + 2 * j).to(tl.uint32, bitcast=True)
        k1 = tl.load(seed_ptr + 2 * j + 1).to(tl.uint32, bitcast=True)
        return k0, k1

    def _configs(shapes):
        return [triton.Config({"BM": bm, "BK": bk}, num_warps=w) for bm, bk, w in shapes]

    @triton.autotune(_configs([(32, 64, 4), (32, 128, 4), (64, 64, 4), (128, 64, 8)]), key=["K", "N_SIB", "R"])
    @triton.jit(do_not_specialize=["M"])
    def _down_kernel(x_ptr, a_ptr, h_ptr, seed_ptr, M, K, sxm, sam, shm, thresh, scale,
                    N_SIB: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        offs_m = pid * BM + tl.arange(0, BM)
        offs_r = tl.arange(0, R)
        a00, a01 = _seed_words(seed_ptr, 0)
        a10, a11 = a00, a01
        if N_SIB > 1:
            a10, a11 = _seed_words(seed_ptr, 1)
        a20, a21 = a00, a01
        if N_SIB > 2:
            a20, a21 = _seed_words(seed_ptr, 2)
        acc0 = tl.zeros([BM, R], dtype=tl.float32)
        acc1 = tl.zeros([BM, R], dtype=tl.float32)
        acc2 = tl.zeros([BM, R], dtype=tl.float32)
        row_ok = offs_m[:, None] < M
        for k_start in range(0, K, BK):
            offs_k = k_start + tl.arange(0, BK)
            col_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=row_ok & col_ok[None, :], other=0.0)
            a_cols = offs_k[:, None] + offs_r[None, :] * sam
            at0 = tl.load(a_ptr + a_cols, mask=col_ok[:, None], other=0.0)
            keep = _keep_tile(a00, a01, offs_m, k_start // 8, thresh, BM, BK)
            acc0 = tl.dot(tl.where(keep, x, 0.0).to(x.dtype), at0, acc0)
            if N_SIB > 1:
                at1 = tl.load(a_ptr + R * sam + a_cols, mask=col_ok[:, None], other=0.0)
                keep = _keep_tile(a10, a11, offs_m, k_start // 8, thresh, BM, BK)
                acc1 = tl.dot(tl.where(keep, x, 0.0).to(x.dtype), at1, acc1)
            if N_SIB > 2:
                at2 = tl.load(a_ptr + 2 * R * sam + a_cols, mask=col_ok[:, None], other=0.0)
                keep = _keep_tile(a20, a21, offs_m, k_start // 8, thresh, BM, BK)
                acc2 = tl.dot(tl.where(keep, x, 0.0).to(x.dtype), at2, acc2)
        dst = h_ptr + offs_m[:, None] * shm + offs_r[None, :]
        tl.store(dst, (acc0 * scale).to(h_ptr.dtype.element_ty), mask=row_ok)
        if N_SIB > 1:
            tl.store(dst + R, (acc1 * scale).to(h_ptr.dtype.element_ty), mask=row_ok)
        if N_SIB > 2:
            tl.store(dst + 2 * R, (acc2 * scale).to(h_ptr.dtype.element_ty), mask=row_ok)

    @triton.autotune(_configs([(64, 64, 4), (64, 128, 4), (128, 64, 8), (32, 128, 4)]), key=["K", "N_SIB", "R"])
    @triton.jit(do_not_specialize=["M"])
    def _up_add_kernel(base_ptr, dh_ptr, a_ptr, out_ptr, seed_ptr, M, K, sbm, sdm, sam, thresh, scale,
                      N_SIB: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_k = pid_k * BK + tl.arange(0, BK)
        offs_r = tl.arange(0, R)
        row_ok, col_ok = offs_m[:, None] < M, offs_k[None, :] < K
        acc = tl.zeros([BM, BK], dtype=tl.float32)
        for j in tl.static_range(N_SIB):
            k0, k1 = _seed_words(seed_ptr, j)
            dh = tl.load(dh_ptr + offs_m[:, None] * sdm + j * R + offs_r[None, :], mask=row_ok, other=0.0)
            a = tl.load(a_ptr + (j * R + offs_r)[:, None] * sam + offs_k[None, :], mask=col_ok, other=0.0)
            part = tl.dot(dh, a)
            keep = _keep_tile(k0, k1, offs_m, pid_k * (BK // 8), thresh, BM, BK)
            acc += tl.where(keep, part, 0.0)
        ptrs = offs_m[:, None] * sbm + offs_k[None, :]
        base = tl.load(base_ptr + ptrs, mask=row_ok & col_ok, other=0.0)
        tl.store(out_ptr + ptrs, (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)

    @triton.autotune(
        _configs([(64, 64, 4), (64, 128, 4), (128, 64, 8), (32, 128, 4)]),
        key=["K", "N_SIB", "R"],
        reset_to_zero=["ga_ptr"],
    )
    @triton.jit(do_not_specialize=["M"])
    def _grad_a_kernel(dh_ptr, x_ptr, ga_ptr, seed_ptr, M, K, sdm, sxm, thresh, scale, SPLITS,
                      N_SIB: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        pid_k, pid_s = tl.program_id(0), tl.program_id(1)
        offs_k = pid_k * BK + tl.arange(0, BK)
        offs_r = tl.arange(0, R)
        col_ok = offs_k[None, :] < K
        for j in tl.static_range(N_SIB):
            k0, k1 = _seed_words(seed_ptr, j)
            acc = tl.zeros([R, BK], dtype=tl.float32)
            for m_start in range(pid_s * BM, M, SPLITS * BM):
                offs_m = m_start + tl.arange(0, BM)
                row_ok = offs_m[:, None] < M
                x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=row_ok & col_ok, other=0.0)
                dh = tl.load(dh_ptr + offs_m[:, None] * sdm + j * R + offs_r[None, :], mask=row_ok, other=0.0)
                keep = _keep_tile(k0, k1, offs_m, pid_k * (BK // 8), thresh, BM, BK)
                acc = tl.dot(tl.trans(dh), tl.where(keep, x, 0.0).to(x.dtype), acc)
            dst = ga_ptr + (j * R + offs_r)[:, None] * K + offs_k[None, :]
            tl.atomic_add(dst, acc * scale, mask=col_ok)

    from llmft.trainer.fastpath.dropout_mask import scale as _scale
    from llmft.trainer.fastpath.dropout_mask import threshold

    @torch.library.custom_op("llmft::lora_drop_down", mutates_args=())
    def lora_drop_down(x2: torch.Tensor, a: torch.Tensor, seeds: torch.Tensor, p: float, rank: int) -> torch.Tensor:
        x2, a = x2.contiguous(), a.contiguous().to(x2.dtype)
        n, (m, k) = seeds.shape[0], x2.shape
        h = torch.empty((m, n * rank), dtype=x2.dtype, device=x2.device)
        _down_kernel[lambda meta: (triton.cdiv(m, meta["BM"]),)](
            x2, a, h, seeds.contiguous(), m, k, x2.stride(0), a.stride(0), h.stride(0), threshold(p), _scale(p),
            N_SIB=n, R=rank,
        )  # fmt: skip
        return h

    @lora_drop_down.register_fake
    def _(x2, a, seeds, p, rank):
        return x2.new_empty((x2.shape[0], seeds.shape[0] * rank))

    @torch.library.custom_op("llmft::lora_drop_up_add", mutates_args=())
    def lora_drop_up_add(
        base: torch.Tensor, dh: torch.Tensor, a: torch.Tensor, seeds: torch.Tensor, p: float, rank: int
    ) -> torch.Tensor:
        base, dh, a = base.contiguous(), dh.contiguous().to(base.dtype), a.contiguous().to(base.dtype)
        n, (m, k) = seeds.shape[0], base.shape
        out = torch.empty_like(base)
        _up_add_kernel[lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(k, meta["BK"]))](
            base, dh, a, out, seeds.contiguous(), m, k, base.stride(0), dh.stride(0), a.stride(0), threshold(p),
            _scale(p), N_SIB=n, R=rank,
        )  # fmt: skip
        return out

    @lora_drop_up_add.register_fake
    def _(base, dh, a, seeds, p, rank):
        return torch.empty_like(base)

    @torch.library.custom_op("llmft::lora_drop_grad_a", mutates_args=())
    def lora_drop_grad_a(dh: torch.Tensor, x2: torch.Tensor, seeds: torch.Tensor, p: float, rank: int) -> torch.Tensor:
        x2, dh = x2.contiguous(), dh.contiguous().to(x2.dtype)
        n, (m, k) = seeds.shape[0], x2.shape
        ga = torch.zeros((n * rank, k), dtype=torch.float32, device=x2.device)
        splits = max(1, min(triton.cdiv(m, 64), 528 // triton.cdiv(k, 128)))
        _grad_a_kernel[lambda meta: (triton.cdiv(k, meta["BK"]), splits)](
            dh, x2, ga, seeds.contiguous(), m, k, dh.stride(0), x2.stride(0), threshold(p), _scale(p), splits,
            N_SIB=n, R=rank,
        )  # fmt: skip
        return ga

    @lora_drop_grad_a.register_fake
    def _(dh, x2, seeds, p, rank):
        return x2.new_empty((seeds.shape[0] * rank, x2.shape[1]), dtype=torch.float32)
