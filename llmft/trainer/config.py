"""The trainer's configuration schema: a tree of frozen dataclasses.

Every field carries a one-line ``doc`` in its metadata (and the allowed values, if closed);
:func:`iter_fields` exposes them for the generated configuration reference. A field that the
pipeline or the sweep names by a short name declares it here too (``setting=``, ``pipeline=``,
``search=``): :data:`SETTING_NAMES`, the pipeline's trainer settings and the sweep's default
search space are derived from those declarations, so a knob is declared once.

Reading a config (YAML files, ``key=value`` overrides, typed checks, diffs) is
:mod:`llmft.trainer.config_load`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

RUN_CONFIG_FILE = "config.yaml"
"""The resolved config the pipeline's plan step writes into the run directory (``llmft train --config``)."""

Auto = typing.Literal["auto"]
"""The value of a setting the trainer decides for itself (kernels.*, gradient checkpointing, micro batch)."""


@dataclass(frozen=True)
class SearchRange:
    """The default search range of a setting the sweep searches (llmft/katib/search_space.py makes it
    a Katib parameter and an Optuna distribution; the fields are its ``HyperParameter``'s)."""

    rank: int
    """Position in the default search space: Katib's ``spec.parameters`` order and Optuna's suggestion
    order (a seeded local sweep samples the same values only in the same order)."""
    type: str
    """Katib parameterType: double, int (ranges) or discrete, categorical (lists)."""
    min: str | None = None
    max: str | None = None
    step: str | None = None
    distribution: str | None = None
    values: tuple[str, ...] = ()
    grid: tuple[str, ...] = ()
    """Finite values the grid algorithm enumerates."""
    description: str = ""


@dataclass(frozen=True)
class Setting:
    """A field's short name, declared on the field: the name the pipeline's parameter (``pipeline``)
    and the sweep's searched parameter (``search``) give it (``lora_r`` is ``lora.r``)."""

    name: str
    """Lower snake case: a Python parameter name and a Katib parameter name."""
    pipeline: str = ""
    """The pipeline parameter that sets the field ('' = none): its name, declared once, here (the pipeline's
    declaration of it, with its description and forms: llmft/components/lib/plan/parameters.py)."""
    search: SearchRange | None = None
    """The field's range in the sweep's default search space, if it is searched by default."""


def _f(default: Any, doc: str, choices: tuple | None = None, setting: Setting | None = None):
    """A dataclass field with its reference doc (and the allowed values, if closed, and the short
    name the pipeline and the sweep know it by, if any)."""
    meta = {"doc": doc, "choices": choices, "setting": setting}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = _f(
        "",
        "Hugging Face hub id or local directory of the base model (offline flags honoured).",
        setting=Setting("model", pipeline="base_model"),
    )
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) to load; null for the default branch.")
    dtype: str = _f(
        "auto",
        "Weight/compute dtype; auto = bfloat16 on CUDA, float32 on CPU.",
        ("auto", "bfloat16", "float16", "float32"),
    )
    attn_implementation: str = _f(
        "auto",
        "Attention kernel; auto = llmft_varlen (per-document FlashAttention varlen over packed rows) on CUDA where "
        "the model allows it, else sdpa; or sdpa, eager, flash_attention_2, flex_attention, llmft_varlen.",
    )
    gradient_checkpointing: Auto | bool = _f(
        "auto",
        "Recompute activations in backward (non-reentrant); auto = only when the micro batch would not fit the "
        "GPU otherwise, on as few decoder layers as that needs; under DeepSpeed ZeRO also where a larger micro "
        "batch on recomputed layers makes the step faster (fewer weight gathers) (trainer.sizing.memory; off on CPU).",
    )
    trust_remote_code: bool = _f(False, "Allow model code from the hub repository to run (off unless you trust it).")


@dataclass(frozen=True)
class LoraConfig:
    r: int = _f(
        16,
        "LoRA rank.",
        setting=Setting(
            "lora_r",
            pipeline="finetune_lora_r",
            search=SearchRange(
                2, "discrete", values=("8", "16", "32", "64"), grid=("8", "16", "32"), description="LoRA rank"
            ),
        ),
    )
    alpha: float = _f(
        32.0,
        "LoRA scaling numerator (scale = alpha / r).",
        setting=Setting(
            "lora_alpha",
            pipeline="finetune_lora_alpha",
            search=SearchRange(
                3,
                "discrete",
                values=("16", "32", "64"),
                grid=("16", "32", "64"),
                description="LoRA alpha (scaling = alpha / r)",
            ),
        ),
    )
    dropout: float = _f(
        0.05,
        "Dropout on the LoRA input, in [0, 1).",
        setting=Setting(
            "lora_dropout",
            pipeline="finetune_lora_dropout",
            search=SearchRange(
                4,
                "double",
                min="0.0",
                max="0.1",
                distribution="uniform",
                grid=("0.0", "0.05", "0.1"),
                description="LoRA dropout",
            ),
        ),
    )
    target_modules: tuple[str, ...] = _f(
        ("all-linear",),
        "Modules to adapt; all-linear = every linear layer of the decoder except lm_head. On mixture-of-experts "
        "models all-linear is the attention projections; add `experts` for LoRA on the fused expert weights "
        "(needs dropout 0; vLLM serving: docs/moe.md); the router is never adapted.",
        setting=Setting("lora_target_modules", pipeline="finetune_lora_target_modules"),
    )
    use_dora: bool = _f(
        False, "Weight-decomposed LoRA (DoRA); vLLM cannot serve DoRA adapters as LoRA modules: served merged."
    )


@dataclass(frozen=True)
class QLoraConfig:
    quant_type: str = _f("nf4", "4-bit quantization type of the frozen base weights.", ("nf4", "fp4"))
    double_quant: bool = _f(True, "Quantize the quantization constants too (saves ~0.4 bit/param).")
    quant_storage: str = _f(
        "bfloat16",
        "Storage dtype of packed 4-bit weights; bfloat16 lets DeepSpeed ZeRO-3 shard them.",
        ("uint8", "bfloat16", "float16", "float32"),
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _f(
        2e-4,
        "Peak learning rate.",
        setting=Setting(
            "learning_rate",
            pipeline="finetune_learning_rate",
            search=SearchRange(
                1,
                "double",
                min="1e-05",
                max="0.001",
                distribution="logUniform",
                grid=("5e-05", "0.0001", "0.0002", "0.0005"),
                description="peak learning rate (log scale)",
            ),
        ),
    )
    weight_decay: float = _f(0.0, "Decoupled (AdamW) weight decay.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.999, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    fused: bool = _f(True, "Use torch's fused AdamW (skips a non-finite update on device, no host sync).")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = _f(0, "Linear warmup steps (takes precedence over warmup_ratio when > 0).")
    warmup_ratio: float = _f(
        0.0,
        "Warmup as a fraction of the total steps.",
        setting=Setting(
            "warmup_ratio",
            pipeline="finetune_warmup_ratio",
            search=SearchRange(
                5,
                "double",
                min="0.0",
                max="0.1",
                distribution="uniform",
                grid=("0.0", "0.03", "0.1"),
                description="warmup fraction of the schedule",
            ),
        ),
    )
    decay: str = _f("cosine", "Decay after warmup.", ("cosine", "linear", "constant"))
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak.")


@dataclass(frozen=True)
class BatchConfig:
    global_sequences: int = _f(
        8,
        "Packed sequences per optimizer step over all ranks (0 to use global_tokens).",
        setting=Setting("batch_size", pipeline="finetune_batch_size"),
    )
    global_tokens: int = _f(
        0,
        "Token budget per optimizer step over all ranks; converted to sequences of data max_length (overrides "
        "global_sequences when > 0).",
    )
    micro_sequences: Auto | int = _f(
        "auto",
        "Packed sequences per forward pass on each rank, flattened into one row; accumulation steps are derived. "
        "auto = as many as fit the GPU's free memory, or under DeepSpeed ZeRO the size with the fastest step that "
        "fits (trainer.sizing.memory), 1 on CPU.",
        setting=Setting("micro_batch_size", pipeline="finetune_micro_batch_size"),
    )


@dataclass(frozen=True)
class DistributedConfig:
    backend: str = _f("ddp", "Data-parallel engine.", ("ddp", "deepspeed"))
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage when backend=deepspeed.", (1, 2, 3))
    comm_backend: str = _f(
        "auto", "torch.distributed backend; auto = nccl on CUDA, gloo on CPU.", ("auto", "nccl", "gloo")
    )
    timeout_s: int = _f(1800, "Collective timeout in seconds.")
    bucket_cap_mb: int = _f(
        100, "DDP gradient bucket size in MiB (fewer, larger all-reduces overlapped with backward)."
    )
    grad_reduce_dtype: str = _f(
        "fp32",
        "DDP gradient all-reduce dtype; bf16 halves the bytes (full fine-tuning), fp32 is exact.",
        ("fp32", "bf16"),
    )


@dataclass(frozen=True)
class EvalConfig:
    split: str = _f("val", "Split of the tokenized dataset used for evaluation.")
    micro_sequences: int = _f(4, "Packed sequences per evaluation forward pass on each rank.")
    max_sequences: int = _f(0, "Evaluate at most this many sequences (0 = the whole split).")


@dataclass(frozen=True)
class ObserveConfig:
    progress_bar: bool = _f(
        True,
        "A tqdm progress bar on rank 0 when stderr is a terminal; elsewhere (a pod's log, kfp.local, a pipe), or "
        "with false, plain `progress:` lines instead (step/total, percent, tokens/s, loss, elapsed, ETA; at most one "
        "per 10 s).",
    )
    tensorboard: bool = _f(True, "Write TensorBoard event files under output_dir/tensorboard.")
    mlflow_experiment: str = _f(
        "",
        "MLflow experiment name (else env MLFLOW_EXPERIMENT_NAME, else llmft); used only when MLFLOW_TRACKING_URI "
        "is set.",
        setting=Setting("mlflow_experiment", pipeline="mlflow_experiment"),
    )
    run_name: str = _f("", "Run name for MLflow and Langfuse (default: the output_dir name).")
    peak_tflops: float = _f(0.0, "Peak dense bf16 TFLOP/s per GPU for MFU; 0 = detect (H100/H200 989).")


@dataclass(frozen=True)
class KernelsConfig:
    fused_loss: Auto | bool = _f(
        "auto",
        "Fused linear cross-entropy over the supervised tokens only (no full logits); auto = on on CUDA (under "
        "DeepSpeed ZeRO-3 too, gathering lm_head), off on CPU.",
    )
    compile: Auto | bool = _f(
        "auto", "torch.compile the decoder layers in place; auto = on on CUDA except under DeepSpeed ZeRO-3."
    )
    fused_lora: Auto | bool = _f(
        "auto",
        "PEFT's LoRA linears run as one fused node each (exact, LoRA dropout included; QLoRA's 4-bit bases are "
        "dequantized inside it, in bf16); auto = on on CUDA for every LoRA linear with a plain nn.Linear or "
        "bitsandbytes 4-bit base (not DoRA or ZeRO-3 partitioned ones).",
    )
    grouped_lora: Auto | bool = _f(
        "auto",
        "q/k/v and gate/up projections (same input) run as one fused matmul each, fewer kernel launches (exact); "
        "auto = wherever fused_lora is on.",
    )
    compile_cache_dir: str = _f(
        "",
        "Folder for torch.compile's on-disk cache (e.g. on the PVC) so a restarted or resumed job compiles warm; "
        "empty = PyTorch's default under /tmp.",
    )


@dataclass(frozen=True)
class DebugConfig:
    nan_steps: tuple[int, ...] = _f((), "Test hook: make the loss NaN at these steps.")
    nan_rank: int = _f(-1, "Test hook: the rank whose loss nan_steps poisons (-1 = every rank).")
    kill_at_step: int = _f(0, "Test hook: SIGKILL this process right after this step's update (0 = never).")
    sigterm_at_step: int = _f(0, "Test hook: send SIGTERM to this process in the middle of this step (0 = never).")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = _f(ModelConfig(), "Base model.")
    data: str = _f("", "Tokenized dataset directory written by `llmft data tokenize`.")
    output_dir: str = _f("runs/train", "Run directory: checkpoints/, final/, metrics.jsonl, tensorboard/.")
    method: str = _f(
        "lora", "Fine-tuning method.", ("lora", "qlora", "full"), Setting("method", pipeline="finetune_method")
    )
    lora: LoraConfig = _f(LoraConfig(), "LoRA adapter (methods lora and qlora).")
    qlora: QLoraConfig = _f(QLoraConfig(), "4-bit base-model quantization (method qlora, CUDA only).")
    optim: OptimConfig = _f(OptimConfig(), "Optimizer and gradient clipping.")
    schedule: ScheduleConfig = _f(ScheduleConfig(), "Learning-rate schedule.")
    batch: BatchConfig = _f(BatchConfig(), "Global and micro batch; independent of the number of ranks.")
    distributed: DistributedConfig = _f(DistributedConfig(), "Data-parallel engine.")
    eval: EvalConfig = _f(EvalConfig(), "Evaluation on the validation split.")
    observe: ObserveConfig = _f(ObserveConfig(), "Progress, TensorBoard, MLflow and Langfuse.")
    kernels: KernelsConfig = _f(KernelsConfig(), "Speed options implemented in trainer.fastpath.")
    debug: DebugConfig = _f(DebugConfig(), "Fault-injection hooks for tests; leave at defaults.")
    max_steps: int = _f(
        0,
        "Optimizer steps to run; 0 = epochs x steps per epoch.",
        setting=Setting("max_steps", pipeline="finetune_max_steps"),
    )
    epochs: float = _f(
        1.0,
        "Passes over the training split when max_steps is 0.",
        setting=Setting("epochs", pipeline="finetune_epochs"),
    )
    eval_every: float = _f(
        0.1,
        "Evaluate every N steps (a whole N >= 1), or at every fraction f of the run (0 < f < 1: 0.1 = ten "
        "evaluations, the curve of eval perplexity by step); 0 = only at the end.",
        setting=Setting("eval_every", pipeline="finetune_eval_every"),
    )
    save_every: float = _f(
        0.25,
        "Checkpoint every N steps (a whole N >= 1), or at every fraction f of the run (0 < f < 1: 0.25 = four "
        "checkpoints, so a crash without SIGTERM loses at most a quarter); 0 = only at the end.",
        setting=Setting("save_every", pipeline="finetune_save_every"),
    )
    log_every: int = _f(10, "Log loss, learning rate, grad norm, tokens/s every N steps.")
    seed: int = _f(42, "Seed of data order, LoRA init and dropout.", setting=Setting("seed", pipeline="finetune_seed"))
    keep_last: int = _f(2, "Complete checkpoints kept besides the best one.")
    resume: str = _f(
        "auto", "auto = newest complete checkpoint in output_dir, never = start fresh, or a checkpoint path."
    )
    force_resume: bool = _f(False, "Resume even when the checkpoint's config or dataset differs.")
    gc_every: int = _f(
        50,
        "Run Python's garbage collector every N steps instead of at random points (an automatic collection can "
        "stall a step); 0 = automatic.",
    )
    max_bad_steps: int = _f(
        3,
        "Stop with exit 1 after this many consecutive non-finite steps (each update is skipped at once; the stop "
        "comes at the next log step).",
    )
    force_output_dir: bool = _f(
        False,
        "Use an output_dir that is not empty and not marked as an llmft training run (another program's folder); "
        "without it such a directory is refused, so nothing of it is pruned or overwritten.",
    )
    wait_for_output_dir: bool = _f(
        False,
        "When another run holds output_dir (its lock file .llmft-run.lock), wait for it to end instead of exiting 1 "
        "(`llmft train --wait`).",
    )
    max_restarts_without_progress: int = _f(
        3,
        "Exit 1 when the run starts this many times more after dying (OOM kill, NCCL abort, crash, preemption) "
        "without committing a new checkpoint in between; counted in output_dir/restarts.json. 0 = no limit.",
    )


def every_steps(every: float, total_steps: int) -> int:
    """Steps between two evaluations or checkpoints: ``every`` itself when it is a whole N >= 1, a fraction of
    ``total_steps`` (rounded, at least 1) when 0 < every < 1; 0 (only at the end) for 0."""
    if every <= 0:
        return 0
    return int(every) if every >= 1 else max(1, round(every * total_steps))


def hints_of(cls) -> dict[str, Any]:
    """The resolved type annotations of a config dataclass (the schema is written with postponed annotations)."""
    return typing.get_type_hints(cls)


def iter_fields(cls=TrainConfig, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted_name, type_name, default, doc) for every leaf field, in declaration order."""
    hints = hints_of(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, name + ".")
            continue
        default = f.default
        doc = f.metadata["doc"]
        if f.metadata.get("choices"):
            doc += " One of: " + ", ".join(map(str, f.metadata["choices"])) + "."
        yield name, _type_name(tp), default, doc + _setting_note(f.metadata.get("setting"))


def _setting_note(setting: Setting | None) -> str:
    """What the reference says of a field's short name: the pipeline parameter, the default search."""
    if setting is None:
        return ""
    note = f" Pipeline parameter `{setting.name}`." if setting.pipeline else ""
    if setting.search is not None:
        note += f" Searched by the sweep's default space as `{setting.name}`."
    return note


def iter_sections(cls=TrainConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield (dotted_section_name, doc) for every nested section, in declaration order."""
    hints = hints_of(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield prefix + f.name, f.metadata["doc"]
            yield from iter_sections(hints[f.name], prefix + f.name + ".")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else tp.__name__


def iter_settings(cls=TrainConfig, prefix: str = "") -> Iterator[tuple[str, Setting]]:
    """Yield (dotted trainer key, :class:`Setting`) for every leaf field that declares a short name,
    in declaration order."""
    hints = hints_of(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_settings(hints[f.name], prefix + f.name + ".")
        elif f.metadata.get("setting") is not None:
            yield prefix + f.name, f.metadata["setting"]


SETTING_NAMES: dict[str, str] = {setting.name: key for key, setting in iter_settings()}
"""Short name -> trainer key of every field that declares a :class:`Setting`: the names the sweep's default
search space (llmft/katib/search_space.py, those with a ``search`` range) gives trainer keys (``lora_r`` is
``lora.r``); the pipeline parameter that sets a field is the Setting's ``pipeline`` name
(llmft/components/lib/plan/build.py TRAINER_PARAMETERS). Short names are Python and Katib parameter names;
trainer keys are what config.yaml and overrides use. Derived, never listed: a knob is declared once, on its
field."""
