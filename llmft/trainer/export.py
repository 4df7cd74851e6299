"""``llmft export``: a trained adapter as a servable directory, merged into its base or bundled.

``export_adapter(adapter, output, merge=True)`` writes a standalone Hugging Face model directory:
safetensors shards (+ index), ``config.json`` without any quantization_config, the tokenizer with
the chat template the adapter was trained with, ``generation_config.json``, the run's
``training_manifest.json`` and an ``export_manifest.json`` naming base model, revision, adapter and
dataset hash. The merge streams shard by shard (llmft/trainer/merge.py): LoRA, DoRA and QLoRA-trained
adapters are merged into the dense base in ``dtype`` (an FP8 base is dequantized first; a 4-bit
base is never merged into). Serve it with the Hugging Face runtime as a plain model (no
``--enable-lora``). With ``merge=False`` the output is a clean adapter bundle: adapter config and
weights, tokenizer, manifests; no optimizer, scheduler or RNG state.

Where the facts come from: an adapter directory from ``final/`` carries the tokenizer and
``training_manifest.json``; a promoted adapter (or a ``checkpoints/step-N``) does not, so the run's
``final/`` is found through ``promotion.json``'s ``checkpoint_path`` (or the checkpoint's own run
directory). The base model's identity is the manifest's, else ``adapter_config.json``'s
``base_model_name_or_path`` and ``revision``; ``--base`` points at its files when that path is not
reachable here, and is checked against the content hash the training recorded.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmft.trainer.errors import ConfigError
from llmft.trainer.hf_files import TOKENIZER_FILES
from llmft.trainer.io import TRAINING_MANIFEST, atomic_directory, atomic_write_json, sha256_file, share_files
from llmft.trainer.model_dir import check_model_files, content_hash
from llmft.trainer.safe_files import copy_file, present, read_text

EXPORT_MANIFEST = "export_manifest.json"
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
MERGED_KIND, BUNDLE_KIND = "merged-model", "adapter-bundle"


@dataclass
class Provenance:
    """What the adapter was trained on, gathered from the files a run leaves."""

    base: str
    revision: str | None
    method: str | None = None
    dataset: dict = field(default_factory=dict)
    base_identity: dict = field(default_factory=dict)
    training_manifest: Path | None = None
    tokenizer_dir: Path | None = None
    sources: list[str] = field(default_factory=list)
    """Which files each fact came from, for the export manifest."""


def _json(path: Path) -> dict:
    """A JSON object read from a regular file in its folder (a link or FIFO is refused, see safe_files.py)."""
    try:
        value = json.loads(read_text(path, path.parent))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _has_tokenizer(directory: Path | None) -> bool:
    return directory is not None and present(directory / "tokenizer_config.json")


def run_final_dir(adapter_dir: Path) -> Path | None:
    """The ``final/`` of the run an adapter came from: through promotion.json's checkpoint_path, or
    the run directory above a ``checkpoints/step-N`` adapter."""
    checkpoint = _json(adapter_dir / "promotion.json").get("checkpoint_path")
    candidates = [Path(checkpoint)] if checkpoint else []
    candidates.append(adapter_dir)
    for path in candidates:
        if path.parent.name == "checkpoints" and (path.parent.parent / "final").is_dir():
            return path.parent.parent / "final"
    return None


def find_provenance(adapter_dir: Path, adapter_config: dict, base_override: str | None = None) -> Provenance:
    """Base model, method, dataset and tokenizer of the adapter in ``adapter_dir`` (``base_override``:
    the base model's files are there instead, e.g. ``--base``)."""
    final = run_final_dir(adapter_dir)
    manifest_path = next(
        (d / TRAINING_MANIFEST for d in (adapter_dir, final) if d and present(d / TRAINING_MANIFEST)), None
    )
    manifest = _json(manifest_path) if manifest_path else {}
    identity = manifest.get("base_model") or {}
    sources = [f"training manifest: {manifest_path}"] if manifest_path else []
    base = base_override or identity.get("name_or_path") or adapter_config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{adapter_dir}: no base model recorded (no training_manifest.json, and adapter_config.json has no "
            "base_model_name_or_path); pass --base DIR"
        )
    dataset = manifest.get("dataset") or {}
    if not dataset:
        state = _json(
            Path(_json(adapter_dir / "promotion.json").get("checkpoint_path") or adapter_dir) / "trainer_state.json"
        )
        if state.get("dataset_cache_key"):
            dataset = {"cache_key": state["dataset_cache_key"]}
    tokenizer_dir = next((d for d in (adapter_dir, final) if _has_tokenizer(d)), None)
    return Provenance(
        base=base,
        revision=None if base_override else identity.get("revision", adapter_config.get("revision")),
        method=manifest.get("method"),
        dataset=dataset,
        base_identity=identity,
        training_manifest=manifest_path,
        tokenizer_dir=tokenizer_dir,
        sources=sources,
    )


def check_base_identity(base_dir: Path, prov: Provenance) -> str | None:
    """The content hash of ``base_dir``; ConfigError when the run recorded a different one."""

    expected = prov.base_identity.get("content_hash")
    if not expected:
        return None
    digest, method = content_hash(base_dir)
    if method == prov.base_identity.get("content_hash_method") and digest != expected:
        raise ConfigError(
            f"base model {base_dir}: content hash {digest[:12]}... differs from {expected[:12]}... recorded in "
            f"{prov.training_manifest}; the adapter was trained on another base. Pass --base with that model"
        )
    return digest


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer files; the chat template also goes into tokenizer_config.json (where
    transformers before 4.43 and the serving images built on them look for it)."""
    copied = []
    for name in TOKENIZER_FILES:
        if present(source / name):
            copy_file(source / name, target / name, source)
            copied.append(name)
    config_path, template = target / "tokenizer_config.json", target / "chat_template.jinja"
    if config_path.is_file() and template.is_file():
        config = json.loads(config_path.read_text())
        if not config.get("chat_template"):
            config["chat_template"] = template.read_text()
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return copied


def parse_size(text: str | int) -> int:
    """``5GB``, ``500MB``, ``1.5GiB`` or a byte count, above 0; ConfigError (one line, exit 1) otherwise."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    value = str(text).strip().upper()
    number = value.rstrip("KMGIB").strip()
    unit = value[len(value.rstrip("KMGIB")) :]
    try:
        size = float(number) * units[unit]
    except (KeyError, ValueError):
        size = math.nan
    if not math.isfinite(size) or size < 1:
        raise ConfigError(
            f"--max-shard-size {text!r}: use a size above 0 such as 5GB, 500MB or a number of bytes "
            "(a shard holds at least one tensor whatever the limit)"
        )
    return int(size)


def export_adapter(
    adapter: str | Path,
    output: str | Path,
    *,
    merge: bool = False,
    dtype: str = "bf16",
    base: str | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
) -> dict:
    """Write the merged model (``merge``) or the adapter bundle at ``output``; returns the manifest."""
    # heavy: safetensors
    from llmft.trainer.merge import read_adapter, read_adapter_config

    adapter_dir = Path(adapter)
    if not adapter_dir.is_dir():
        raise ConfigError(f"--adapter {adapter}: not a directory")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)  # before any work
    config = read_adapter_config(adapter_dir)
    prov = find_provenance(adapter_dir, config, base)
    if not merge:
        read_adapter(adapter_dir)  # the weights parse and match their config
        return _write_bundle(adapter_dir, Path(output), prov, config, force)
    return _write_merged(adapter_dir, Path(output), prov, DTYPES[dtype], shard_bytes, force)


def _manifest(fmt: str, adapter_dir: Path, prov: Provenance, config: dict, **extra) -> dict:
    # heavy: peft
    import peft

    # heavy: transformers
    import transformers

    return {
        "format": fmt,
        "base_model": {"name_or_path": prov.base, "revision": prov.revision, **prov.base_identity},
        "adapter": {
            "path": str(adapter_dir.resolve()),
            "sha256": sha256_file(adapter_dir / "adapter_model.safetensors"),
            "method": prov.method,
            "use_dora": bool(config.get("use_dora")),
            "use_rslora": bool(config.get("use_rslora")),
            "r": config.get("r"),
            "lora_alpha": config.get("lora_alpha"),
            "target_modules": config.get("target_modules"),
        },
        "dataset": prov.dataset,
        "sources": prov.sources,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def _tokenizer_into(tmp: Path, prov: Provenance, fallback: Path | None) -> str:
    if prov.tokenizer_dir is not None:
        copy_tokenizer(prov.tokenizer_dir, tmp)
        return f"the adapter's run ({prov.tokenizer_dir})"
    if fallback is not None and _has_tokenizer(fallback):
        copy_tokenizer(fallback, tmp)
        return f"the base model ({fallback}): the adapter directory and its run carry no tokenizer"
    return "none found: add the tokenizer the adapter was trained with"


def _write_bundle(adapter_dir: Path, output: Path, prov: Provenance, config: dict, force: bool) -> dict:
    base_dir = Path(prov.base) if Path(prov.base).is_dir() else None
    with atomic_directory(output, kind=BUNDLE_KIND, force=force, marker=True, inputs=(adapter_dir,)) as tmp:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            copy_file(adapter_dir / name, tmp / name, adapter_dir)
        tokenizer = _tokenizer_into(tmp, prov, base_dir)
        _copy_run_files(tmp, adapter_dir, prov)
        manifest = _manifest("adapter", adapter_dir, prov, config, tokenizer_source=tokenizer)
        atomic_write_json(tmp / EXPORT_MANIFEST, manifest)
        share_files(tmp)
    return manifest


def _copy_run_files(tmp: Path, adapter_dir: Path, prov: Provenance) -> None:
    """generation_config.json and training_manifest.json of the run, where it left them."""
    for source in (adapter_dir, prov.tokenizer_dir):
        if source is not None and present(source / "generation_config.json"):
            copy_file(source / "generation_config.json", tmp / "generation_config.json", source)
            break
    if prov.training_manifest is not None:
        copy_file(prov.training_manifest, tmp / TRAINING_MANIFEST, prov.training_manifest.parent)


def _write_merged(
    adapter_dir: Path, output: Path, prov: Provenance, dtype: torch.dtype, shard_bytes: int, force: bool
) -> dict:
    # heavy: safetensors
    from llmft.trainer.merge import BaseCheckpoint, read_adapter, rewrite_checkpoint

    adapter = read_adapter(adapter_dir)
    base = BaseCheckpoint.open(prov.base, prov.revision)
    if base.fmt.method is not None and not base.fmt.is_fp8:
        raise ConfigError(
            f"base model {base.directory} is stored {base.fmt.describe()}: merging needs its dense (or FP8) "
            "weights, never 4-bit ones. Pass --base with the unquantized model"
        )
    check_model_files(base.directory)  # a damaged base is named as such, not as "trained on another base"
    check_base_identity(base.directory, prov)
    facts: dict = {}

    def extra(tmp: Path, written: dict) -> None:
        facts["tokenizer_source"] = _tokenizer_into(tmp, prov, base.directory)
        _copy_run_files(tmp, adapter_dir, prov)
        if base.config.get("auto_map"):  # model code the config names (loaded only with trust_remote_code)
            for code in base.directory.glob("*.py"):
                copy_file(code, tmp / code.name, base.directory)
        facts["manifest"] = _manifest(
            "merged",
            adapter_dir,
            prov,
            adapter.config,
            dtype=str(dtype).removeprefix("torch."),
            base_storage=base.fmt.describe(),
            base_directory=str(base.directory.resolve()),
            merged_modules=len(adapter.modules),
            shards=written["shards"],
            bytes=written["bytes"],
            replaced_tensors=sorted(adapter.full),
            tokenizer_source=facts["tokenizer_source"],
            note=_qlora_note(prov),
            serving="a plain Hugging Face model: serve it without --enable-lora (KServe huggingface runtime, vLLM)",
        )
        atomic_write_json(tmp / EXPORT_MANIFEST, facts["manifest"])

    written = rewrite_checkpoint(
        base,
        output,
        dtype=dtype,
        kind=MERGED_KIND,
        adapter=adapter,
        max_shard_bytes=shard_bytes,
        force=force,
        extra=extra,
    )
    return {**facts["manifest"], "largest_tensor_bytes": written["largest_tensor_bytes"]}


def _qlora_note(prov: Provenance) -> str | None:
    if prov.method == "qlora":
        return "QLoRA adapter merged into the dense base (it was trained over the 4-bit quantized base)"
    return None
