"""Merge a PEFT LoRA / DoRA adapter into its base checkpoint, streaming shard by shard.

The model is never instantiated: :class:`BaseCheckpoint` reads the base's safetensors (through
``model.safetensors.index.json`` when sharded) one file at a time with ``safe_open``, each tensor
is dequantized if it is stored in FP8 (llmft/trainer/fp8_format.py), merged if the adapter targets it, cast to
the output dtype and appended to its output shard (files of at most ``max_shard_bytes``, planned
from the input headers). Peak memory: one tensor with its float32 merge temporaries, plus the adapter.

The arithmetic follows PEFT 0.21 (``peft/tuners/lora``), in float32:

* LoRA (``layer.py`` ``Linear.get_delta_weight``, line 1067):
  ``delta = transpose(B @ A, fan_in_fan_out) * scaling``, ``W' = W + delta``;
  ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (``update_layer``,
  lines 278-281); ``r`` and ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern``
  (``model.py`` lines 309-312, ``peft.utils.other.get_pattern_key``). ``lora_bias``:
  ``b' = b + B.bias * scaling`` (``Linear.merge``).
* LoRA on an embedding (``Embedding.get_delta_weight``, line 1417): ``delta = (B @ A).T * scaling``.
* DoRA (``variants.py`` ``DoraLinearVariant.merge_unsafe``, lines 197-216, with
  ``dora.py`` ``DoraLinearLayer.get_weight_norm``): ``norm = ||transpose(W, fifo) + transpose(delta, fifo)||``
  over dim 1 (one value per output feature), ``W' = transpose((m / norm).view(-1, 1), fifo) * (W + delta)``.

Module names: PEFT saves ``base_model.model.<module path>.lora_A.weight``; ``<module path>.weight``
is the base checkpoint's tensor. A checkpoint whose tensor names differ from the model's module
names (transformers' load-time renames, e.g. per-expert MoE weights fused into one parameter) is
refused with the names that did not match. Output files are written tensor by tensor
(llmft/trainer/weights_io.py): memory holds one tensor (and its merge temporaries) plus the adapter.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llmft.trainer.errors import ConfigError
from llmft.trainer.fp8_format import (
    FP8_DTYPES,
    QuantFormat,
    dequantize_stored,
    is_side_tensor,
    quant_format,
    read_model_config,
    scale_name_for,
)
from llmft.trainer.io import atomic_directory, share_files
from llmft.trainer.safe_files import check_file, copy_file, present, read_text
from llmft.trainer.storage import disk_guard
from llmft.trainer.weights_io import DTYPES, INDEX_FILE, Entry, ShardStream, plan_shards, read_header

ADAPTER_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?P<param>weight|bias))?$"
)
UNMERGEABLE = (
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "arrow_config",
    "use_bdlora",
    "alora_invocation_tokens",
    "velora_config",
    "monteclora_config",
    "kasa_config",
    "use_qalora",
    "megatron_config",
)
"""adapter_config.json fields whose variants this merge does not implement (refused when set)."""


# ----------------------------------------------------------------------------- the base checkpoint


@dataclass
class BaseCheckpoint:
    """A Hugging Face model directory's safetensors, read one file at a time."""

    directory: Path
    config: dict
    files: list[str]
    """Weight files in index order."""
    fmt: QuantFormat
    opener: Callable | None = field(default=None, repr=False)
    """None = ``safe_open`` (looked up at each open, so a test may wrap it to count open files)."""

    @classmethod
    def open(cls, name_or_path: str, revision: str | None = None) -> BaseCheckpoint:
        directory = local_model_dir(name_or_path, revision)
        config = read_model_config(directory)
        return cls(directory, config, weight_files(directory), quant_format(config))

    def header(self, file: str) -> dict[str, dict]:
        """The entries of one weight file (its JSON header; no tensor is read)."""
        return read_header(self.directory / file)

    def tensors(self, *, dequantize_fp8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) over every file; with ``dequantize_fp8`` FP8 weights come back float32
        and their scales are left out. Only one file is open at any time."""
        for file in self.files:
            names = list(self.header(file))  # in storage order: the file is read front to back
            present = set(names)
            with (self.opener or safe_open)(str(self.directory / file), framework="pt") as handle:
                for name in names:
                    if dequantize_fp8 and is_side_tensor(name):
                        continue
                    tensor = handle.get_tensor(name)
                    scale = scale_name_for(name, self.fmt) if dequantize_fp8 else None
                    if scale and scale in present:
                        tensor = dequantize_stored(tensor, handle.get_tensor(scale), self.fmt)
                    elif dequantize_fp8 and tensor.dtype in FP8_DTYPES:
                        raise ConfigError(f"{self.directory / file}: {name} is FP8 but has no {scale or 'scale'}")
                    yield name, tensor


def weight_files(directory: Path) -> list[str]:
    """The safetensors files of a model directory, in index order (pickled weights are refused)."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return list(dict.fromkeys(weight_map.values()))
    if (directory / "model.safetensors").is_file():
        return ["model.safetensors"]
    pickled = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (it holds pickled {pickled}: convert them to safetensors)" if pickled else ""
    raise ConfigError(f"{directory}: no model.safetensors or {INDEX_FILE}{hint}")


def local_model_dir(name_or_path: str, revision: str | None = None) -> Path:
    """A local directory as is; a hub id through huggingface_hub's cache (HF_HUB_OFFLINE honoured)."""
    local = Path(name_or_path)
    if local.is_dir():
        return local
    try:
        # heavy: huggingface_hub
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(name_or_path, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.jinja"])
        )
    except Exception as exc:  # noqa: BLE001 - hub errors have many types; the message says which
        raise ConfigError(
            f"base model {name_or_path!r} (revision {revision}): not a local directory and not available from "
            f"the hub cache ({type(exc).__name__}: {exc}); pass --base DIR with the base model's files"
        ) from None


# ----------------------------------------------------------------------------- the adapter


@dataclass
class LoraModule:
    """One adapted module: its factors and how PEFT scales them."""

    name: str
    """Module path in the base model (and base checkpoint), e.g. model.layers.0.self_attn.q_proj."""
    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    embedding: bool = False
    fan_in_fan_out: bool = False
    magnitude: torch.Tensor | None = None
    """DoRA magnitude vector (one value per output feature)."""
    bias: torch.Tensor | None = None
    """lora_B bias (``lora_bias=True``)."""

    def delta(self) -> torch.Tensor:
        """PEFT's get_delta_weight in float32, laid out like the base weight."""
        product = self.B.float() @ self.A.float()
        return _transpose(product, True if self.embedding else self.fan_in_fan_out) * self.scaling

    def merge(self, weight: torch.Tensor) -> torch.Tensor:
        """The merged weight in float32 (``weight`` as stored in the base checkpoint)."""
        base = weight.float()
        delta = self.delta()
        if delta.shape != base.shape:
            raise ConfigError(
                f"adapter module {self.name}: update of shape {tuple(delta.shape)} does not fit the base weight "
                f"{tuple(base.shape)}; the adapter was trained on another base model"
            )
        if self.magnitude is None:
            return base + delta
        combined = _transpose(base, self.fan_in_fan_out) + _transpose(delta, self.fan_in_fan_out)
        norm = torch.linalg.norm(combined, dim=1)
        factor = _transpose((self.magnitude.float() / norm).view(-1, 1), self.fan_in_fan_out)
        return factor * (base + delta)


def _transpose(tensor: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return tensor.T if fan_in_fan_out else tensor


@dataclass
class Adapter:
    """A PEFT LoRA adapter read from its directory (small: held in memory whole)."""

    directory: Path
    config: dict
    modules: dict[str, LoraModule]
    """Keyed by base tensor name (``<module>.weight``)."""
    full: dict[str, torch.Tensor]
    """Full tensors that replace the base's (``modules_to_save``), keyed by base tensor name."""
    biases: dict[str, torch.Tensor]
    """lora_bias updates ``B.bias * scaling``, keyed by base tensor name (``<module>.bias``)."""
    tied: bool = False
    """The base ties its input and output embeddings (set by :func:`rewrite_checkpoint`)."""


def read_adapter(directory: str | Path) -> Adapter:
    """Read and check ``adapter_config.json`` + ``adapter_model.safetensors``."""

    directory = Path(directory)
    config = read_adapter_config(directory)
    weights = directory / ADAPTER_WEIGHTS
    if not present(weights):
        raise ConfigError(f"{weights}: missing; the adapter weights must be saved as safetensors")
    check_file(weights, directory)  # the weights themselves, not what a link points to
    parts: dict[str, dict[str, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(weights)).items():
        name = key.removeprefix(ADAPTER_PREFIX)
        match = _LORA_KEY.match(name)
        if match:
            parts.setdefault(match["module"], {})[match["part"] + ("." + match["param"] if match["param"] else "")] = (
                tensor
            )
        else:
            full[name.replace(".base_layer.", ".")] = tensor
    missing = [key for key in ("r", "lora_alpha") if key not in config]
    if missing:
        raise ConfigError(
            f"{directory}/adapter_config.json: no {' or '.join(missing)} field; save the adapter with PEFT's "
            "save_pretrained (its LoraConfig writes both)"
        )
    modules, biases = {}, {}
    for module, found in parts.items():
        lora = _lora_module(module, found, config, weights)
        modules[f"{module}.weight"] = lora
        if lora.bias is not None:
            biases[f"{module}.bias"] = lora.bias.float() * lora.scaling
    return Adapter(directory, config, modules, full, biases)


def read_adapter_config(directory: Path) -> dict:
    path = directory / ADAPTER_CONFIG
    if not present(path):
        raise ConfigError(f"{path}: missing; --adapter must be a PEFT adapter directory (final/ or a promoted adapter)")
    try:
        config = json.loads(read_text(path, directory))
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ConfigError(f"{path}: peft_type={config.get('peft_type')!r}; only LoRA/DoRA adapters can be merged")
    unsupported = [key for key in UNMERGEABLE if config.get(key)]
    if str(config.get("init_lora_weights", "")).lower() == "mica":
        unsupported.append("init_lora_weights=mica")
    if unsupported:
        raise ConfigError(f"{path}: {unsupported} set; merging that LoRA variant is not supported")
    return config


def _lora_module(module: str, found: dict, config: dict, weights: Path) -> LoraModule:
    # heavy: peft
    from peft.utils.other import get_pattern_key

    embedding = "lora_embedding_A" in found
    a, b = (
        (found.get("lora_embedding_A"), found.get("lora_embedding_B"))
        if embedding
        else (
            found.get("lora_A.weight"),
            found.get("lora_B.weight"),
        )
    )
    if a is None or b is None:
        raise ConfigError(f"{weights}: module {module} lacks its lora_A or lora_B tensor")
    r = config.get("rank_pattern", {}).get(get_pattern_key(config.get("rank_pattern", {}).keys(), module), config["r"])
    alphas = config.get("alpha_pattern", {})
    alpha = alphas.get(get_pattern_key(alphas.keys(), module), config["lora_alpha"])
    if a.shape[0] != r:
        raise ConfigError(f"{weights}: module {module} has rank {a.shape[0]} but adapter_config.json says r={r}")
    if a.ndim != 2 or b.ndim != 2:
        raise ConfigError(f"{weights}: module {module} is not a Linear or Embedding LoRA (convolutions: not merged)")
    magnitude = found.get("lora_magnitude_vector", found.get("lora_magnitude_vector.weight"))
    if magnitude is not None and embedding:
        raise ConfigError(f"{weights}: DoRA on the embedding {module} is not supported by the merge")
    return LoraModule(
        name=module,
        A=a,
        B=b,
        scaling=alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r,
        embedding=embedding,
        fan_in_fan_out=bool(config.get("fan_in_fan_out")),
        magnitude=magnitude,
        bias=found.get("lora_B.bias"),
    )


# ----------------------------------------------------------------------------- streaming rewrite


def output_entries(base: BaseCheckpoint, dtype: torch.dtype) -> list[Entry]:
    """What :func:`merge_tensors` yields, from the input headers alone: every tensor but the
    quantization side tensors, floating point ones (FP8 included) in ``dtype``."""
    entries = []
    for file in base.files:
        for name, info in base.header(file).items():
            if is_side_tensor(name):
                continue
            stored = DTYPES.get(info["dtype"])
            if stored is None:
                raise ConfigError(f"{base.directory / file}: {name} has dtype {info['dtype']}, which cannot be merged")
            entries.append(Entry(name, dtype if stored.is_floating_point else stored, tuple(info["shape"])))
    return entries


def merge_tensors(
    base: BaseCheckpoint, adapter: Adapter | None, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor, dequantized, merged with ``adapter`` (if any) and cast to ``dtype``.
    Raises ConfigError when an adapter module or full tensor matched no base tensor."""
    pending = set(adapter.modules) | set(adapter.full) | set(adapter.biases) if adapter else set()
    for name, tensor in base.tensors(dequantize_fp8=True):
        if adapter is not None:
            tensor = _merged(name, tensor, adapter)
            pending.discard(name)
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
    if pending and adapter is not None:
        raise ConfigError(
            f"adapter {adapter.directory}: {len(pending)} adapted tensor(s) not found in the base checkpoint "
            f"{base.directory} (e.g. {sorted(pending)[:3]}); the adapter belongs to another model, or the "
            "checkpoint names its tensors differently from the model's modules"
        )


def _merged(name: str, tensor: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    if name in adapter.full:
        full = adapter.full[name]
        if full.shape != tensor.shape:
            raise ConfigError(
                f"adapter {adapter.directory}: {name} has shape {tuple(full.shape)}, the base has "
                f"{tuple(tensor.shape)} (a resized vocabulary cannot be merged)"
            )
        if adapter.tied and name.endswith("embed_tokens.weight") and not torch.equal(full, tensor.to(full.dtype)):
            raise ConfigError(
                f"adapter {adapter.directory}: replaces {name} of a model with tied embeddings; merged, the output "
                "embedding would change too. Serve it as an adapter"
            )
        return full
    if name in adapter.modules:
        return adapter.modules[name].merge(tensor)
    if name in adapter.biases:
        return tensor.float() + adapter.biases[name]
    return tensor


def tied_embeddings(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings")))


def check_tied_embeddings(base: BaseCheckpoint, adapter: Adapter) -> None:
    """Refuse LoRA on the input or output embedding of a model whose embeddings are tied: merged,
    both would change, while the adapter changed one (PEFT's unmerged forward keeps lm_head as is)."""
    touched = [n for n in adapter.modules if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    if tied_embeddings(base.config) and touched:
        raise ConfigError(
            f"adapter {adapter.directory}: LoRA on {touched} of a model with tie_word_embeddings=true cannot be "
            "merged exactly (the tied output embedding would change too); serve it as an adapter, or retrain "
            "without LoRA on embeddings"
        )


def dense_config(config: dict, dtype: torch.dtype) -> dict:
    """The base's config.json for dense ``dtype`` weights (quantization_config dropped)."""
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "compression_config")}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    out["dtype"] = str(dtype).removeprefix("torch.")
    out["torch_dtype"] = out["dtype"]  # the key transformers < 4.56 (older serving images) reads
    return out


def rewrite_checkpoint(
    base: BaseCheckpoint,
    output: str | Path,
    *,
    dtype: torch.dtype,
    kind: str,
    adapter: Adapter | None = None,
    max_shard_bytes: int = 5 << 30,
    force: bool = False,
    extra: Callable[[Path, dict], None] | None = None,
) -> dict:
    """Write ``base`` (merged with ``adapter``, dequantized, in ``dtype``) as a model directory at
    ``output``, atomically; ``extra(tmp, facts)`` adds more files before the commit. Returns the facts:
    ``{"shards": [file names], "bytes": total, "largest_tensor_bytes": the most held at once}``."""

    if adapter is not None:
        check_tied_embeddings(base, adapter)
        adapter.tied = tied_embeddings(base.config)
    inputs = (base.directory,) + ((adapter.directory,) if adapter is not None else ())
    with atomic_directory(output, kind=kind, force=force, marker=True, inputs=inputs) as tmp:
        entries = output_entries(base, dtype)
        stream = ShardStream(tmp, plan_shards(entries, max_shard_bytes))
        with disk_guard(output, what=f"{kind} shards", needed=sum(e.nbytes for e in entries)):  # a full disk: one line
            for name, tensor in merge_tensors(base, adapter, dtype):
                stream.write(name, tensor)
        facts = {
            "shards": stream.close(),
            "bytes": sum(e.nbytes for e in entries),
            "largest_tensor_bytes": max((e.nbytes for e in entries), default=0),
        }
        (tmp / "config.json").write_text(json.dumps(dense_config(base.config, dtype), indent=2) + "\n")
        if present(base.directory / "generation_config.json"):
            copy_file(base.directory / "generation_config.json", tmp / "generation_config.json", base.directory)
        if extra is not None:
            extra(tmp, facts)
        share_files(tmp)
    return facts
