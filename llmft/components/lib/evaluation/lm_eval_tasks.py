"""lm-evaluation-harness tasks, offline, in-process on the model the evaluate step has loaded.

A shipped task is a YAML in llmft/trainer/assets/lm_eval_tasks/ (lm-eval's own task format, ``dataset_path: json``)
with its JSON Lines data beside it. :func:`task_config` reads and checks it (no lm_eval import: the plan step
runs it in the pipeline image) and makes the data path absolute; :func:`run_task` hands that config to
``lm_eval.simple_evaluate`` with the evaluator's model wrapped in lm-eval's ``HFLM`` (a ready model instance is
accepted: lm_eval 0.4.13 ``lm_eval/models/huggingface.py`` HFLM.__init__, "take in an already-initialized
transformers.PreTrainedModel"), so the base and each adapter are scored over the one load of the base.
``HF_DATASETS_OFFLINE=1``: the ``json`` builder reads the local file and no dataset hub is asked.

lm-eval (``pip install lm-eval``, the ``eval`` extra) shares the trainer image's environment: it pins none of
torch, transformers, peft or datasets beyond what the project installs (``pip check`` stays clean).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from llmft.components.lib.evaluation.task_eval import LM_EVAL_METRICS, LM_EVAL_TASK_DIR
from llmft.trainer.errors import ConfigError, DataError

REQUIRED = {"task": str, "dataset_path": str, "output_type": str, "doc_to_text": str, "doc_to_choice": str}
"""Fields a shipped task YAML must have (lm-eval's names), with their types."""
DATA_FIELDS = ("question", "choices", "answer")
"""Fields of each data row: the question, the choices (at least two strings), the index of the right one."""


def task_config(name: str, task_dir: Path = LM_EVAL_TASK_DIR) -> dict[str, Any]:
    """The task's lm-eval config with its data file's absolute path; DataError naming file and field."""
    path = task_dir / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"lm-eval task {name!r}: {path} not found")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a YAML mapping; write an lm-eval task config (task:, dataset_path: json, ...)")
    for field, kind in REQUIRED.items():
        if not isinstance(config.get(field), kind):
            raise DataError(f"{path}: field `{field}` must be a {kind.__name__} (lm-eval task config)")
    if config["task"] != name or config["dataset_path"] != "json" or config["output_type"] != "multiple_choice":
        raise DataError(
            f"{path}: fields `task` must be {name!r} (the file name), `dataset_path` json and `output_type` "
            "multiple_choice: only local multiple-choice tasks run offline here"
        )
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    split = config.get("test_split", "test")
    if not isinstance(files, dict) or not isinstance(files.get(split), str):
        raise DataError(f"{path}: field `dataset_kwargs.data_files.{split}` must name the JSON Lines file beside it")
    data = (path.parent / files[split]).resolve()
    check_data(data)
    return {**config, "dataset_kwargs": {**config["dataset_kwargs"], "data_files": {split: str(data)}}}


def check_data(path: Path) -> None:
    """Every row of a task's data file: question (str), choices (>= 2 strings), answer (an index into them)."""
    if not path.is_file():
        raise DataError(f"{path}: the task's data file is missing")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise DataError(f"{where}: field `question` must be a string")
        choices = row.get("choices")
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
            raise DataError(f"{where}: field `choices` must be a list of at least two strings")
        answer = row.get("answer")
        if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
            raise DataError(f"{where}: field `answer` must be the index of the right choice (0..{len(choices) - 1})")


def run_task(name: str, model, tokenizer, *, batch_size: int = 8) -> dict[str, float]:
    """``{"acc": ...}`` of the loaded ``model`` on the shipped task ``name`` (lm-eval, in-process, offline)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # the json builder reads the local file; nothing from a hub
    config = task_config(name)
    try:
        from lm_eval import simple_evaluate  # optional: lm_eval
        from lm_eval.models.huggingface import HFLM  # optional: lm_eval
    except ImportError:
        raise ConfigError(
            f"eval task {name!r} needs lm-eval in the evaluate step's image: pip install 'kfp-llm-finetune[eval]'"
        ) from None
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=[config], log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    results = (out or {}).get("results", {}).get(name, {})
    return {metric: float(results[f"{metric},none"]) for metric in LM_EVAL_METRICS}
