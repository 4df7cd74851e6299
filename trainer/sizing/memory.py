"""GPU memory of one training step, and the micro batch / gradient checkpointing it allows.

``estimate(setup, tokens, checkpointed)`` predicts the peak allocated bytes of a step whose micro
batch holds ``tokens`` tokens; :func:`plan` picks the largest micro batch (packed sequences of the
data's ``max_length``) that fits the card's free memory without recomputation, and turns gradient
checkpointing on for as few decoder layers as needed only when even one sequence would not fit.

Derivation. Notation: T tokens in the micro batch, L decoder layers, H hidden size, I MLP width,
KV = key/value heads x head_dim, V vocabulary, N_l the matmul weights of the decoder layers,
N all parameters, b = 2 (bf16 activations), P the LoRA adapter parameters (r (d_in + d_out) per
adapted linear), and S_in / S_out the summed input / output widths of the adapted linears of one
layer (all-linear: S_in = 6H + I, S_out = 3H + 2 KV + 2I).

1. Weights. LoRA: N in bf16 (2N). QLoRA: the layers' linears in 4-bit NF4 (0.53 byte per weight:
   4 bits plus the double-quantized block constants), embeddings and head in bf16. Full
   fine-tuning under DDP: fp32 master weights, gradients and Adam's two moments (16N), plus the
   bf16 copies of the layer weights autocast keeps for the backward (2 N_l). DeepSpeed holds
   weights in bf16 and shards the fp32 master copy and the moments (12N / W) from stage 1, the
   gradients (4N / W) from stage 2 and the bf16 weights (2N / W) at stage 3.
2. Adapter state: fp32 weight, gradient and two moments, 16 bytes per adapter parameter (16P).
3. Activations kept for the backward, per token and layer (bytes):
   - the two residual-stream tensors the RMSNorms read: 2bH compiled (Inductor keeps the bf16
     input), 8H eager (transformers' RMSNorm keeps an fp32 copy);
   - attention: q, k, v (repeated to the query width before the kernel) and the output: 4bH;
   - MLP: gate and up, 2bI compiled; eager also the SiLU output (3bI);
   - the inputs the linears need for their gradients: the fused LoRA path (and full fine-tuning)
     keeps one bf16 copy per input, q/k/v's and gate/up's shared: b(2H + I) (o_proj reads the
     attention output, counted above); PEFT's LoRA casts each adapted input to fp32: 4 S_in;
     full fine-tuning eager under autocast casts each linear's input: b (6H + I); DeepSpeed's
     bf16 model reads the same tensors: b (2H + I);
   - LoRA dropout: the fused LoRA path keeps no mask (two seed words per linear, lora_dropout.py;
     measured 46.3 GiB at dropout 0.05 and at 0, issue 28); the fused 4-bit path uncompiled keeps
     one boolean mask per adapted input (S_in), compiled nothing (measured: 46.5 GiB against 46.3
     where a kept mask would add 8.7 GiB); PEFT keeps the fp32 dropped input and its mask (5 S_in);
   - compiled layers around PEFT's LoRA keep its fp32 adapter outputs (4 S_out; the float32
     [tokens, 8960] QLoRA buffers measured on an H100 were this plus PEFT's kbit preparation making every activation
     float32, which the trainer no longer runs: trainer/fastpath/qlora.py);
   - QLoRA on the fused path keeps exactly what fused LoRA keeps (its 4-bit node saves the bf16
     input, h and the masks; fastpath/qlora.py);
   - attention through transformers' sdpa on packed rows builds a (T x T) block-causal mask that
     the memory-efficient kernel converts to a bf16 bias and keeps per layer: 2T bytes per token.
   Fast path (compiled, fused LoRA, varlen): b (8H + 3I), e.g. 78 KB per token and layer for the
   Qwen2.5-1.5B shape. A layer under gradient checkpointing keeps only its input (bH); the one
   being recomputed in the backward holds its full set once.
4. The loss. Fused: one chunk of min(4096, supervised rows) logits with its gradient and the fp32
   temporaries, 6 bytes per logit (benchmarks/gpu/check_kernels.py measured 3.5 GiB for a 4096 x
   152k chunk), plus the supervised rows' hidden states and gradients (4H per row); a trained head
   also keeps an fp32 gradient accumulator (4VH). Plain: bf16 logits over every token, their fp32
   copy and log-softmax and the gradient: 12 bytes per logit (27.8 GiB measured for 16k x 152k).
5. The compiled fused LoRA forms fold each group's weights into one ``[W | s B]`` matrix
   (lora_groups.py, lora.py's concat form) and Inductor keeps it for the backward: one bf16 copy
   of q/k/v and gate/up's weights (gate/up's only, ungrouped). Not for QLoRA: its 4-bit node
   dequantizes inside custom ops that compile cannot see into, so nothing is kept.
6. The backward's transient per-layer gradients, b T (2I + 4H), peak after the loss is gone, and
   so does a checkpointed layer's recomputed set: the step's peak is weights + state + kept
   activations + max(loss, recomputed layer + transient) (the 4-layer Qwen3-30B-A3B run with every
   layer checkpointed: 9.9 GiB measured, 9.8 this model). QLoRA adds to the
   transient the bf16 weights one 4-bit matmul dequantizes (fused: the largest group's stacked
   weight and its folded copy, 2b (H x (2I)) for gate/up; PEFT's path: one linear's weight).

7. Mixture-of-experts layers (Qwen3-MoE shape; E experts of width I_m, top-k, Q = heads x head_dim).
   Weights: attention, router and the E experts' fused tensors (QLoRA: attention and experts in
   4-bit, the router in bf16); LoRA on all-linear adapts the attention projections only, expert
   LoRA (``lora.target_modules`` with ``experts``) adds r (H + 2 I_m) + r (I_m + H) per expert.
   Kept per token: b (3H + 4Q) for the norms' inputs, q/k/v/o and the adapted input, b (Q + KV) for
   Qwen3's q/k norms, the router's fp32 probabilities (4E), and per routed row (k per token)
   b (2 I_m + H): the gate/up output the activation's backward reads and each expert's output the
   routing weights' gradient reads (frozen experts need no input for their own backward). The
   trainer's grouped path for 4-bit experts keeps each row's input too (+ k b H); expert LoRA keeps
   the rows' inputs of both tensors and the adapters' outputs (+ k b (H + 2 I_m)). Measured on the
   Qwen3-30B-A3B shape (these rows: tests/fastpath/test_memory.py): 48 layers LoRA 110.9 GiB at T =
   9,880 (this model 111.1), QLoRA 56.4 at 5,897 (57.9); 4 layers LoRA 17.5 at 18,447 (17.2), QLoRA
   16.2 (16.0), expert LoRA 22.1 (21.9). Before these rows the trainer ran MoE models at one
   sequence per forward with every layer checkpointed; the shipped 1xH100 QLoRA config now plans
   one 4096-token sequence per forward without recomputation (estimate 46 of 71 GiB usable).

Calibration (peak = torch.cuda.max_memory_allocated of the benchmark's trainer runs,
benchmarks/results/2026-11-26-{h100,h200}.json; T = the run's largest micro batch in tokens,
computed from the benchmark's seeded samples; fast path, r16 all-linear, no dropout):

| run                                          | T      | measured GiB | this model GiB |
|----------------------------------------------|-------:|-------------:|---------------:|
| Qwen2.5-1.5B LoRA, grouped (s3-final)         | 18,447 | 46.3         | 46.0           |
| Qwen2.5-1.5B LoRA, ungrouped (s3-c3)          | 18,447 | 47.6         | 45.8           |
| Qwen2.5-0.5B LoRA, grouped (s3-final)         | 18,447 | 23.2         | 22.9           |
| Qwen2.5-0.5B LoRA, ungrouped, 128 samples    | 34,103 | 39.9         | 38.2           |
| Llama-3-8B LoRA, grouped, 16 samples (s3-c3) |  5,897 | 52.9         | 53.5           |
| Llama-3-8B LoRA, ungrouped, 32 samples (s1)  |  9,880 | 72.2         | 70.2           |
| Qwen2.5-1.5B full, 32 samples (s3-final)      |  9,880 | 49.3         | 50.0           |
| Qwen2.5-1.5B full, ZeRO-3 1 GPU, plain loss  |  9,880 | 68.9         | 69.0           |
| Qwen2.5-1.5B QLoRA, fused 4-bit, 64 samples  | 18,447 | 42.9         | 42.6           |
| Llama-3-8B QLoRA, fused 4-bit, 16 samples    |  5,685 | 33.8         | 34.7           |
| Qwen2.5-1.5B LoRA, dropout 0.05 (dropout-split) | 18,447 | 46.5       | 46.0           |
| Qwen2.5-1.5B LoRA, dropout 0.05, shipped config (project-product) | 16,384 | 42.2 | 41.8 |

and two earlier figures (H100; no result file): the trainer's old defaults (sdpa,
PEFT LoRA with dropout 0.05, plain loss) ran out of 78 GiB at 64 samples (model: 169 GiB) and
ran at 16 (model: 52 GiB). The earlier QLoRA figures (34.9 GiB at 16 samples, out of memory at
64) came from the float32 path the trainer no longer takes (PEFT's kbit preparation), which this
model does not describe. The QLoRA rows were predicted before they ran (42.6 GiB for the 1.5B
row) and measured on an H100 (gpu-logs/2026-11-26-h100-qlora-fused/; the 1.5B LoRA row
of the same call: 46.3). The model is within -4.3% / +2.8% of
every fast-path figure above (tests/fastpath/test_memory.py and test_qlora_plan.py check these
rows). The dropout rows came after the first product run, whose log printed `est. 49.6` (a mask
term for compiled layers too) against 42.2 measured; QLoRA 1.5B at 64 samples with dropout 0.05
peaked at 40.1 GiB (without dropout 42.9). The compiled term is now zero. :func:`plan`
keeps a margin of 8% of the free memory plus 1 GiB for that error, allocator fragmentation and
library workspaces (``MARGIN_FRACTION``, ``MARGIN_BYTES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmft.trainer.flops import ALL_LINEAR, ModelShape

ATTENTION = ALL_LINEAR[:4]  # q, k, v, o

GiB = 2**30
BF16 = 2
MARGIN_FRACTION = 0.08
MARGIN_BYTES = 1 * GiB
LOSS_CHUNK = 4096  # rows per fused-loss chunk (fastpath/loss.py's default)
NF4_BYTES = 0.53  # bytes per 4-bit weight incl. double-quantized block constants


@dataclass(frozen=True)
class Setup:
    """Everything besides the token count that a step's memory depends on."""

    shape: ModelShape
    method: str  # lora | qlora | full
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEAR
    lora_dropout: float = 0.0
    tied_embeddings: bool = True
    varlen: bool = True
    fused_loss: bool = True
    fused_lora: bool = True
    grouped_lora: bool = True
    compile: bool = True
    zero_stage: int = 0  # 0 = DDP (or one process)
    world_size: int = 1
    lora_experts: bool = False  # MoE: LoRA on the expert tensors too (item 7)

    @property
    def adapted(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of the adapted linears of one layer (none for full fine-tuning)."""
        if self.method == "full":
            return {}
        shapes = self.shape.linear_shapes()
        if self.shape.n_experts:  # all-linear on an MoE model: the attention projections (moe_model.py)
            shapes = {k: v for k, v in shapes.items() if k in ATTENTION}
        return {k: v for k, v in shapes.items() if k in self.lora_targets}


@dataclass
class Estimate:
    """Predicted peak bytes of one step, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def gib(self) -> dict[str, float]:
        return {k: round(v / GiB, 2) for k, v in self.parts.items()}


def parameter_counts(shape: ModelShape, tied: bool) -> tuple[int, int]:
    """(weights of the decoder layers' linears and experts, all parameters incl. embeddings, head and
    routers)."""
    dense = sum(i * o for i, o in shape.linear_shapes().values())
    attention = sum(i * o for n, (i, o) in shape.linear_shapes().items() if n in ATTENTION)
    experts = shape.n_experts * 3 * shape.hidden * shape.moe_intermediate
    layers = (shape.n_layers - shape.moe_layers) * dense + shape.moe_layers * (attention + experts)
    embeddings = shape.vocab * shape.hidden * (1 if tied else 2)
    norms = (2 * shape.n_layers + 1) * shape.hidden
    routers = shape.moe_layers * shape.n_experts * shape.hidden
    return layers, layers + embeddings + norms + routers


def adapter_parameters(setup: Setup) -> int:
    shape = setup.shape
    linears = shape.n_layers * sum(setup.lora_rank * (i + o) for i, o in setup.adapted.values())
    if not (setup.lora_experts and shape.n_experts):
        return linears
    per_expert = setup.lora_rank * (
        (shape.hidden + 2 * shape.moe_intermediate) + (shape.moe_intermediate + shape.hidden)
    )
    return linears + shape.moe_layers * shape.n_experts * per_expert


def weight_bytes(setup: Setup) -> float:
    """Weights plus what training keeps per parameter (gradients, optimizer state)."""
    layers, total = parameter_counts(setup.shape, setup.tied_embeddings)
    w, zero = max(1, setup.world_size), setup.zero_stage
    if setup.method == "full":
        if zero == 0:
            return 16.0 * total + BF16 * layers  # fp32 weights, grads, 2 moments; autocast's bf16 copies
        params = BF16 * total / (w if zero == 3 else 1)
        return params + 12.0 * total / w + 4.0 * total / (w if zero >= 2 else 1)
    if setup.method == "qlora":
        base = NF4_BYTES * layers + BF16 * (total - layers)
    else:
        base = BF16 * total / (w if zero == 3 else 1)
    return base + 16.0 * adapter_parameters(setup)


def concat_weight_bytes(setup: Setup) -> float:
    """Compiled fused LoRA: the folded [W | s B] of q/k/v and gate/up that Inductor keeps. None for
    QLoRA: its fused 4-bit path dequantizes inside custom ops that compile cannot see into (qlora.py)."""
    if not (setup.compile and setup.fused_lora and setup.adapted) or setup.method == "qlora":
        return 0.0
    shapes = setup.adapted
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if setup.grouped_lora else ("gate_proj", "up_proj")
    return BF16 * setup.shape.n_layers * sum(shapes[n][0] * shapes[n][1] for n in names if n in shapes)


def dequant_bytes(setup: Setup) -> float:
    """QLoRA: the bf16 weights one 4-bit matmul dequantizes, held only while it runs (item 6). Fused path:
    the largest group's stacked weight plus its copy with the adapters folded in (the concat form);
    PEFT's path: one linear's weight (bitsandbytes dequantizes per linear)."""
    if setup.method != "qlora":
        return 0.0
    if setup.shape.n_experts:  # one layer's experts, both fused tensors (fastpath/moe.py)
        return BF16 * setup.shape.n_experts * 3 * setup.shape.hidden * setup.shape.moe_intermediate
    shapes = setup.shape.linear_shapes()
    if not (setup.fused_lora and setup.adapted):
        return BF16 * max(d_in * d_out for d_in, d_out in shapes.values())
    groups: list[tuple[str, ...]] = [(name,) for name in shapes]
    if setup.grouped_lora:
        groups += [g for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if set(g) <= set(shapes)]
    return 2 * BF16 * max(shapes[g[0]][0] * sum(shapes[n][1] for n in g) for g in groups)


def activation_bytes_per_token(setup: Setup, tokens: int) -> float:
    """Bytes kept for the backward per token by one decoder layer (see the module doc, item 3)."""
    s, b = setup.shape, BF16
    h, i = s.hidden, s.intermediate
    s_in = sum(d_in for d_in, _ in setup.adapted.values())
    s_out = sum(d_out for _, d_out in setup.adapted.values())
    out = (2 * b * h if setup.compile else 8 * h) + 4 * b * h + (2 if setup.compile else 3) * b * i
    if setup.method == "full":
        eager_autocast = not setup.compile and setup.zero_stage == 0
        out += b * (6 * h + i) if eager_autocast else b * (2 * h + i)
    elif setup.fused_lora:
        kept_mask = setup.lora_dropout > 0 and not setup.compile and setup.method == "qlora"
        out += b * (2 * h + i) + (s_in if kept_mask else 0)
    else:
        out += 4 * s_in + (5 * s_in if setup.lora_dropout > 0 else 0) + (4 * s_out if setup.compile else 0)
    if not setup.varlen:
        out += 2 * tokens  # sdpa's (T x T) bf16 bias of the packed-row mask, kept per layer
    return out


def moe_activation_bytes_per_token(setup: Setup) -> float:
    """Bytes kept for the backward per token by one MoE decoder layer (module doc, item 7)."""
    s, b = setup.shape, BF16
    h, q, kv, i_m, k = (
        s.hidden,
        s.n_heads * s.head_dim,
        s.n_kv_heads * s.head_dim,
        s.moe_intermediate,
        s.experts_per_token,
    )
    out = b * (3 * h + 4 * q) + b * (q + kv) + 4 * s.n_experts + k * b * (2 * i_m + h)
    if setup.method == "qlora":
        out += k * b * h
    if setup.lora_experts:
        out += k * b * (h + 2 * i_m)
    return out


def loss_bytes(setup: Setup, tokens: int, supervised: int) -> float:
    v, h = setup.shape.vocab, setup.shape.hidden
    if not setup.fused_loss:
        return 12.0 * tokens * v
    head_trained = setup.method == "full"
    return 6.0 * min(LOSS_CHUNK, supervised) * v + 4.0 * supervised * h + (4.0 * v * h if head_trained else 0.0)


def estimate(setup: Setup, tokens: int, checkpointed: int = 0, supervised_fraction: float = 1.0) -> Estimate:
    """Peak bytes of a step with ``tokens`` tokens per micro batch and ``checkpointed`` layers recomputed."""
    shape = setup.shape
    layers, moe_layers = shape.n_layers, shape.moe_layers
    dense = activation_bytes_per_token(setup, tokens) * tokens
    sparse = moe_activation_bytes_per_token(setup) * tokens if moe_layers else 0.0
    per_layer = ((layers - moe_layers) * dense + moe_layers * sparse) / layers  # the mean over the layers
    kept = (layers - checkpointed) * per_layer + checkpointed * BF16 * shape.hidden * tokens
    recompute = max(dense if layers > moe_layers else 0.0, sparse) if checkpointed else 0.0
    mlp_width = shape.experts_per_token * shape.moe_intermediate if moe_layers else shape.intermediate
    transient = BF16 * tokens * (2 * mlp_width + 4 * shape.hidden) + dequant_bytes(setup)
    loss = loss_bytes(setup, tokens, max(1, int(tokens * supervised_fraction)))
    return Estimate(
        {
            "weights_and_state": weight_bytes(setup),
            "folded_lora_weights": concat_weight_bytes(setup),
            "activations": kept,
            "loss_or_backward": max(loss, recompute + transient),  # the loss is gone before layers recompute
        }
    )


@dataclass(frozen=True)
class MemoryPlan:
    """The micro batch and the checkpointed layers one rank runs with, and why."""

    micro_sequences: int
    checkpointed_layers: int
    layers: int
    micro_why: str
    checkpointing_why: str
    estimate_gib: float | None = None
    budget_gib: float | None = None
    free_gib: float | None = None
    parts_gib: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "micro_sequences": self.micro_sequences,
            "checkpointed_layers": self.checkpointed_layers,
            "layers": self.layers,
            "micro_why": self.micro_why,
            "checkpointing_why": self.checkpointing_why,
            "estimate_gib": self.estimate_gib,
            "budget_gib": self.budget_gib,
            "free_gib": self.free_gib,
            "parts_gib": self.parts_gib,
        }


def budget_bytes(free_bytes: float) -> float:
    """What a step may use of the free memory measured at start."""
    return free_bytes * (1 - MARGIN_FRACTION) - MARGIN_BYTES


def plan(
    setup: Setup,
    *,
    free_bytes: float,
    max_length: int,
    per_rank_sequences: int,
    micro: int | str = "auto",
    checkpointing: bool | str = "auto",
) -> MemoryPlan:
    """The largest micro batch that fits without recomputation (``micro`` auto), then the fewest
    checkpointed layers that make it fit (``checkpointing`` auto). Explicit values are kept."""
    budget, layers = budget_bytes(free_bytes), setup.shape.n_layers

    def total(n: int, k: int) -> float:
        return estimate(setup, n * max_length, k).total

    forced = layers if checkpointing is True else 0
    if micro == "auto":
        fitting = [n for n in range(1, per_rank_sequences + 1) if total(n, forced) <= budget]
        n = fitting[-1] if fitting else 1
        accum = math.ceil(per_rank_sequences / n)
        n = math.ceil(per_rank_sequences / accum)  # equal micro batches, same number of them
        if not fitting:
            micro_why = f"auto: 1 sequence (even one of {max_length} tokens does not fit without recomputation)"
        elif n == per_rank_sequences:
            micro_why = f"auto: the step's {n} sequence(s) per rank in one forward fit"
        else:
            micro_why = f"auto: {n} x {max_length} tokens, the most that fit ({accum} micro steps)"
    else:
        n, micro_why = int(micro), "set by batch.micro_sequences"
    k, checkpointing_why = _checkpointed_layers(checkpointing, layers, budget, lambda k: total(n, k))
    est = estimate(setup, n * max_length, k)
    return MemoryPlan(
        micro_sequences=n,
        checkpointed_layers=k,
        layers=layers,
        micro_why=micro_why,
        checkpointing_why=checkpointing_why,
        estimate_gib=round(est.total / GiB, 1),
        budget_gib=round(budget / GiB, 1),
        free_gib=round(free_bytes / GiB, 1),
        parts_gib=est.gib(),
    )


def _checkpointed_layers(setting, layers: int, budget: float, total) -> tuple[int, str]:
    if setting is True:
        return layers, "set true: every layer"
    if setting is False:
        warn = "" if total(0) <= budget else " (the estimate exceeds the budget: it may run out of memory)"
        return 0, "set false" + warn
    if total(0) <= budget:
        return 0, "auto: off, the micro batch fits without it"
    for k in range(1, layers + 1):
        if total(k) <= budget:
            return k, f"auto: on for {k} of {layers} layers, the fewest that make the micro batch fit"
    return layers, f"auto: on for all {layers} layers, and the estimate still exceeds the budget"


def cpu_plan(micro: int | str, checkpointing: bool | str, layers: int) -> MemoryPlan:
    """No GPU: nothing to fit. auto keeps today's CPU behaviour (one sequence, no recomputation)."""
    n = 1 if micro == "auto" else int(micro)
    k = layers if checkpointing is True else 0
    labels: dict[bool | str, str] = {True: "set true: every layer", False: "set false"}
    why = labels.get(checkpointing, "cpu: off")
    return MemoryPlan(
        micro_sequences=n,
        checkpointed_layers=k,
        layers=layers,
        micro_why="cpu: 1 sequence" if micro == "auto" else "set by batch.micro_sequences",
        checkpointing_why=why,
    )
