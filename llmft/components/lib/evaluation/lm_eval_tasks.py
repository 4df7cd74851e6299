"""lm-evaluation-harness tasks, in-process on the model the evaluate step has loaded.

Three kinds of task (docs/evaluation.md, "lm-eval tasks"):

* a task shipped in llmft/demo/lm_eval_tasks/ (``velmora_mc``) or a task YAML on the volume (an
  ``promote_eval_tasks`` entry ending in ``.yaml``): lm-eval's own task format with local data (``dataset_path`` json,
  csv or parquet, ``data_files`` beside the YAML). :func:`task_config` reads and checks it without importing
  lm_eval (the plan step runs it in the pipeline image): at most 1 MiB of UTF-8, 64 levels deep, safe YAML only
  (a ``!function`` tag would run Python code from the volume: refused), data files present;
* any task, group or tag of lm-eval's registry, its data from the volume's cache (eval_cache.py) or, where a hub
  is reachable, fetched by lm-eval itself.

:func:`run_tasks` hands the configs to ``lm_eval.simple_evaluate`` with the evaluator's model wrapped in lm-eval's
``HFLM`` (a ready model instance is accepted: lm_eval 0.4.13 ``lm_eval/models/huggingface.py`` HFLM.__init__, "take
in an already-initialized transformers.PreTrainedModel"), so the base and each adapter are scored over the one
load of the base.

lm-eval (``pip install lm-eval``, the ``eval`` extra) shares the trainer image's environment: it pins none of
torch, transformers, peft or datasets beyond what the project installs (``pip check`` stays clean).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmft.components.lib.evaluation.eval_cache import DEFAULT_METRICS, check_cached, metric_names, offline_config
from llmft.components.lib.evaluation.task_eval import LM_EVAL_TASK_DIR
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.yaml_limits import load_user_yaml, read_yaml_text

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
"""lm-eval's output types (lm_eval 0.4.13 ``lm_eval/api/task.py`` ALL_OUTPUT_TYPES)."""
LOCAL_FORMATS = ("json", "csv", "parquet")
"""``dataset_path`` values a task file may use: ``datasets``' packaged builders, reading ``data_files``."""
REQUIRED = {"task": str, "dataset_path": str, "output_type": str, "doc_to_text": str}
"""Fields a task file must have (lm-eval's names), with their types."""
DATA_FIELDS = ("question", "choices", "answer")
"""Fields of each data row of a shipped task: the question, the choices (at least two strings), the right index."""


def task_file(name: str, task_dir: Path = LM_EVAL_TASK_DIR) -> Path:
    """The YAML of a shipped task (``velmora_mc``) or of a task file given by path (``/data/tasks/t.yaml``)."""
    return Path(name) if name.endswith((".yaml", ".yml")) else task_dir / f"{name}.yaml"


def task_config(name: str, task_dir: Path = LM_EVAL_TASK_DIR) -> dict[str, Any]:
    """The task's lm-eval config with its data files' absolute paths; one DataError/ConfigError line naming the
    file (and field, or line) of anything wrong. ``name``: a shipped task's name or a task YAML's path."""
    path = task_file(name, task_dir)
    shipped = not name.endswith((".yaml", ".yml"))
    if shipped and not path.is_file():
        raise ConfigError(f"lm-eval task {name!r}: {path} not found")
    text = read_yaml_text(path, "lm-eval task file")
    if "!function" in text:
        raise DataError(
            f"{path}: a `!function` tag runs Python code from beside the file, which a task file from the volume may "
            "not do; write the prompt with lm-eval's Jinja fields (doc_to_text, doc_to_target, doc_to_choice)"
        )
    config = load_user_yaml(text, str(path))
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a YAML mapping; write an lm-eval task config (task:, dataset_path: json, ...)")
    for field, kind in REQUIRED.items():
        if not isinstance(config.get(field), kind):
            raise DataError(f"{path}: field `{field}` must be a {kind.__name__} (lm-eval task config)")
    if (shipped and config["task"] != name) or config["dataset_path"] not in LOCAL_FORMATS:
        raise DataError(
            f"{path}: fields `task` must be {path.stem!r} (the file name) and `dataset_path` one of "
            f"{', '.join(LOCAL_FORMATS)} with `dataset_kwargs.data_files` beside it: a task file reads local data"
        )
    if config["output_type"] not in OUTPUT_TYPES:
        raise DataError(f"{path}: field `output_type` must be one of {', '.join(OUTPUT_TYPES)}")
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    split = config.get("test_split", "test")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()) or split not in files:
        raise DataError(f"{path}: field `dataset_kwargs.data_files.{split}` must name the data file beside it")
    data = {key: (path.parent / value).resolve() for key, value in files.items()}
    for key, file in data.items():
        if shipped or config["dataset_path"] == "json":
            check_data(file, rows=shipped)
        elif not file.is_file():
            raise DataError(f"{path}: `dataset_kwargs.data_files.{key}` {file} is missing")
    kwargs = {**config["dataset_kwargs"], "data_files": {k: str(v) for k, v in data.items()}}
    return {**config, "dataset_kwargs": kwargs}


def task_metrics_of(config: dict[str, Any]) -> list[str]:
    """The metric names a task config reports (our names of lm-eval's result keys)."""
    listed = [m["metric"] for m in config.get("metric_list") or [] if isinstance(m, dict) and "metric" in m]
    filters = [f["name"] for f in config.get("filter_list") or [] if isinstance(f, dict) and f.get("name")]
    return metric_names([str(m) for m in listed] or DEFAULT_METRICS[config["output_type"]], filters)


def data_digest(config: dict[str, Any]) -> tuple[str, int]:
    """(SHA-256 over the task's data files, rows of its test split) of a file task: what it was scored on."""
    digest = hashlib.sha256()
    files = config["dataset_kwargs"]["data_files"]
    for key in sorted(files):
        digest.update(key.encode() + b"\0" + Path(files[key]).read_bytes())
    test = Path(files[config.get("test_split", "test")])
    rows = sum(1 for line in test.read_bytes().splitlines() if line.strip()) if test.suffix == ".jsonl" else 0
    return digest.hexdigest(), rows


def check_data(path: Path, *, rows: bool = True) -> None:
    """Every line of a JSON Lines data file is JSON; with ``rows`` (a shipped task) also question (str), choices
    (>= 2 strings) and answer (an index into them)."""
    if not path.is_file():
        raise DataError(f"{path}: the task's data file is missing")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise DataError(f"{where}: the row is nested too deep") from None
        if rows:
            _check_row(where, row)


def _check_row(where: str, row: Any) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("question"), str):
        raise DataError(f"{where}: field `question` must be a string")
    choices = row.get("choices")
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
        raise DataError(f"{where}: field `choices` must be a list of at least two strings")
    answer = row.get("answer")
    if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
        raise DataError(f"{where}: field `answer` must be the index of the right choice (0..{len(choices) - 1})")


def lm_eval_configs(task, cache_dir: str) -> list[dict[str, Any] | str]:
    """What lm-eval is handed for one planned task (schema.EvalTaskPlan): a file task's config, each cached
    registry task's offline config, or the registry name itself (its data fetched from a reachable hub)."""
    if task.kind in ("shipped", "volume"):
        return [task_config(task.source)]
    if task.kind == "cached":
        entry = check_cached(cache_dir, task.name) or {"tasks": {}}
        return [offline_config(cache_dir, leaf, spec) for leaf, spec in entry["tasks"].items()]
    return [task.name]


def run_tasks(task, model, tokenizer, *, cache_dir: str, num_fewshot: int, limit: int, batch_size: int):
    """``{metric: value, "questions": documents scored}`` of one planned task on the loaded ``model`` (lm-eval,
    in-process): a group's metric is the mean of its tasks' weighted by their documents."""
    configs = lm_eval_configs(task, cache_dir)
    if task.kind != "hub":
        os.environ["HF_DATASETS_OFFLINE"] = "1"  # the data is local: nothing from a hub
    try:
        from lm_eval import simple_evaluate  # optional: lm_eval
        from lm_eval.models.huggingface import HFLM  # optional: lm_eval
    except ImportError:
        raise ConfigError(
            f"eval task {task.name!r} needs lm-eval in the evaluate step's image: pip install 'kfp-llm-finetune[eval]'"
        ) from None
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(
        model=lm, tasks=configs, num_fewshot=None if num_fewshot < 0 else num_fewshot, limit=limit or None,
        log_samples=False, bootstrap_iters=0, verbosity="WARNING", random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0,
    )  # fmt: skip
    return aggregate(out or {}, task.metrics)


def aggregate(out: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, float]:
    """The task's metrics from simple_evaluate's output: one task's own, or its tasks' document-weighted mean."""
    results, counts = out.get("results", {}), out.get("n-samples", {})
    totals: dict[str, float] = {}
    documents = 0.0
    for leaf, values in results.items():
        if leaf not in counts:
            continue  # a group's own row: recomputed below from its tasks
        n = float(counts[leaf].get("effective", 0))
        documents += n
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            name = metric if filt == "none" else f"{metric}_{filt.replace('-', '_')}"
            if name in metrics and isinstance(value, int | float):
                totals[name] = totals.get(name, 0.0) + n * float(value)
    scores = {name: total / documents for name, total in totals.items()} if documents else {}
    return {**scores, "questions": documents}
