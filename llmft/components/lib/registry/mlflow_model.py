"""The promoted adapter as an MLflow Model of the transformers flavour with a PEFT adaptor, logged from the run that
trained it, so that ``mlflow.transformers.load_model("models:/<name>/<version>")`` (and ``mlflow.pyfunc``) give
back base + adapter.

The register step runs in the pipeline image, which has no torch or transformers, and loading a base model to
call ``mlflow.transformers.save_model`` would cost the step the model's memory. So the folder is written here,
in the layout ``save_model`` writes for a PEFT model saved with ``base_model_path`` (mlflow 3.17
``mlflow/transformers/__init__.py`` 656-700, ``flavor_config.py`` 48-103; checked against a real save in
tests/pipeline/test_mlflow_model.py):

    MLmodel                     flavors: transformers (task text-generation, peft_adaptor "peft", the base),
                                python_function (loader_module mlflow.transformers)
    peft/                       adapter_config.json, adapter_model.safetensors
    components/tokenizer/       the tokenizer files the adapter was trained with (chat template included)
    requirements.txt, python_env.yaml, conda.yaml

The base is referenced, not copied: a directory (on the data volume) as ``local_base_model_path``, which
MLflow's loader reads from there (``model_io.py`` 106-142; ``load_model(..., base_model_path=...)`` overrides
it where the volume is mounted elsewhere), or a hub id as ``source_model_name`` at its revision. The model and
tokenizer classes are written as ``AutoModelForCausalLM`` / ``AutoTokenizer``: MLflow's loader calls
``getattr(transformers, name).from_pretrained`` (``model_io.py`` 224-241, 299-337), and the Auto classes find the
concrete class in config.json without ``trust_remote_code``.

It is logged as a LoggedModel of the training run (MLflow 3: ``create_logged_model(source_run_id=...)``, the
run's model output, ``log_model_artifacts``, ``finalize_logged_model``, as ``mlflow/models/model.py`` ``Model.log``
1160-1313 does), and the registered version is created from it (``source=models:/<model_id>``, ``run_id`` the
training run). A full fine-tune (no adapter_config.json) is not written as a model: its weights stay on the
volume (``llmft.promoted_path``) and the version's source is the register run's artifact folder.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from llmft.trainer.hf_files import TOKENIZER_FILES
from llmft.trainer.safe_files import copy_file, present

MODEL_NAME = "adapter"
"""The LoggedModel's name (``models:/<model_id>``; the artifact folder of the training run's model output)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md")
PEFT_DIR, TOKENIZER_DIR = "peft", "components/tokenizer"


def is_adapter(promoted_dir: str | Path) -> bool:
    return (Path(promoted_dir) / "adapter_config.json").is_file()


def flavor_config(base_model: str, base_dtype: str | None, versions: dict[str, str]) -> dict[str, Any]:
    """The ``transformers`` flavour of the MLmodel (what ``build_flavor_config`` writes for a PEFT pipeline)."""
    conf: dict[str, Any] = {
        "code": None,
        "components": ["tokenizer"],
        "instance_type": "TextGenerationPipeline",
        "peft_adaptor": PEFT_DIR,
        "pipeline_model_type": "AutoModelForCausalLM",
        "source_model_name": base_model,
        "task": "text-generation",
        "tokenizer_type": "AutoTokenizer",
        "transformers_version": versions.get("transformers") or "",
    }
    if Path(base_model).is_dir():
        conf["local_base_model_path"] = str(Path(base_model).resolve())
    else:
        conf["source_model_revision"] = versions.get("base_revision") or "main"
    if base_dtype:
        conf["torch_dtype"] = f"torch.{base_dtype}"
    return conf


def mlmodel(flavor: dict[str, Any], *, model_id: str, run_id: str, artifact_path: str, size: int) -> dict[str, Any]:
    """The MLmodel document (``mlflow.models.Model.to_dict`` of a transformers text-generation model)."""
    python = ".".join(map(str, sys.version_info[:3]))
    return {
        "artifact_path": artifact_path,
        "flavors": {
            "python_function": {
                "env": {"conda": "conda.yaml", "virtualenv": "python_env.yaml"},
                "loader_module": "mlflow.transformers",
                "python_version": python,
            },
            "transformers": flavor,
        },
        "is_signature_from_type_hint": False,
        "mlflow_version": _mlflow_version(),
        "model_id": model_id,
        "model_size_bytes": size,
        "model_uuid": model_id,
        "prompts": None,
        "run_id": run_id,
        "signature": {
            "inputs": '[{"type": "string", "required": true}]',
            "outputs": '[{"type": "string", "required": true}]',
            "params": None,
        },
        "type_hint_from_example": False,
        "utc_time_created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f"),
    }


def requirements(versions: dict[str, str]) -> list[str]:
    pins = [f"mlflow=={_mlflow_version()}"]
    pins += [
        f"{name}=={versions[name].split('+')[0]}" if versions.get(name) else name
        for name in ("transformers", "peft", "torch")
    ]
    return pins


@contextmanager
def model_folder(
    promoted_dir: str | Path,
    base_model: str,
    manifest: dict[str, Any],
    *,
    model_id: str,
    run_id: str,
    artifact_path: str,
) -> Iterator[Path]:
    """A temporary folder holding the MLflow Model of ``promoted_dir`` (removed afterwards)."""
    promoted, versions = Path(promoted_dir), _versions(manifest)
    with tempfile.TemporaryDirectory(prefix="llmft-mlflow-model-") as tmp:
        root = Path(tmp)
        _copy_present(promoted, root / PEFT_DIR, ADAPTER_FILES)
        tokenizer_source = promoted if (promoted / "tokenizer_config.json").is_file() else Path(base_model)
        _copy_present(tokenizer_source, root / TOKENIZER_DIR, TOKENIZER_FILES)
        pins = requirements(versions)
        (root / "requirements.txt").write_text("\n".join(pins) + "\n")
        python = ".".join(map(str, sys.version_info[:3]))
        (root / "python_env.yaml").write_text(
            yaml.safe_dump({"python": python, "build_dependencies": ["pip"], "dependencies": ["-r requirements.txt"]})
        )
        conda = {"channels": ["conda-forge"], "dependencies": [f"python={python}", "pip", {"pip": pins}]}
        (root / "conda.yaml").write_text(yaml.safe_dump({**conda, "name": "mlflow-env"}))
        flavor = flavor_config(base_model, _base_dtype(base_model, manifest), versions)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        document = mlmodel(flavor, model_id=model_id, run_id=run_id, artifact_path=artifact_path, size=size)
        (root / "MLmodel").write_text(yaml.safe_dump(document, sort_keys=True))
        yield root


def log_adapter_model(client, experiment_id: str, run_id: str, promoted_dir: str | Path, base_model: str,
                      manifest: dict[str, Any], tags: dict[str, str], key: tuple[str, str]) -> str:  # fmt: skip
    """Log the adapter as a LoggedModel of run ``run_id`` (the training run); returns its model id. ``key``
    (tag, value) names the registration: a retried step whose earlier attempt logged a READY model (and then
    failed to register it) reuses that one."""
    from mlflow.entities import LoggedModelOutput  # heavy: mlflow

    earlier = client.search_logged_models([experiment_id], filter_string=f"tags.`{key[0]}` = '{_quote(key[1])}'")
    ready = [m for m in earlier if str(m.status).endswith("READY") and m.source_run_id == run_id]
    if ready:
        return ready[0].model_id
    model = client.create_logged_model(
        experiment_id, name=MODEL_NAME, source_run_id=run_id, tags=tags, model_type="peft-adapter"
    )
    client.log_outputs(run_id=run_id, models=[LoggedModelOutput(model.model_id, step=0)])
    folder = model_folder(
        promoted_dir,
        base_model,
        manifest,
        model_id=model.model_id,
        run_id=run_id,
        artifact_path=model.artifact_location,
    )
    try:
        with folder as local:
            client.log_model_artifacts(model.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def _quote(text: str) -> str:
    return text.replace("'", "\\'")


def _copy_present(source: Path, target: Path, names: tuple[str, ...]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        if present(source / name):
            copy_file(source / name, target / name, source)  # a link or FIFO among them is refused (safe_files)


def _versions(manifest: dict[str, Any]) -> dict[str, str]:
    versions = {k: str(v) for k, v in (manifest.get("versions") or {}).items() if v}
    revision = ((manifest.get("config") or {}).get("model") or {}).get("revision")
    return {**versions, **({"base_revision": str(revision)} if revision else {})}


def _base_dtype(base_model: str, manifest: dict[str, Any]) -> str | None:
    """The base's dtype as its config.json names it (a local base), else the trainer's model.dtype when explicit."""
    config = Path(base_model) / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            data = {}
        dtype = data.get("dtype") or data.get("torch_dtype")
        if isinstance(dtype, str) and dtype.isidentifier():
            return dtype
    dtype = ((manifest.get("config") or {}).get("model") or {}).get("dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


def _mlflow_version() -> str:
    from mlflow.version import VERSION  # heavy: mlflow

    return VERSION
