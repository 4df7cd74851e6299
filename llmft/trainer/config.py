"""The trainer's configuration: a tree of frozen dataclasses.

A YAML file maps 1:1 onto the tree; ``key=value`` overrides address nested
fields with dots (``lora.r=16``). Unknown keys and wrongly typed values raise
:class:`~trainer.errors.ConfigError` naming the file, line and key. Every field
carries a one-line ``doc`` in its metadata; :func:`iter_fields` exposes them for
the generated configuration reference.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmft.trainer.config_checks import validate
from llmft.trainer.errors import ConfigError
from llmft.trainer.yaml_limits import check_yaml_shape, compose_user_yaml, read_yaml_text

RUN_CONFIG_FILE = "config.yaml"
"""The resolved config the pipeline's plan step writes into the run directory (``llmft train --config``)."""

Auto = typing.Literal["auto"]
"""The value of a setting the trainer decides for itself (kernels.*, gradient checkpointing, micro batch)."""


def _f(default: Any, doc: str, choices: tuple | None = None):
    """A dataclass field with its reference doc (and the allowed values, if closed)."""
    meta = {"doc": doc, "choices": choices}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = _f("", "Hugging Face hub id or local directory of the base model (offline flags honoured).")
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
    r: int = _f(16, "LoRA rank.")
    alpha: float = _f(32.0, "LoRA scaling numerator (scale = alpha / r).")
    dropout: float = _f(0.05, "Dropout on the LoRA input, in [0, 1).")
    target_modules: tuple[str, ...] = _f(
        ("all-linear",),
        "Modules to adapt; all-linear = every linear layer of the decoder except lm_head. On mixture-of-experts "
        "models all-linear is the attention projections; add `experts` for LoRA on the fused expert weights "
        "(needs dropout 0; vLLM serving: docs/moe.md); the router is never adapted.",
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
    lr: float = _f(2e-4, "Peak learning rate.")
    weight_decay: float = _f(0.0, "Decoupled (AdamW) weight decay.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.999, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    fused: bool = _f(True, "Use torch's fused AdamW (skips a non-finite update on device, no host sync).")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = _f(0, "Linear warmup steps (takes precedence over warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.")
    decay: str = _f("cosine", "Decay after warmup.", ("cosine", "linear", "constant"))
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak.")


@dataclass(frozen=True)
class BatchConfig:
    global_sequences: int = _f(8, "Packed sequences per optimizer step over all ranks (0 to use global_tokens).")
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
    progress_bar: bool = _f(True, "Show a progress bar on rank 0 (stderr).")
    tensorboard: bool = _f(True, "Write TensorBoard event files under output_dir/tensorboard.")
    mlflow_experiment: str = _f(
        "",
        "MLflow experiment name (else env MLFLOW_EXPERIMENT_NAME, else llmft); used only when MLFLOW_TRACKING_URI "
        "is set.",
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
    method: str = _f("lora", "Fine-tuning method.", ("lora", "qlora", "full"))
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
    max_steps: int = _f(0, "Optimizer steps to run; 0 = epochs x steps per epoch.")
    epochs: float = _f(1.0, "Passes over the training split when max_steps is 0.")
    eval_every: int = _f(0, "Evaluate every N steps (0 = only at the end).")
    save_every: int = _f(0, "Checkpoint every N steps (0 = only at the end).")
    log_every: int = _f(10, "Log loss, learning rate, grad norm, tokens/s every N steps.")
    seed: int = _f(42, "Seed of data order, LoRA init and dropout.")
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


SETTING_NAMES: dict[str, str] = {
    "model": "model.name_or_path",
    "method": "method",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "learning_rate": "optim.lr",
    "warmup_ratio": "schedule.warmup_ratio",
    "seed": "seed",
    "max_steps": "max_steps",
    "epochs": "epochs",
    "mlflow_experiment": "observe.mlflow_experiment",
}
"""Short name -> trainer key of the settings that the pipeline's parameters (llmft/components/lib/plan/build.py) and the
sweep's searched parameters (llmft/katib/search_space.py) name: the one place a knob's two names meet (``lora_r`` is
``lora.r``). Short names are Python and Katib parameter names; trainer keys are what config.yaml and overrides use."""

# Fields whose change does not alter the training math: allowed on resume.
RESUME_SAFE_PREFIXES = (
    "output_dir",
    "data",
    "eval_every",
    "save_every",
    "log_every",
    "keep_last",
    "resume",
    "force_resume",
    "max_bad_steps",
    "force_output_dir",
    "wait_for_output_dir",
    "max_restarts_without_progress",
    "gc_every",
    "observe.",
    "eval.",
    "debug.",
    "distributed.",
    "batch.micro_sequences",
    "kernels.",
    "model.attn_implementation",
    "model.gradient_checkpointing",
)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_fields(cls=TrainConfig, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted_name, type_name, default, doc) for every leaf field, in declaration order."""
    hints = _hints(cls)
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
        yield name, _type_name(tp), default, doc


def iter_sections(cls=TrainConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield (dotted_section_name, doc) for every nested section, in declaration order."""
    hints = _hints(cls)
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


# ----------------------------------------------------------------------------- loading


class _Source:
    """Where a value came from, for error messages (file + line, or the override)."""

    def __init__(self, path: str | None):
        self.path = path or "<defaults>"
        self.lines: dict[str, int] = {}
        self.overridden: set[str] = set()
        self.names: dict[str, str] = {}  # key -> where a program took it from (e.g. a pipeline parameter)
        self.override_label = "override"  # what the key=value items are called (e.g. train_overrides)

    def where(self, key: str) -> str:
        if key in self.overridden:
            return f"{self.override_label} `{key}=...`"
        if key in self.lines:
            return f"{self.path}, line {self.lines[key]}"
        return self.names.get(key, self.path)


def _compose_yaml(path: Path, source: _Source) -> dict:
    node = compose_user_yaml(read_yaml_text(path), str(path))  # bounded: size, depth, aliases expanded
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}, line {node.start_mark.line + 1}: the config must be a mapping of keys to values")
    return _node_to_dict(node, "", source)


PLAIN_TAGS = frozenset(
    "tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null", "timestamp", "map", "seq")
)


def _check_plain(node: yaml.Node, source: _Source) -> None:
    """Only plain values, lists and mappings: a tag such as ``!!python/object`` is refused (it
    would construct an object, which a config never needs)."""
    if node.tag not in PLAIN_TAGS:
        raise ConfigError(
            f"{source.path}, line {node.start_mark.line + 1}: YAML tag {node.tag.replace('tag:yaml.org,2002:', '!!')} "
            "is not allowed; a config holds plain values, lists and mappings only"
        )
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_plain(item, source)


def _node_to_dict(node: yaml.MappingNode, prefix: str, source: _Source) -> dict:
    _check_plain(node, source)
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        _check_plain(key_node, source)
        key = prefix + str(key_node.value)
        source.lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            out[str(key_node.value)] = _node_to_dict(value_node, key + ".", source)
        else:
            _check_plain(value_node, source)
            out[str(key_node.value)] = yaml.safe_load(yaml.serialize(value_node))
    return out


BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
"""The words a ``key=value`` boolean may be, everywhere (trainer, pipeline arguments, sweep settings)."""


def split_assignment(text: str, example: str = "lora.r=16") -> tuple[str, str]:
    """``key=value`` -> (key, raw value): the one key=value grammar of llmft (the trainer's overrides,
    the pipeline's arguments, the sweep's settings). The key is stripped; the value is kept as written."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"`{text}`: expected key=value (for example {example})")
    return key.strip(), raw


def parse_bool(raw: str) -> bool:
    """A boolean word of :data:`BOOL_WORDS` (any case); ValueError otherwise."""
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise ValueError(raw) from None


def _apply_override(tree: dict, text: str, source: _Source) -> None:
    try:
        key, raw = split_assignment(text)
    except ConfigError:
        raise ConfigError(f"override `{text}`: expected key=value (for example lora.r=16)") from None
    try:
        check_yaml_shape(raw, f"override `{key}=...`")
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override `{text}`: not a plain YAML value ({' '.join(str(exc).split())})") from None
    node = tree
    parts = key.split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(f"override `{text}`: `{key}` has an empty name between dots; write e.g. lora.r=16")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override `{text}`: `{part}` is not a section")
    node[parts[-1]] = value
    source.overridden.add(key)


def load_config_checked(path: str | None, overrides: list[str] | None = None) -> tuple[TrainConfig, list[str]]:
    """Defaults <- YAML file <- ``key=value`` overrides, type-checked and validated once; the config
    and the warnings to log."""
    source = _Source(path)
    tree = _compose_yaml(Path(path), source) if path else {}
    return _resolve(tree, overrides or [], source)


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """:func:`load_config_checked` without the warnings."""
    return load_config_checked(path, overrides)[0]


def resolve_config(
    settings: dict,
    overrides: typing.Sequence[str] = (),
    *,
    source_name: str = "<settings>",
    names: typing.Mapping[str, str] | None = None,
    override_label: str = "override",
) -> tuple[TrainConfig, list[str]]:
    """Defaults <- ``settings`` (a nested dict of typed values, e.g. ``{"lora": {"r": 16}}``) <-
    ``key=value`` overrides, type-checked and validated once: what a program that holds typed values
    (the pipeline's plan step) builds a config from, with the same checks as a YAML file. ``names``
    (dotted key -> e.g. "pipeline parameter `lora_r`") and ``override_label`` (e.g. "train_overrides")
    say where a bad value came from."""
    source = _Source(source_name)
    source.names, source.override_label = dict(names or {}), override_label
    return _resolve(_deep_copy(settings), list(overrides), source)


def _deep_copy(tree: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _resolve(tree: dict, overrides: list[str], source: _Source) -> tuple[TrainConfig, list[str]]:
    for text in overrides:
        _apply_override(tree, text, source)
    cfg = _build(TrainConfig, tree, "", source)
    return cfg, validate(cfg, source.where)


def config_to_yaml(cfg: TrainConfig) -> str:
    """The whole config as YAML (every field, in declaration order): what ``--print-config`` prints
    and what the plan step writes as ``config.yaml``."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_from_dict(data: dict, source_name: str = "<dict>") -> TrainConfig:
    """Rebuild a config from :func:`config_to_dict` output (e.g. a checkpoint's train_config.json)."""
    return _build(TrainConfig, data, "", _Source(source_name))


def config_to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists), JSON/YAML-serialisable."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = config_to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def _build(cls, data: Any, prefix: str, source: _Source):
    section = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source.where(prefix.rstrip('.'))}: `{section}` must be a mapping")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{source.where(prefix + str(key))}: unknown key `{prefix}{key}` "
                f"(known keys in {section}: {', '.join(sorted(known))})"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], prefix + f.name + ".", source)
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, prefix + f.name, source)
    return cls(**kwargs)


def _coerce(value: Any, tp, key: str, source: _Source) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if isinstance(value, str) and value.strip().lower() in words:
            return value.strip().lower()
        tp = next(a for a in args if a is not type(None) and typing.get_origin(a) is not typing.Literal)
        if words:  # auto | bool, auto | int: the word, or a value of the other type
            try:
                return _coerce(value, tp, key, source)
            except ConfigError:
                raise _type_error(key, value, " or ".join([*words, tp.__name__]), source) from None
    if typing.get_origin(tp) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise _type_error(key, value, "a list", source)
        return tuple(_coerce(v, args[0] if args else str, key, source) for v in value)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str):  # a word YAML does not read as a boolean (e.g. "1" quoted)
                return parse_bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, dict | list):
                raise ValueError
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        raise _type_error(key, value, tp.__name__, source) from None
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _type_error(key: str, value: Any, expected: str, source: _Source) -> ConfigError:
    return ConfigError(f"{source.where(key)}: `{key}` must be {expected}, got {value!r}")


def diff_configs(old: dict, new: dict, *, ignore_prefixes: tuple[str, ...] = RESUME_SAFE_PREFIXES) -> list[str]:
    """Lines `key: old -> new` for every leaf that differs and is not resume-safe."""
    lines = []
    flat_old, flat_new = flatten_dict(old), flatten_dict(new)
    for key in sorted(set(flat_old) | set(flat_new)):
        if any(key == p or key.startswith(p if p.endswith(".") else p + ".") for p in ignore_prefixes):
            continue
        a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if a != b:
            lines.append(f"{key}: {a!r} -> {b!r}")
    return lines


def changed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """Dotted key -> value of every leaf that differs from the defaults (what a command line without
    the config file must carry to rebuild ``cfg``)."""
    default = flatten_dict(config_to_dict(TrainConfig()))
    return {k: v for k, v in flatten_dict(config_to_dict(cfg)).items() if default.get(k) != v}


def flatten_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"lora": {"r": 8}} -> {"lora.r": 8}: the dotted names `key=value` overrides use."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_dict(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def nest_dotted(flat: typing.Mapping[str, Any]) -> dict:
    """{"lora.r": 8} -> {"lora": {"r": 8}}: the inverse of :func:`flatten_dict`."""
    tree: dict = {}
    for dotted, value in flat.items():
        *sections, leaf = dotted.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return tree
