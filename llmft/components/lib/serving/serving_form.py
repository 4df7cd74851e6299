"""The serving form of a promoted adapter: a vLLM LoRA module on its base, or merged into the base.

The ``choose-serving-form`` step (llmft/components/serving_form.py, trainer image) runs between promote
and register, so the MLflow version records the form that is served:

* :func:`choose_form` asks the servability gate (:mod:`llmft.components.lib.serving.servability`) whether
  vLLM can load the adapter as a LoRA module, and decides by the plan's ``serving_mode``:
  ``auto`` serves it as LoRA when it can and merged when it cannot (the reason is logged, e.g.
  ``use_dora=true; vLLM does not support DoRA``); ``lora`` refuses an adapter vLLM refuses;
  ``merged`` always merges.
* For the merged form, :func:`merged_model` runs ``llmft export --merge`` (llmft/trainer/export.py: the
  base's safetensors streamed shard by shard, bf16 out) into the plan's ``merged_dir``
  (``<root>/merged/<registered name>/<run>``), atomically, as llmft's own ``merged-model`` kind.
  A retried step finds the complete directory of the same adapter (the export manifest's adapter
  sha256) and reuses it; a directory llmft did not write is never replaced.
* ``serving.json`` (:class:`ServingForm`) tells register (MLflow tags ``llmft.served_form``,
  ``llmft.serving_reason``; the export manifest as an artifact) and deploy (what the
  InferenceService serves) what was decided.

A full fine-tune's promoted folder has no adapter: its form is ``full`` (the deploy step serves
adapters only and says so).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.choices import SERVING_MODES
from llmft.components.lib.serving.servability import AdapterNotServableError, check_vllm_servable
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import atomic_write_json, is_complete, sha256_file

FORM_FILE = "serving.json"
EXPORT_MANIFEST_FILE = "export_manifest.json"
MERGED_DTYPE = "bf16"
"""dtype of the merged weights: what the InferenceService's vLLM runs (ServeSpec.dtype ``bfloat16``)."""
FORM_TAG, REASON_TAG, MODE_TAG, MODEL_DIR_TAG = (
    "llmft.served_form",
    "llmft.serving_reason",
    "llmft.serving_mode",
    "llmft.served_model_dir",
)
MAX_TAG_CHARS = 5000
"""MLflow's limit on a model version tag value."""


@dataclass(frozen=True)
class ServingForm:
    """What the serving-form step decided (``serving.json``)."""

    form: str
    """lora (the adapter as a vLLM LoRA module on its base), merged (one plain model) or full (no adapter)."""
    requested: str
    """The plan's serving_mode (auto, lora or merged)."""
    reason: str
    """Why this form, in one line."""
    adapter_dir: str
    """The promoted adapter on the volume."""
    model_dir: str
    """What the server loads besides (lora) or instead of (merged) the base: the adapter or the merged model."""
    problems: tuple[str, ...] = ()
    """Every reason vLLM would refuse the adapter as a LoRA module (empty: it would serve it)."""
    export_manifest: dict[str, Any] | None = None
    """The merged model's export_manifest.json (merged form)."""
    reused: bool = False
    """The merged model was already there, complete, from the same adapter (a retried step)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingForm:
        return cls(**{**data, "problems": tuple(data.get("problems") or ())})

    def tags(self) -> dict[str, str]:
        """Tags of the MLflow version (and run): which form is served, why, and from where."""
        tags = {FORM_TAG: self.form, REASON_TAG: self.reason, MODE_TAG: self.requested, MODEL_DIR_TAG: self.model_dir}
        return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


@dataclass(frozen=True)
class FormChoice:
    """:func:`choose_form`'s answer."""

    form: str
    reason: str
    problems: list[str] = field(default_factory=list)


def choose_form(adapter_dir: str | Path, serving_mode: str, max_lora_rank: int) -> FormChoice:
    """The form to serve the adapter in; AdapterNotServableError for ``lora`` when vLLM refuses it."""

    if serving_mode not in SERVING_MODES:
        raise ConfigError(f"serving_mode {serving_mode!r}: use one of {', '.join(SERVING_MODES)}")
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        return FormChoice("full", "full fine-tuning: the promoted weights are a whole model, not an adapter")
    problems = check_vllm_servable(adapter_dir, max_lora_rank=max_lora_rank)
    if serving_mode == "merged":
        return FormChoice("merged", "serving_mode=merged", problems)
    if not problems:
        return FormChoice("lora", f"vLLM serves the adapter as a LoRA module (max LoRA rank {max_lora_rank})")
    if serving_mode == "lora":
        raise AdapterNotServableError(
            f"adapter {adapter_dir} cannot be served by vLLM as a LoRA module (serving_mode=lora):\n- "
            + "\n- ".join(problems)
            + "\nSet serving_mode=auto (or merged) to serve it merged into its base model."
        )
    summary = "; ".join(dict.fromkeys(c for p in problems for c in _summary(p, adapter_dir).split("; ")))
    return FormChoice("merged", f"vLLM cannot serve the adapter as a LoRA module: {summary}", problems)


def _summary(problem: str, adapter_dir: Path) -> str:
    """A servability problem without its path and its fix: ``use_dora=true; vLLM does not support DoRA``."""
    text = problem
    if text.startswith(f"{adapter_dir}/"):  # "<dir>/adapter_config.json: use_dora=true; ...: retrain ..."
        text = text.split(": ", 1)[-1]
    text = text.removeprefix(f"{adapter_dir}: ")
    return text.split(": ", 1)[0]


def merged_model(adapter_dir: str | Path, merged_dir: str | Path, *, dtype: str = MERGED_DTYPE) -> tuple[dict, bool]:
    """(export manifest, reused): the adapter merged into its base at ``merged_dir``; an existing complete
    merge of the same adapter weights in ``dtype`` is reused (a retried step), anything else of ours replaced."""
    from llmft.trainer.export import DTYPES, EXPORT_MANIFEST, export_adapter  # heavy: torch

    adapter_dir, merged_dir = Path(adapter_dir), Path(merged_dir)
    if is_complete(merged_dir) and (merged_dir / EXPORT_MANIFEST).is_file():
        manifest = json.loads((merged_dir / EXPORT_MANIFEST).read_text())
        same_adapter = manifest.get("adapter", {}).get("sha256") == sha256_file(
            adapter_dir / "adapter_model.safetensors"
        )
        if same_adapter and manifest.get("dtype") == str(DTYPES[dtype]).removeprefix("torch."):
            return manifest, True
    export_adapter(adapter_dir, merged_dir, merge=True, dtype=dtype)
    return json.loads((merged_dir / EXPORT_MANIFEST).read_text()), False


def prepare_serving_form(
    adapter_dir: str | Path, *, serving_mode: str, max_lora_rank: int, merged_dir: str | Path
) -> ServingForm:
    """Decide the form (logging why) and, for ``merged``, write the merged model; what serving.json holds."""
    choice = choose_form(adapter_dir, serving_mode, max_lora_rank)
    print(f"serving form: {choice.form} ({choice.reason})", flush=True)
    for problem in choice.problems:
        print(f"  vLLM LoRA serving: {problem}", flush=True)
    form = ServingForm(
        form=choice.form,
        requested=serving_mode,
        reason=choice.reason,
        adapter_dir=str(adapter_dir),
        model_dir=str(adapter_dir),
        problems=tuple(choice.problems),
    )
    if choice.form != "merged":
        return form
    try:
        manifest, reused = merged_model(adapter_dir, merged_dir)
    except ConfigError as exc:  # e.g. LoRA on fused MoE experts: neither vLLM nor the merge takes it
        raise type(exc)(f"serving form merged ({choice.reason}): {exc}") from None
    verb = "reused the complete merge of this adapter at" if reused else "merged the adapter into its base at"
    print(f"serving form: {verb} {merged_dir} ({len(manifest['shards'])} shard(s), {manifest['dtype']})", flush=True)
    return ServingForm(
        **{**form.to_dict(), "model_dir": str(merged_dir), "export_manifest": manifest, "reused": reused}
    )


def write_form(form: ServingForm, directory: str | Path) -> Path:
    """``<directory>/serving.json`` (and the export manifest beside it, for MLflow); returns serving.json's path."""

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if form.export_manifest is not None:
        atomic_write_json(directory / EXPORT_MANIFEST_FILE, form.export_manifest)
    return atomic_write_json(directory / FORM_FILE, form.to_dict())


def read_form(directory: str | Path) -> ServingForm:
    """The :class:`ServingForm` a serving artifact holds."""
    path = Path(directory) / FORM_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the serving-form step did not finish")
    return ServingForm.from_dict(json.loads(path.read_text()))


def form_files(directory: str | Path) -> tuple[Path, Path]:
    """The serving step's files in its output ``directory`` (serving.json; the merged form's export manifest, absent
    for a LoRA form): what the register step logs with the registration run."""
    return Path(directory) / FORM_FILE, Path(directory) / EXPORT_MANIFEST_FILE
