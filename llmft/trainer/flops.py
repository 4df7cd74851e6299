"""FLOPs per training step, for tokens/s -> MFU.

The count is the one the benchmark and the trainer's step
logs share, so their MFU figures agree by construction:

- N is the number of matmul parameters of the decoder: q, k, v, o, gate, up,
  down of every layer plus ``lm_head`` (counted even when it is tied to the
  embedding; the embedding lookup itself is not a matmul).
- Full fine-tuning: 6 N per token (forward 2N, backward 2N for activation
  gradients + 2N for weight gradients).
- LoRA: 4 N per token (the frozen weights get no weight gradient) plus the
  adapters' own work: for an adapter of rank r on a ``d_in -> d_out`` linear,
  2 r (d_in + d_out) forward, as much again for its activation gradient and
  again for its weight gradients: 6 r (d_in + d_out) per token.
- Causal attention per document (never across documents of a packed row): a
  document of L tokens does L (L + 1) / 2 query-key pairs per head in each of
  its two products (QK^T and AV), 2 FLOPs per multiply-add, head_dim long:
  2 L (L + 1) head_dim heads per layer forward; backward is twice that, for
  both methods (attention has no weights, so LoRA saves nothing there).
- Recomputation (gradient checkpointing) is never counted: MFU is model FLOPs.
- Mixture of experts: an MoE layer's N counts the router (E x hidden) and the top-k
  experts each token runs, not all E (MFU over active parameters); an expert adapter's work
  counts top-k times too.

``peak_flops`` gives the dense bf16 datasheet peak used as MFU's denominator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Dense bf16 tensor-core peaks (datasheet, no sparsity), FLOP/s.
PEAK_BF16_FLOPS = {
    "H100": 989.4e12,
    "H200": 989.4e12,
    "H800": 989.4e12,
    "GH200": 989.4e12,
    "A100": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its FLOPs depend on."""

    n_layers: int
    """Number of decoder layers."""
    hidden: int
    """Model width (hidden size)."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key/value heads per layer (grouped-query attention when < n_heads)."""
    head_dim: int
    """Width of one attention head."""
    intermediate: int
    """Width of the gated MLP (gate/up output, down input)."""
    vocab: int
    """Vocabulary size (rows of lm_head)."""
    # --- mixture of experts: 0 for dense models
    n_experts: int = 0
    """Routed experts per MoE layer."""
    experts_per_token: int = 0
    """Experts each token runs (top-k)."""
    moe_intermediate: int = 0
    """Width of one expert's gated MLP."""
    moe_layers: int = 0
    """Layers whose MLP is the sparse MoE block; the other layers have the dense ``intermediate`` MLP."""

    def moe_shapes(self) -> dict[str, tuple[int, int, int]]:
        """(d_in, d_out, times per token) of the matmuls of one MoE layer: the attention projections,
        the router (E x hidden) and the fused expert tensors, each run by top-k experts per token."""
        shapes = {n: (*io, 1) for n, io in self.linear_shapes().items() if n in ALL_LINEAR[:4]}
        shapes["router"] = (self.hidden, self.n_experts, 1)
        shapes["experts.gate_up_proj"] = (self.hidden, 2 * self.moe_intermediate, self.experts_per_token)
        shapes["experts.down_proj"] = (self.moe_intermediate, self.hidden, self.experts_per_token)
        return shapes

    def layer_groups(self) -> list[tuple[int, dict[str, tuple[int, int, int]]]]:
        """(number of layers, their matmul shapes) for the dense layers and the MoE layers."""
        dense = {n: (*io, 1) for n, io in self.linear_shapes().items()}
        groups = [(self.n_layers - self.moe_layers, dense), (self.moe_layers, self.moe_shapes())]
        return [(layers, shapes) for layers, shapes in groups if layers]

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every linear of one decoder layer, by module name."""
        q_out = self.n_heads * self.head_dim
        kv_out = self.n_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q_out),
            "k_proj": (self.hidden, kv_out),
            "v_proj": (self.hidden, kv_out),
            "o_proj": (q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }


def shape_from_config(config) -> ModelShape:
    """Read a ``ModelShape`` from a Hugging Face (Llama/Qwen2-style) config object or dict."""
    get: Callable[..., Any] = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    n_heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    return ModelShape(
        n_layers=int(get("num_hidden_layers")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(get("num_key_value_heads") or n_heads),
        head_dim=int(get("head_dim") or hidden // n_heads),
        intermediate=int(get("intermediate_size")),
        vocab=int(get("vocab_size")),
        **_moe_fields(get),
    )


def _moe_fields(get) -> dict:
    """MoE sizes of a Qwen3-MoE / Qwen2-MoE / Mixtral-style config (num_experts or num_local_experts)."""
    experts = int(get("num_experts", 0) or get("num_local_experts", 0) or 0)
    if not experts:
        return {}
    layers, step, dense = int(get("num_hidden_layers")), int(get("decoder_sparse_step", 1) or 1), get("mlp_only_layers")
    return {
        "n_experts": experts,
        "experts_per_token": int(get("num_experts_per_tok")),
        "moe_intermediate": int(get("moe_intermediate_size", 0) or get("intermediate_size")),
        "moe_layers": sum(1 for i in range(layers) if i not in (dense or ()) and (i + 1) % step == 0),
    }


def matmul_params(shape: ModelShape) -> int:
    """N: weights of every matmul of the decoder plus lm_head (MoE layers: the weights one token
    uses, i.e. the router and top-k experts: MFU over active parameters)."""
    per_layers = sum(layers * sum(i * o * k for i, o, k in ls.values()) for layers, ls in shape.layer_groups())
    return per_layers + shape.vocab * shape.hidden


# LoRA target names as the trainer finds them in adapter parameter names: PEFT's
# ParamWrappers sit at `experts` (outer) and `experts.base_layer` (inner) when both tensors are adapted.
_EXPERT_ALIASES = {"experts": ("experts.gate_up_proj", "experts.down_proj"), "base_layer": ()}


def lora_adapter_flops_per_token(shape: ModelShape, rank: int, targets: Iterable[str] = ALL_LINEAR) -> int:
    """Forward + backward FLOPs of the LoRA adapters for one token: 6 r (d_in + d_out) each (an
    expert adapter: times the experts a token runs). ``ALL_LINEAR`` (all-linear) on an MoE layer
    means its attention projections, as trainer.moe_model resolves it."""
    targets = set(targets)
    known = {name for _, shapes in shape.layer_groups() for name in shapes} | set(_EXPERT_ALIASES)
    unknown = sorted(targets - known - (set(ALL_LINEAR) if targets == set(ALL_LINEAR) else set()))
    if unknown:
        raise ValueError(f"unknown LoRA target module(s) {unknown}; known: {sorted(known)}")
    names = {n for t in targets for n in _EXPERT_ALIASES.get(t, (t,))}
    return sum(
        layers * sum(6 * rank * (i + o) * k for name, (i, o, k) in shapes.items() if name in names)
        for layers, shapes in shape.layer_groups()
    )


def attention_flops(shape: ModelShape, doc_lengths: Iterable[int]) -> float:
    """Forward + backward FLOPs of causal attention over documents of the given lengths."""
    pairs = sum(int(n) * (int(n) + 1) for n in doc_lengths)  # 2 * (L(L+1)/2) per document
    forward = 2 * pairs * shape.head_dim * shape.n_heads * shape.n_layers
    return 3.0 * forward


def dense_flops_per_token(
    shape: ModelShape, method: str, lora_rank: int = 16, lora_targets: Iterable[str] = ALL_LINEAR
) -> float:
    """Matmul FLOPs per token (no attention): 6N for full, 4N + adapters for LoRA/QLoRA."""
    n = matmul_params(shape)
    if method == "full":
        return 6.0 * n
    if method in ("lora", "qlora", "dora"):
        return 4.0 * n + lora_adapter_flops_per_token(shape, lora_rank, lora_targets)
    raise ValueError(f"unknown method {method!r}: expected full, lora, qlora or dora")


def step_flops(
    shape: ModelShape,
    method: str,
    doc_lengths: Sequence[int],
    lora_rank: int = 16,
    lora_targets: Iterable[str] = ALL_LINEAR,
) -> float:
    """Model FLOPs of one optimizer step over documents of ``doc_lengths`` (real tokens only)."""
    tokens = sum(int(n) for n in doc_lengths)
    dense = dense_flops_per_token(shape, method, lora_rank, lora_targets) * tokens
    return dense + attention_flops(shape, doc_lengths)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name such as 'NVIDIA H100 80GB HBM3'; None if unknown."""
    name = device_name.upper()
    # Longest key first so 'GH200' wins over 'H200'.
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilization of ``flops`` done in ``seconds`` against ``peak`` FLOP/s."""
    if not peak or seconds <= 0:
        return None
    return flops / seconds / peak
