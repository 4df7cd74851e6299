"""GPU checks of the fast path's pieces: correctness against higher-precision
references (fresh random inputs), then speed against the plain PyTorch/PEFT
equivalent, plus the 8192^3 bf16 matmul that calibrates the MFU ceiling.

python -m llmft.benchmarks.gpu.check_kernels --json-out F
"""

from __future__ import annotations

import argparse
import inspect
import sys

from llmft.benchmarks.gpu import common


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    # heavy: torch
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def matmul_tflops(n: int = 8192) -> float:
    # heavy: torch
    import torch

    sets = [
        (torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
        for _ in range(3)
    ]
    state = {"i": 0}

    def one():
        a, b = sets[state["i"] % 3]
        state["i"] += 1
        return a @ b

    ms = bench(one, warmup=5, reps=30)
    return 2 * n**3 / (ms / 1e3) / 1e12


def check_attention() -> dict:
    # heavy: torch
    import torch

    # heavy: torch
    from torch.nn.attention.varlen import varlen_attn

    # heavy: torch
    from llmft.trainer.fastpath.attention import _cuda_varlen, _reference_per_document

    # heavy: torch
    from llmft.trainer.loss import bucket_max_length

    lengths = [1, 17, 300, 1024, 700, 129, 64, 2048, 5, 333]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(total, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(total, 12, 128, device="cuda", dtype=torch.bfloat16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference_per_document(q64, k64, v64, cu, None)
    ref.backward(grad.double())
    errors = {}
    for mode in ("repeat", "native"):
        try:
            q.grad = k.grad = v.grad = None
            out = _cuda_varlen(q, k, v, cu, bucket_max_length(max(lengths)), None, gqa_mode=mode)
            out.backward(grad)
            fast = [out.detach(), q.grad, k.grad, v.grad]
            errors[mode] = {
                name: rel_err(f, r)
                for name, f, r in zip(("out", "dq", "dk", "dv"), fast, [ref, q64.grad, k64.grad, v64.grad], strict=True)
            }
        except Exception as exc:  # noqa: BLE001
            errors[mode] = f"{type(exc).__name__}: {exc}"
    # Speed: 16k tokens of short documents, forward + backward.
    docs = common.sample_lengths(70, "short", seed=7).tolist()
    t = sum(docs)
    cu2 = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q2 = torch.randn(t, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv2 = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    timings = {}
    for mode in ("repeat", "native"):
        for label, max_len in (("bucketed", bucket_max_length(max(docs))), ("exact", max(docs))):

            def step(mode=mode, max_len=max_len):
                _cuda_varlen(q2, kv2, kv2, cu2, max_len, None, gqa_mode=mode).sum().backward()

            try:
                timings[f"{mode}_{label}_ms"] = bench(step)
            except Exception as exc:  # noqa: BLE001
                timings[f"{mode}_{label}_ms"] = f"{type(exc).__name__}: {exc}"
    return {
        "varlen_signature": str(inspect.signature(varlen_attn)),
        "rel_err": errors,
        "tokens": t,
        "fwd_bwd_16k_short_docs": timings,
    }


def check_loss() -> dict:
    # heavy: torch
    import torch

    # heavy: torch
    import torch.nn.functional as F

    # heavy: torch
    from llmft.trainer.fastpath.loss import fused_linear_cross_entropy

    tokens, dim, vocab = 16384, 1536, 151936
    hidden = (torch.randn(tokens, dim, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, dim, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    targets[torch.rand(tokens, device="cuda") < 0.35] = -100
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    fast_grad = hidden.grad.clone()
    h32 = hidden.detach().float().requires_grad_()
    ref = F.cross_entropy(h32 @ weight.float().t(), targets, ignore_index=-100)
    ref.backward()
    errors = {"loss": rel_err(loss.detach(), ref.detach()), "grad_hidden": rel_err(fast_grad, h32.grad)}
    del h32, ref
    torch.cuda.empty_cache()

    def fused():
        hidden.grad = None
        fused_linear_cross_entropy(hidden, weight, targets).backward()

    def plain():
        hidden.grad = None
        F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=-100).backward()

    out = {"rel_err": errors}
    for name, fn in (("fused", fused), ("plain_bf16_logits_fp32_ce", plain)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[f"{name}_ms"] = bench(fn)
        out[f"{name}_extra_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def check_lora() -> dict:
    # heavy: torch
    import torch

    # heavy: peft
    from peft import LoraConfig, get_peft_model

    # heavy: torch
    from llmft.trainer.fastpath.lora import fuse_lora_linears

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(1536, 8960, bias=False)

        def forward(self, x):
            return self.up_proj(x)

    torch.manual_seed(0)
    net = One().cuda().bfloat16()
    model = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules=["up_proj"], init_lora_weights=False))
    x = torch.randn(16384, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(16384, 8960, device="cuda", dtype=torch.bfloat16)

    def grads():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.backward(g)
        return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in model.parameters() if p.requires_grad]

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).backward(g)

    ref = grads()
    peft_ms = bench(step)
    fuse_lora_linears(model)
    new = grads()
    fused_ms = bench(step)
    names = ["out", "dx", "dA", "dB"]
    return {
        "rel_err": {n: rel_err(a, b) for n, a, b in zip(names, new, ref, strict=True)},
        "peft_fwd_bwd_ms": peft_ms,
        "fused_fwd_bwd_ms": fused_ms,
    }


def lora_breakdown() -> dict:
    """fwd+bwd ms of one LoRA linear per form, for the decoder's shapes, vs the frozen matmuls alone."""
    shapes = ((1536, 8960), (8960, 1536), (1536, 1536), (1536, 256), (896, 4864), (4864, 896))
    return {f"{d_in}x{d_out}": _lora_shape_row(14720, d_in, d_out) for d_in, d_out in shapes}


def _lora_shape_row(tokens: int, d_in: int, d_out: int) -> dict:
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath.lora import lora_linear

    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02
    a = (torch.randn(16, d_in, device="cuda") * 0.02).requires_grad_()
    b = (torch.randn(d_out, 16, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)

    def base():
        x.grad = None
        (x @ w.t()).backward(g)

    def unfused():
        x.grad = a.grad = b.grad = None
        (x @ w.t() + (x @ a.to(x.dtype).t()) @ b.to(x.dtype).t() * 2.0).backward(g)

    row = {"frozen_matmuls": bench(base), "unfused": bench(unfused)}
    for mode in ("epilogue", "concat"):

        def fused(mode=mode):
            x.grad = a.grad = b.grad = None
            lora_linear(x, w, None, a, b, 2.0, mode=mode).backward(g)

        row[mode] = bench(fused)
    return row


def check_lora_dropout() -> dict:
    """LoRA dropout kernels (llmft/trainer/fastpath/lora_dropout_triton.py) against the torch reference of the same
    Philox mask: the mask bit for bit, the three ops in float64 on fresh bf16 inputs; then the fused linear's
    forward + backward at p = 0.05 against p = 0 (tokens x 1536 -> 1536, r 16; and a q/k/v group)."""
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath import lora_dropout as ld

    # heavy: torch
    from llmft.trainer.fastpath.lora import lora_linear

    # heavy: torch
    from llmft.trainer.fastpath.lora_groups import grouped_lora_linear

    out: dict = {"triton": ld._use_triton(torch.empty(8, 64, device="cuda", dtype=torch.bfloat16), 16)}
    m, k, r, p = 4099, 1544, 16, 0.05
    for n in (1, 2, 3):
        seeds = ld.draw_seeds(n, torch.device("cuda"))
        ones = torch.ones(m, n * r, device="cuda", dtype=torch.bfloat16)
        a = torch.full((n * r, k), 1.0 / r, device="cuda", dtype=torch.bfloat16)
        got = torch.ops.llmft.lora_drop_up_add(
            torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), ones, a, seeds, p, r
        )
        want = sum(ld.keep_mask(seeds[j], m, k, p).to(torch.int32) for j in range(n))
        counts = torch.round(got.float() / ld.scale(p)).to(torch.int32)
        x, a, dh, base = (
            torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n * r, k), (m, n * r), (m, k))
        )
        x64, a64, dh64, base64 = x.double(), a.double(), dh.double(), base.double()
        out[f"siblings_{n}"] = {
            "mask_mismatches": int((counts != want).sum()),
            "keep_fraction": float(ld.keep_mask(seeds[0], m, k, p).float().mean()),
            "down_rel_err": rel_err(ld.dropped_down(x, a, seeds, p, r), ld._ref_down(x64, a64, seeds, p, r)),
            "up_add_rel_err": rel_err(
                ld.dropped_up_add(base, dh, a, seeds, p, r), ld._ref_up_add(base64, dh64, a64, seeds, p, r)
            ),
            "grad_a_rel_err": rel_err(ld.dropped_grad_a(dh, x, seeds, p, r), ld._ref_grad_a(dh64, x64, seeds, p, r)),
        }
    tokens, d = 16384, 1536
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16) * 0.02
    la = (torch.randn(r, d, device="cuda") * 0.02).requires_grad_()
    lb = (torch.randn(d, r, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    ws = [w, w[:256], w[:256]]
    gg = torch.randn(tokens, d + 512, device="cuda", dtype=torch.bfloat16)
    las = [(torch.randn(r, d, device="cuda") * 0.02).requires_grad_() for _ in ws]
    lbs = [(torch.randn(wi.shape[0], r, device="cuda") * 0.02).requires_grad_() for wi in ws]
    for drop in (0.0, 0.05):
        out[f"linear_ms_p{drop}"] = bench(
            lambda drop=drop: lora_linear(x, w, None, la, lb, 2.0, dropout=drop).backward(g)
        )
        out[f"qkv_group_ms_p{drop}"] = bench(
            lambda drop=drop: grouped_lora_linear(x, ws, [None] * 3, las, lbs, (2.0,) * 3, (drop,) * 3).backward(gg)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    # heavy: torch
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    result = {**common.device_info(), "matmul_tflops": matmul_tflops()}
    print("matmul", result["matmul_tflops"], flush=True)
    for name, fn in (
        ("attention", check_attention),
        ("loss", check_loss),
        ("lora", check_lora),
        ("lora_dropout", check_lora_dropout),
        ("lora_breakdown_ms", lora_breakdown),
    ):
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report every check, keep going
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, result[name], flush=True)
        torch.cuda.empty_cache()
    common.write_json(a.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
