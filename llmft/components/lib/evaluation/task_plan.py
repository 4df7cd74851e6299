"""The plan step's reading of ``promote_eval_tasks``: each entry found, in seconds, before any GPU time.

* ``heldout``; a shipped task (llmft/demo/lm_eval_tasks/); a task YAML on the volume (a path ending in
  ``.yaml``): read and checked by lm_eval_tasks.task_config (file, field or line named in one line);
* any other name is an lm-eval registry task, group or tag: its data must be in the volume's eval cache
  (eval_cache.check_cached: every file at its recorded size), or a hub must be reachable (the evaluate step's
  lm-eval then fetches it). Otherwise one line names the task, its dataset and the command that caches it.

Nothing here imports lm_eval or torch (the pipeline image).
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Mapping

from llmft.components.lib.contracts.metrics import PERPLEXITY
from llmft.components.lib.contracts.schema import EvalTaskPlan
from llmft.components.lib.evaluation.eval_cache import cache_command, check_cached
from llmft.components.lib.evaluation.lm_eval_registry import NAME, dataset_of, defined, registry_dir
from llmft.components.lib.evaluation.lm_eval_tasks import data_digest, task_config, task_metrics_of
from llmft.components.lib.evaluation.scoring import METRICS
from llmft.components.lib.evaluation.task_eval import (
    HELDOUT,
    check_promote_metric,
    lm_eval_task_names,
    parse_guards,
    parse_tasks,
    shown,
)
from llmft.trainer.errors import ConfigError, DataError

HUB_PROBE_TIMEOUT_S = 3.0
"""How long the plan step waits for the dataset hub before it counts the cluster as offline."""
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_reachable(environ: Mapping[str, str]) -> bool:
    """False when an offline variable is set; else whether ``HF_ENDPOINT`` (the Hugging Face hub by default)
    answers within :data:`HUB_PROBE_TIMEOUT_S`."""
    if any(environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_ENV):
        return False
    endpoint = environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except Exception:  # noqa: BLE001 - any failure means: not reachable from here
        return False


def resolve_task(name: str, cache_dir: str, environ: Mapping[str, str]) -> EvalTaskPlan:
    """One ``promote_eval_tasks`` entry as the evaluate step will run it (see the module docstring)."""
    if name == HELDOUT:
        return EvalTaskPlan(HELDOUT, "heldout", HELDOUT, METRICS)
    if name in lm_eval_task_names() or name.endswith((".yaml", ".yml")):
        return _file_task(name)
    check_registry_name(name)
    entry = check_cached(cache_dir, name)
    if entry is not None:
        return _cached_task(name, entry)
    return _uncached_task(name, cache_dir, environ)


def check_registry_name(name: str) -> None:
    """ConfigError unless ``name`` can be an lm-eval registry task, group or tag (checked against the installed
    registry's YAMLs where lm-eval is installed; :func:`~.lm_eval_registry.defined`)."""
    if not NAME.match(name):
        raise ConfigError(
            f"pipeline parameter `promote_eval_tasks`: {shown(name)} is not a task name (letters, digits, _.-:+)"
        )
    if name == PERPLEXITY:
        raise ConfigError("pipeline parameter `promote_eval_tasks`: perplexity is always computed; leave it out")
    if registry_dir() is not None and defined(name) is None:
        raise ConfigError(
            f"pipeline parameter `promote_eval_tasks`: {shown(name)} is not heldout, a shipped task "
            f"({', '.join(lm_eval_task_names())}), a task file's path or a task, group or tag of lm-eval's registry"
        )


def _check_task_path(name: str) -> None:
    if name.endswith((".yaml", ".yml")) and not os.path.isabs(name):
        raise ConfigError(f"pipeline parameter `promote_eval_tasks`: {shown(name)}: give a task file's absolute path")


def _file_task(name: str) -> EvalTaskPlan:
    _check_task_path(name)
    config = task_config(name)
    digest, rows = data_digest(config)
    version = str((config.get("metadata") or {}).get("version", ""))
    kind = "volume" if name.endswith((".yaml", ".yml")) else "shipped"
    return EvalTaskPlan(name, kind, config["task"], tuple(task_metrics_of(config)), name, version, digest, rows)


def _cached_task(name: str, entry: dict) -> EvalTaskPlan:
    tasks = entry["tasks"]
    metric_sets = [set(task["metrics"]) for task in tasks.values()]
    metrics = tuple(m for m in next(iter(tasks.values()))["metrics"] if all(m in s for s in metric_sets))
    digest = hashlib.sha256()
    for leaf in sorted(tasks):
        for split in sorted(tasks[leaf]["splits"]):
            digest.update(f"{leaf}/{split}:{tasks[leaf]['splits'][split]['sha256']}\n".encode())
    versions = sorted({f"{leaf}={tasks[leaf].get('version')}" for leaf in tasks})
    version = versions[0].partition("=")[2] if len(tasks) == 1 else ",".join(versions)
    size = sum(_test_rows(task) for task in tasks.values())
    return EvalTaskPlan(name, "cached", name, metrics, "", version, digest.hexdigest(), size)


def _test_rows(task: dict) -> int:
    splits = task["splits"]
    return int((splits.get("test") or next(iter(splits.values()), {"rows": 0}))["rows"])


def _uncached_task(name: str, cache_dir: str, environ: Mapping[str, str]) -> EvalTaskPlan:
    found = defined(name)  # (check_registry_name refused a name the installed registry lacks)
    if hub_reachable(environ):
        return EvalTaskPlan(name, "hub", name)
    dataset = "/".join(part for part in dataset_of(found) if part) if found else ""
    what = f"dataset {dataset}" if dataset else "its datasets"
    raise DataError(
        f"eval task {name!r}: {what} is not in the evaluation cache {cache_dir} and no dataset hub is reachable "
        f"from here; on a machine with internet run `{cache_command([name])}` and copy <dir> to {cache_dir}"
    )


def compiled_eval_notes(tasks: str, metric: str, guards: str) -> list[str]:
    """The evaluation a pipeline is compiled (or scheduled) with, checked where the volume is not at hand: what
    every run's plan step would refuse whatever the volume holds is refused now, in the plan step's words (a name
    no task has, a relative task file, a metric or guard no selected task computes); what only a run's volume or
    network can settle (an lm-eval registry task's data in the eval cache, a task YAML on the volume) comes back
    as notes naming the check each run makes and the command that prepares for it."""
    available, open_tasks, registry, on_volume = [PERPLEXITY], [], [], []
    for name in parse_tasks(tasks):
        if name == HELDOUT:
            available += [f"{HELDOUT}.{m}" for m in METRICS]
        elif name in lm_eval_task_names():
            spec = _file_task(name)
            available += [f"{spec.label}.{m}" for m in spec.metrics]
        elif name.endswith((".yaml", ".yml")):
            _check_task_path(name)
            on_volume.append(name)
        else:
            check_registry_name(name)
            registry.append(name)
            open_tasks.append(name)
    if not on_volume:  # a task file's metrics (its `task:` label) are known only where the file is
        check_promote_metric(metric, tuple(available), tuple(open_tasks))
        parse_guards(guards, tuple(available), tuple(open_tasks))
    notes = []
    if registry:
        names = ", ".join(registry)
        notes.append(
            f"promote_eval_tasks compiled in with lm-eval registry task(s) {names}: every run's plan step refuses "
            "to start unless their data is in the volume's eval cache (eval-cache/ on the data volume, "
            "/data/eval-cache in the pods) or a dataset hub is reachable from the cluster. For an air-gapped "
            f"cluster, once: `{cache_command(registry)}` on a connected machine, then copy <dir> to the volume's "
            "eval-cache/ (docs/evaluation.md)"
        )
    if on_volume:
        notes.append(
            f"promote_eval_tasks compiled in with task file(s) {', '.join(on_volume)}: read from the data volume "
            "by every run's plan step (not here), which refuses the run when a file is missing or invalid"
        )
    return notes
