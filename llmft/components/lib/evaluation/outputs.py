"""What the evaluate step adds to its evaluation besides the scores, and how it writes its files.

* :func:`eval_sets`: what each metric was scored on (evaluation.json ``eval_sets``): perplexity on the tokenized
  validation split (its cache key, split and token count), each task on its questions or data (hash, size,
  version, lm-eval settings). The registry records them with each version and compares only like with like
  (registry/mlflow_registry.py).
* :func:`gate_preview`: the promote gate's decision over these very numbers (evaluation/promote.py ``decide``, the
  rule the promote step applies), so the report, the KFP metrics and Langfuse show it with its reason.
* :func:`write_outputs`: evaluation.json and the HTML report, atomically; a full disk is one line naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmft.components.lib.evaluation.promote import decide
from llmft.trainer.data.loader import dataset_info
from llmft.trainer.io import atomic_write_json, atomic_write_text
from llmft.trainer.storage import disk_guard

PERPLEXITY_SET = "perplexity"


def eval_sets(evaluation: dict[str, Any], runner, tokenized_dir: str) -> dict[str, dict[str, Any]]:
    """``{"perplexity": {...}, <task>: {...}}``: what each was scored on (see the module docstring)."""
    manifest = dataset_info(tokenized_dir)
    key = str(manifest.get("cache_key") or Path(tokenized_dir).name)
    sets = {
        PERPLEXITY_SET: {"hash": key, "size": int(evaluation["base"].get("tokens") or 0), "split": evaluation["split"]}
    }
    return sets | (runner.eval_sets() if runner is not None else {})


def gate_preview(evaluation: dict[str, Any], plan) -> dict[str, Any]:
    """The promote gate's decision (promoted, checkpoint, reason, guards, ...) on ``evaluation``."""
    guards = [(g.metric, g.tolerance) for g in plan.evaluation.guards]
    try:
        decision = decide(evaluation, plan.registry.promote_margin, plan.registry.promote_metric, guards)
    except Exception as exc:  # noqa: BLE001 - PromotionRefused before any checkpoint: the promote step says it too
        return {"promoted": False, "reason": str(exc), "metric": plan.registry.promote_metric, "guards": []}
    return decision.to_dict()


def write_outputs(evaluation: dict[str, Any], page: str, evaluation_dir: str, report_path: str) -> None:
    """``<evaluation_dir>/evaluation.json`` and the HTML report, each written whole or not at all."""
    target = Path(evaluation_dir) / "evaluation.json"
    with disk_guard(target, what="the evaluation (evaluation.json)"):
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(target, evaluation)
    with disk_guard(report_path, what="the evaluation report (HTML)"):
        atomic_write_text(report_path, page)
