"""``llmft serve check``: an adapter served by a real vLLM exactly as the deploy step's manifest serves it.

The check builds the deploy step's own :class:`DeployRequest` (``mode=vllm``) with a local folder standing in
for the PVC, so the served names (``<NAME>-base`` + ``<NAME>``, or the merged model alone as ``<NAME>``), the
LoRA module, ``--max-lora-rank``, ``--dtype`` and ``--max_model_len`` are the InferenceService's
(:func:`llmft.components.lib.serving.deployment.serve_spec` ->
:func:`llmft.components.lib.serving.inferenceservice.server_args`), and
:func:`llmft.components.lib.serving.deployment.deploy_promoted` runs it: the servability check, the manifest, then
:func:`llmft.components.lib.serving.vllm_local.serve_and_check` (start, smoke test, stop). The serving form is
decided as the pipeline's serving-form step decides it (``--serving-mode``; the default ``lora`` refuses an
adapter vLLM would refuse instead of merging it).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from llmft.components.lib.serving.deployment import DeployRequest, deploy_promoted
from llmft.components.lib.serving.inferenceservice import DEFAULT_MAX_LORA_RANK
from llmft.components.lib.serving.serving_form import prepare_serving_form
from llmft.trainer.errors import ConfigError, LlmftError

RESULT_KEYS = ("answers", "models")


def base_model_dir(adapter_dir: Path, base: str | None) -> Path:
    """The base model directory: ``base``, else the adapter's ``base_model_name_or_path`` (a local folder)."""
    if base is None:
        config = adapter_dir / "adapter_config.json"
        if not config.is_file():
            raise ConfigError(f"{config}: missing; {adapter_dir} is not a PEFT adapter (save it with save_pretrained)")
        base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
        where = f"{config} base_model_name_or_path"
    else:
        where = "--base"
    path = Path(base).resolve() if base else None
    if path is None or not (path / "config.json").is_file():
        raise ConfigError(
            f"{where}={base!r}: not a model directory with config.json; the check runs offline: pass --base DIR "
            "(the base model as a Hugging Face directory)"
        )
    return path


def check_result_target(path: Path) -> None:
    """``--json`` may be new or an earlier result of this command; anything else is not ours to replace."""
    if not path.exists():
        return
    try:
        ours = set(json.loads(path.read_text())) == set(RESULT_KEYS)
    except (ValueError, TypeError, OSError):
        ours = False
    if not ours:
        raise ConfigError(f"{path}: exists and is not a `llmft serve check` result; choose another --json path")


def _deploy_request(adapter: Path, base: Path, name: str, prompt: str, form, max_lora_rank: int, options: dict):

    model_dir = Path(form.model_dir).resolve()
    root = Path(os.path.commonpath([adapter, base, model_dir])).parent  # the "PVC": holds all of them
    return DeployRequest(
        adapter_dir=str(adapter),
        base_model=str(base),
        adapter_name=name,
        version="0",
        deploy=True,
        mode="vllm",
        name=isvc_name(name),
        namespace="",
        gpus=0,
        max_lora_rank=max_lora_rank,
        pvc_name="local",
        data_root=str(root),
        prompts=(prompt,),
        form=form.form,
        model_dir=str(model_dir),
        form_reason=form.reason,
        vllm_options=options,
    )


def one_line(text: str) -> str:
    """A message written as a list (``...:\\n- a\\n- b\\nFix.``) as one line: ``...: a; b. Fix.``"""
    text = text.replace(":\n- ", ": ").replace("\n- ", "; ").replace("\n", ". ")
    return " ".join(text.split())


def isvc_name(name: str) -> str:
    """A DNS-1035 InferenceService name for the served name ``name`` (the manifest is written, not applied)."""

    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:45].rstrip("-")
    return label if label[:1].isalpha() else f"m-{label}"[:45].rstrip("-")


def serve_check(
    adapter_dir: str | Path,
    name: str,
    prompt: str,
    *,
    base: str | None = None,
    serving_mode: str = "lora",
    max_lora_rank: int | None = None,
    merged_dir: str | Path | None = None,
    server_options: dict[str, Any] | None = None,
    max_tokens: int = 32,
) -> dict[str, Any]:
    """Serve ``adapter_dir`` (as ``name``) with a real vLLM and smoke-test it; ``{"models", "answers"}``.
    Every refusal is a one-line LlmftError (exit 1) and nothing is served after it."""

    adapter = Path(adapter_dir).resolve()
    if not adapter.is_dir():
        raise ConfigError(f"--adapter {adapter_dir}: not a directory")
    base_dir = base_model_dir(adapter, base)
    rank = max_lora_rank or DEFAULT_MAX_LORA_RANK
    with tempfile.TemporaryDirectory(prefix="llmft-serve-check-") as tmp:
        try:
            form = prepare_serving_form(
                adapter, serving_mode=serving_mode, max_lora_rank=rank, merged_dir=merged_dir or Path(tmp) / "merged"
            )
            if form.form == "full":
                raise ConfigError(
                    f"{adapter}: no adapter_config.json: not a PEFT adapter (or a full model, which this check does "
                    "not serve); pass the adapter directory the trainer wrote"
                )
            options = {**(server_options or {}), "max_tokens": max_tokens}
            req = _deploy_request(adapter, base_dir, name, prompt, form, rank, options)
            result = deploy_promoted(req, manifest_path=Path(tmp) / "inferenceservice.yaml")
        except LlmftError as exc:  # a list of problems (servability) on one line
            raise type(exc)(one_line(str(exc))) from None
    return {"models": result["models"], "answers": result["answers"]}
