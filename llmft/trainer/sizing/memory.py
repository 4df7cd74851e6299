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
     float32, which the trainer no longer runs: llmft/trainer/fastpath/qlora.py);
   - QLoRA on the fused path keeps exactly what fused LoRA keeps (its 4-bit node saves the bf16
     input, h and the masks; fastpath/qlora.py);
   - attention through transformers' sdpa on packed rows builds a (T x T) block-causal mask that
     the memory-efficient kernel converts to a bf16 bias and keeps per layer: 2T bytes per token.
   Fast path (compiled, fused LoRA, varlen): b (8H + 3I), e.g. 78 KB per token and layer for the
   Qwen2.5-1.5B shape. A layer under gradient checkpointing keeps only its input (bH); the one
   being recomputed in the backward holds its full set once.
4. The loss. Fused: one chunk of min(4096, supervised rows) logits with its gradient and the fp32
   temporaries, 6 bytes per logit (llmft/benchmarks/gpu/check_kernels.py measured 3.5 GiB for a 4096 x
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
   Qwen3's q/k norms, the router's fp32 probabilities (4E), and per routed row (k per token): with
   transformers' own experts (frozen bf16, attention-only LoRA) b (2 I_m + H), the gate/up output the
   activation's backward reads and each expert's output the routing weights' gradient reads; with the
   trainer's grouped experts (4-bit experts, expert LoRA: fastpath/moe_rows.py) b 2 I_m + 4, the gate/up
   output and the routing weight (the weight multiplies the down projection's input, and the SiLU
   product is recomputed). Expert LoRA adds the rows' inputs of both tensors and the adapters' outputs
   (+ k b (H + 2 I_m)); the 4-bit attention node's LoRA dropout keeps one mask byte per adapted input
   (S_in; fastpath/qlora.py draws its masks with torch's generator, which compiled code saves rather
   than replays). Measured on the Qwen3-30B-A3B shape (these rows: tests/fastpath/test_memory.py): 48
   layers LoRA 110.9 GiB at T = 9,880 (this model 111.1); the shipped QLoRA config (dropout 0.05) on one
   H200 at T = 16,384, training's own peak (issue 46): 83.35 GiB (this model 85.4), and 116.35 with the
   code before issue 46, which also kept act(gate) and the [S, H] expert output per row (I_m + H more:
   this model so adjusted 118.3); 4 layers LoRA 17.5 at 18,447 (17.2). The QLoRA 56.4 GiB at 5,897 of
   round four was the load's peak, not training's (its bf16 experts before 4-bit storage), and the
   4-layer QLoRA and expert-LoRA rows (16.2, 22.1 GiB) ran the code before issue 46. The shipped 1xH100
   QLoRA config plans 3 x 4096 tokens per forward on an H100 and 6 on an H200, without recomputation.

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
library workspaces (``MARGIN_FRACTION``, ``MARGIN_BYTES``). For full fine-tuning the 8% is taken of the
free memory left beside the weights and optimizer state (``budget_bytes(free, exact)``): those are 16-18
bytes a parameter counted exactly (the ZeRO-3 row above: 68.9 measured, 69.0 here), and for Llama-3-8B
over two GPUs they are 67 GiB, where 8% of the whole card would leave no room for any micro batch.

8. Full fine-tuning under ZeRO-3 (issue 37; 4 x H100 rows, benchmarks/results/2026-11-27-4xh100-scaleout.json,
   about 1,900 tokens a micro batch): with every layer checkpointed 39.3 GiB (this model 37.4), 69.2 on 2
   GPUs (71.0); without checkpointing 61.7 (47.6 without the term below). The difference is one bf16 copy
   of the layers' weights (2 N_l, 13 GiB for the 8B shape) that a step without recomputation keeps until
   the backward: counted for each layer not checkpointed (60.6 with it), over more than one GPU (on one,
   the gathered weight is the rank's own partition: the 1-GPU ZeRO-3 row above has no such copy). The
   mechanism inside DeepSpeed is not identified; the term is this one measurement.

Which plan is fastest (:func:`step_cost`). ZeRO-3 gathers every weight in each micro step's forward and
again in its backward and reduce-scatters the gradients; so a micro batch of one sequence with no
recomputation can be slower than eight with every layer recomputed. :func:`plan` (``micro`` and
``checkpointing`` both ``auto``) takes, for each micro batch size, the fewest checkpointed layers that make
it fit, and keeps the size with the lowest step cost: the step's tokens times (1 + the recomputed share of
the compute) plus a fixed cost per micro step in tokens of compute (``MICRO_STEP_TOKENS``). The fixed
cost is fitted to four 2 x H200 rows of the 8B shape (ZeRO-3, every layer checkpointed, micro batches of
8 / 16 / 32 / 64 samples of about 1,900 tokens per 8: 4,792 / 7,987 / 12,559 / 14,955 tokens/s): 1/tps =
F / T + c gives F = 0.29 s per micro step, as long as about 6,000 tokens of compute (the fit reproduces
the 16 and 32 rows within -2% / -9%). ZeRO-1/2 reduce-scatter the gradients in every micro step (a
third of ZeRO-3's traffic); DDP accumulates under ``no_sync`` and reduces once a step (no fixed cost: the
plan is the old one, the largest micro batch that fits without recomputation, else one sequence and the
fewest checkpointed layers).
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
ZERO3_MICRO_STEP_TOKENS = 6000  # the fixed cost of one ZeRO-3 micro step, in tokens of compute (module doc)
MICRO_STEP_TOKENS = {3: ZERO3_MICRO_STEP_TOKENS, 2: ZERO3_MICRO_STEP_TOKENS / 3, 1: ZERO3_MICRO_STEP_TOKENS / 3, 0: 0}
"""Fixed cost of one micro step by ZeRO stage (0 = DDP): the weights gathered twice and the gradients
reduce-scattered (3), the gradients only (1, 2), nothing until the step's last micro step (DDP, no_sync)."""
RECOMPUTED_SHARE = {"full": 1 / 3, "lora": 1 / 2, "qlora": 1 / 2}
"""The forward's share of a layer's training compute, what recomputing it adds: full fine-tuning 2 of 6
FLOPs a weight and token; LoRA's frozen weights need no weight gradient (2 of 4)."""


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
    out = b * (3 * h + 4 * q) + b * (q + kv) + 4 * s.n_experts
    if setup.method == "qlora" or setup.lora_experts:  # the trainer's grouped experts (fastpath/moe_rows.py)
        out += k * (b * 2 * i_m + 4)  # per routed row: the gate/up output and the routing weight
    else:  # transformers' grouped_mm experts: the gate/up output and each expert's output
        out += k * b * (2 * i_m + h)
    if setup.lora_experts:
        out += k * b * (h + 2 * i_m)
    if setup.method == "qlora" and setup.lora_dropout > 0:  # the 4-bit attention node's dropout masks
        out += sum(d_in for d_in, _ in setup.adapted.values())
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
    parts = {
        "weights_and_state": weight_bytes(setup),
        "folded_lora_weights": concat_weight_bytes(setup),
        "activations": kept,
        "loss_or_backward": max(loss, recompute + transient),  # the loss is gone before layers recompute
    }
    if setup.method == "full" and setup.zero_stage == 3 and setup.world_size > 1 and checkpointed < layers:  # item 8
        parts["zero3_gathered_weights"] = (
            BF16 * parameter_counts(shape, setup.tied_embeddings)[0] * ((layers - checkpointed) / layers)
        )
    return Estimate(parts)


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


def budget_bytes(free_bytes: float, exact: float = 0.0) -> float:
    """What a step may use of the free memory measured at start; ``exact`` bytes (full fine-tuning's weights
    and optimizer state, counted exactly: :func:`exact_bytes`) are kept out of the fraction the margin takes."""
    exact = min(max(0.0, exact), free_bytes)
    return exact + (free_bytes - exact) * (1 - MARGIN_FRACTION) - MARGIN_BYTES


def exact_bytes(setup: Setup) -> float:
    """The part of an estimate the margin need not cover: full fine-tuning's weights and optimizer state."""
    return weight_bytes(setup) if setup.method == "full" else 0.0


def step_cost(setup: Setup, micro: int, checkpointed: int, per_rank_sequences: int, max_length: int) -> float:
    """Relative time of one optimizer step, in tokens of compute: the step's tokens, times 1 + the share a
    recomputed layer adds, plus the fixed cost of each micro step (module doc, 'Which plan is fastest')."""
    layers = max(1, setup.shape.n_layers)
    micro_steps = math.ceil(per_rank_sequences / micro)
    recompute = RECOMPUTED_SHARE.get(setup.method, 0.5) * checkpointed / layers
    stage = setup.zero_stage if setup.world_size > 1 or setup.zero_stage == 3 else 0
    return per_rank_sequences * max_length * (1 + recompute) + micro_steps * MICRO_STEP_TOKENS.get(stage, 0)


def plan(
    setup: Setup,
    *,
    free_bytes: float,
    max_length: int,
    per_rank_sequences: int,
    micro: int | str = "auto",
    checkpointing: bool | str = "auto",
) -> MemoryPlan:
    """The micro batch (``micro`` auto) and checkpointed layers (``checkpointing`` auto) of the fastest step
    that fits (:func:`step_cost`): under DDP the largest micro batch that fits without recomputation, else
    one sequence on the fewest checkpointed layers; under ZeRO a larger micro batch on recomputed layers
    where fewer micro steps save more than the recomputation costs. Explicit values are kept."""
    budget, layers = budget_bytes(free_bytes, exact_bytes(setup)), setup.shape.n_layers

    def total(n: int, k: int) -> float:
        return estimate(setup, n * max_length, k).total

    if micro == "auto":
        n, micro_why = _auto_micro(setup, budget, max_length, per_rank_sequences, checkpointing, total)
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


def _fewest_checkpointed(setting, layers: int, budget: float, total) -> int | None:
    """The fewest checkpointed layers with which ``total(k)`` fits (``setting`` true: all, false: none);
    None when nothing allowed fits. ``total`` does not grow with k from k = 1 on (binary search)."""
    if setting is True:
        return layers if total(layers) <= budget else None
    if total(0) <= budget:
        return 0
    if setting is False or total(layers) > budget:
        return None
    low, high = 1, layers
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if total(mid) <= budget else (mid + 1, high)
    return low


def _auto_micro(setup: Setup, budget: float, max_length: int, per_rank: int, checkpointing, total) -> tuple[int, str]:
    """(micro batch, why): the equal-sized micro batch whose fitting plan has the lowest step cost."""
    layers = setup.shape.n_layers
    sizes = sorted({math.ceil(per_rank / math.ceil(per_rank / n)) for n in range(1, per_rank + 1)})
    fitting = {}
    for n in sizes:
        k = _fewest_checkpointed(checkpointing, layers, budget, lambda k, n=n: total(n, k))
        if k is not None:
            fitting[n] = k
    if not fitting:
        return 1, f"auto: 1 sequence (even one of {max_length} tokens does not fit without recomputation)"
    cost = {n: step_cost(setup, n, k, per_rank, max_length) for n, k in fitting.items()}
    n = min(fitting, key=lambda m: (cost[m], -m))
    accum, k = math.ceil(per_rank / n), fitting[n]
    no_recompute = [m for m, km in fitting.items() if km == (layers if checkpointing is True else 0)]
    if k and checkpointing == "auto" and not no_recompute and n == 1:
        return 1, f"auto: 1 sequence (even one of {max_length} tokens does not fit without recomputation)"
    if k and checkpointing == "auto":
        plain = max(no_recompute, default=None)
        instead = f"; {plain} without recomputation" if plain else ""
        return n, (
            f"auto: {n} x {max_length} tokens on {k} recomputed layers, the fastest plan that fits ({accum} micro "
            f"step(s){instead})"
        )
    if n == per_rank:
        return n, f"auto: the step's {n} sequence(s) per rank in one forward fit"
    return n, f"auto: {n} x {max_length} tokens, the most that fit ({accum} micro steps)"


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
