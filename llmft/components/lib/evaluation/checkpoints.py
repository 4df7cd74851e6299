"""Evaluate every complete checkpoint of a run, and the base model, on the validation split.

:func:`evaluate_run` is the logic of the `evaluate-perplexity` step: it lists the run's
checkpoints with the trainer's own listing (:func:`llmft.trainer.checkpoint.complete_checkpoints`:
``checkpoints/step-N`` with its COMPLETE marker and ``trainer_state.json``, of the run_id that
``final/training_manifest.json`` names; a half-written checkpoint, or one another run left in the
folder, is never loaded), evaluates the base model and each checkpoint with the trainer's own
:class:`llmft.trainer.evaluate.PerplexityEvaluator` (so the numbers match what the trainer logs;
the base loads once for all adapters),
and returns one JSON-able dict that the promote step reads.

:func:`render_html` / :func:`render_markdown` turn that dict plus the run's
``metrics.jsonl`` into a report with an embedded loss/perplexity plot (a base64 PNG
drawn with matplotlib), shown by the KFP UI as the step's visualization, with links to the
Langfuse comparison of the models' answers when the evaluate step recorded one
(llmft/components/lib/evaluation/comparison.py: the ``langfuse`` section of the evaluation).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import PERPLEXITY, best_of, task_scores
from llmft.trainer.config import ModelConfig
from llmft.trainer.errors import DataError

ADAPTER_CONFIG = "adapter_config.json"


def base_evaluator(model: ModelConfig):
    """A :class:`~llmft.trainer.evaluate.PerplexityEvaluator` that loads the base as the trainer loaded it:
    the run's ``model.revision`` and ``model.trust_remote_code``."""
    from llmft.trainer.evaluate import PerplexityEvaluator  # heavy: torch

    return PerplexityEvaluator(revision=model.revision or None, trust_remote_code=model.trust_remote_code)


def adapter_dir(checkpoint: Path) -> Path | None:
    """Where the PEFT adapter of a checkpoint lives (the folder itself or ``adapter/``), or None for full weights."""
    for candidate in (checkpoint, checkpoint / "adapter"):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    return None


def evaluate_run(
    run_dir: str | Path,
    base_model: str,
    dataset_dir: str | Path,
    *,
    split: str = "val",
    evaluate_fn: Callable[..., dict[str, Any]] | None = None,
    metric: str = PERPLEXITY,
    task_fn: Callable[..., dict[str, dict[str, float]]] | None = None,
    **eval_kwargs: Any,
) -> dict[str, Any]:
    """Evaluate the base model and every complete checkpoint; return the evaluation dict.

    ``task_fn(label, model_path, adapter_path)`` (llmft/components/lib/evaluation/task_runner.py TaskRunner) scores the
    selected tasks of each model (its ``tasks`` entry); the best checkpoint is the best by ``metric``
    (contracts.metrics.best_of: ties go to the lower perplexity, then the later step)."""
    from llmft.trainer.checkpoint import complete_checkpoints, finished_run_id  # heavy: torch

    run_id = finished_run_id(run_dir)
    checkpoints = complete_checkpoints(run_dir, run_id)
    if not checkpoints:
        raise DataError(
            f"{run_dir}/checkpoints holds no complete checkpoint of run {run_id} (step-N with a COMPLETE marker and "
            "trainer_state.json): did the training step finish? Check its logs."
        )
    if evaluate_fn is None:
        from llmft.trainer.evaluate import PerplexityEvaluator  # heavy: torch

        evaluate_fn = PerplexityEvaluator()  # the base loads once for itself and every adapter
    base = {
        "name": "base",
        "path": base_model,
        **_numbers(evaluate_fn(base_model, str(dataset_dir), split=split, **eval_kwargs)),
    }
    if task_fn is not None:
        base["tasks"] = task_fn("base", base_model, None)
    results = []
    for step, path in checkpoints:
        adapter = adapter_dir(path)
        model_path, adapter_path = (base_model, str(adapter)) if adapter is not None else (str(path), None)
        metrics = evaluate_fn(model_path, str(dataset_dir), adapter_path=adapter_path, split=split, **eval_kwargs)
        result = {"name": path.name, "step": step, "path": str(path), **_numbers(metrics)}
        if task_fn is not None:
            result["tasks"] = task_fn(path.name, model_path, adapter_path)
        results.append(result)
        print(
            f"evaluated {path.name}: eval_loss={metrics['eval_loss']:.4f} perplexity={metrics['perplexity']:.4f}",
            flush=True,
        )
    best = best_of(results, metric)
    return {"split": split, "base": base, "checkpoints": results, "best": best["name"], "metric": metric}


def kfp_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """The evaluate step's KFP metrics: base and best eval loss, perplexity and every task metric."""
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    out = {"best_step": float(best["step"])}
    for label, result in (("base", evaluation["base"]), ("best", best)):
        out[f"{label}_eval_loss"] = float(result["eval_loss"])
        out[f"{label}_perplexity"] = float(result["perplexity"])
        out |= {f"{label}_{name}": value for name, value in task_scores(result).items()}
    gate = evaluation.get("gate") or {}
    if gate:
        out["gate_promoted"] = float(bool(gate.get("promoted")))
        for guard in gate.get("guards") or []:
            if guard.get("value") is not None:
                out[f"guard_{guard['metric']}"] = float(guard["value"])
            out[f"guard_{guard['metric']}_held"] = float(bool(guard.get("held")))
    return out


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: float(metrics[k]) for k in ("eval_loss", "perplexity") if k in metrics}
    if "tokens" in metrics:
        out["tokens"] = int(metrics["tokens"])
    return out


def eval_curve(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """``[{step, eval_loss, perplexity}]`` of the trainer's evaluations (metrics.jsonl ``event: eval`` rows), the
    last row of a step winning (a resumed run evaluates a step again)."""
    points: dict[int, dict[str, float]] = {}
    for row in history:
        loss, step = row.get("eval_loss"), row.get("step")
        if row.get("event") == "eval" and isinstance(step, int | float) and isinstance(loss, int | float):
            if math.isfinite(loss):
                points[int(step)] = {"step": int(step), "eval_loss": float(loss), "perplexity": math.exp(min(loss, 50))}
    return [points[k] for k in sorted(points)]


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in history:
        if row.get("event", "train") != "train":
            continue
        value, step = row.get(key), row.get("step")
        if isinstance(value, int | float) and isinstance(step, int | float) and math.isfinite(value):
            steps.append(int(step))
            values.append(float(value))
    return steps, values


def plot_png(evaluation: dict[str, Any], history: list[dict[str, Any]]) -> bytes:
    """Two panels: training/eval loss by step, and eval perplexity per checkpoint vs the base model."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    steps, losses = _series(history, "loss")
    if steps:
        ax_loss.plot(steps, losses, label="train loss", color="tab:blue", linewidth=1)
    ckpt_steps = [c["step"] for c in evaluation["checkpoints"]]
    ax_loss.plot(
        ckpt_steps, [c["eval_loss"] for c in evaluation["checkpoints"]], "o-", color="tab:orange", label="eval loss"
    )
    ax_loss.axhline(evaluation["base"]["eval_loss"], color="gray", linestyle="--", label="base eval loss")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_loss.legend(fontsize=8)
    ax_ppl.plot(
        ckpt_steps, [c["perplexity"] for c in evaluation["checkpoints"]], "o-", color="tab:green", label="checkpoint"
    )
    ax_ppl.axhline(evaluation["base"]["perplexity"], color="gray", linestyle="--", label="base model")
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    ax_ppl.plot(
        [best["step"]], [best["perplexity"]], "*", markersize=14, color="tab:red", label=f"best ({best['name']})"
    )
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="Eval perplexity", yscale="log")
    ax_ppl.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _table_rows(evaluation: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = [("base", "-", f"{evaluation['base']['eval_loss']:.4f}", f"{evaluation['base']['perplexity']:.4f}")]
    for c in evaluation["checkpoints"]:
        name = c["name"] + (" (best)" if c["name"] == evaluation["best"] else "")
        rows.append((name, str(c["step"]), f"{c['eval_loss']:.4f}", f"{c['perplexity']:.4f}"))
    return rows


def render_html(evaluation: dict[str, Any], history: list[dict[str, Any]], *, title: str = "Evaluation") -> str:
    """A self-contained HTML page: the plot (inline PNG) and the table of checkpoints."""
    png = base64.b64encode(plot_png(evaluation, history)).decode()
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in _table_rows(evaluation)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px "
        "8px}</style>"
        f"</head><body><h2>{html.escape(title)}</h2>"
        f"<p>Split: {html.escape(evaluation['split'])}. Best checkpoint: <b>{html.escape(evaluation['best'])}</b>.</p>"
        f"<img alt='loss and perplexity' src='data:image/png;base64,{png}'/>"
        "<table><tr><th>model</th><th>step</th><th>eval loss</th><th>perplexity</th></tr>"
        f"{cells}</table>{_tasks_html(evaluation)}{_gate_html(evaluation)}{_generations_html(evaluation)}"
        f"{_langfuse_html(evaluation)}"
        "</body></html>\n"
    )


def _task_rows(evaluation: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(metric names, one row per model: name then each metric's value) of the models' task scores."""
    models = [evaluation["base"], *evaluation["checkpoints"]]
    names = sorted({name for m in models for name in task_scores(m)})
    rows = []
    for model in models:
        scores = task_scores(model)
        seconds = sum(float(t.get("seconds", 0.0)) for t in (model.get("tasks") or {}).values())
        label = model["name"] + (" (best)" if model["name"] == evaluation["best"] else "")
        rows.append([label, *(f"{scores[n]:.4f}" if n in scores else "-" for n in names), f"{seconds:.1f}"])
    return names, rows


def _tasks_html(evaluation: dict[str, Any]) -> str:
    names, rows = _task_rows(evaluation)
    if not names:
        return ""
    head = "".join(f"<th>{html.escape(n)}</th>" for n in ["model", *names, "task seconds"])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
    metric = html.escape(str(evaluation.get("metric", "perplexity")))
    return (
        f"<h3>Tasks, base against each checkpoint (promote metric: {metric})</h3><table><tr>{head}</tr>{body}</table>"
    )


def gate_lines(evaluation: dict[str, Any]) -> list[str]:
    """The gate's verdict and its reason, then one line per guard (its base, value and limit)."""
    gate = evaluation.get("gate") or {}
    if not gate:
        return []
    verdict = "promote" if gate.get("promoted") else "refuse"
    lines = [f"{verdict}: {gate.get('reason', '')}"]
    for g in gate.get("guards") or []:
        value = "missing" if g.get("value") is None else f"{g['value']:.4f}"
        base = "missing" if g.get("base") is None else f"{g['base']:.4f}"
        limit = "-" if g.get("limit") is None else f"{g['limit']:.4f}"
        state = "held" if g.get("held") else "LOST"
        lines.append(
            f"guard {g['metric']}: {value} vs base {base} (limit {limit}, tolerance {g['tolerance']:g}): {state}"
        )
    return lines


def _gate_html(evaluation: dict[str, Any]) -> str:
    lines = gate_lines(evaluation)
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines[1:])
    return f"<h3>Promotion gate</h3><p><b>{html.escape(lines[0])}</b></p><ul>{items}</ul>"


def generation_rows(evaluation: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(question, reference, base answer, best checkpoint's answer, their contains / exact match) per question."""
    best = evaluation["best"]
    rows = []
    for row in evaluation.get("generations") or []:
        base, tuned = row["answers"].get("base") or {}, row["answers"].get(best) or {}
        marks = " / ".join(
            f"{label} {'contains' if a.get('contains') else '-'}{', exact' if a.get('exact_match') else ''}"
            for label, a in (("base", base), ("adapter", tuned))
        )
        rows.append((row["question"], row["reference"], base.get("text", ""), tuned.get("text", ""), marks))
    return rows


def _generations_html(evaluation: dict[str, Any]) -> str:
    rows = generation_rows(evaluation)
    if not rows:
        return ""
    head = "".join(
        f"<th>{h}</th>" for h in ("question", "reference", "base", html.escape(evaluation["best"]), "scores")
    )
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<h3>Held-out questions, answered greedily</h3><table><tr>{head}</tr>{body}</table>"


def _langfuse_html(evaluation: dict[str, Any]) -> str:
    """The Langfuse dataset runs of the answer comparison, linked where the server gave a URL."""
    section = evaluation.get("langfuse") or {}
    if not section.get("runs"):
        return ""
    rows = []
    for label, run in section["runs"].items():
        name = html.escape(run["run_name"])
        link = f"<a href='{html.escape(run['url'])}'>{name}</a>" if run.get("url") else name
        rows.append(f"<li>{html.escape(label)}: {link}</li>")
    dataset = html.escape(section.get("dataset", ""))
    return f"<h3>Answers compared in Langfuse (dataset {dataset})</h3><ul>{''.join(rows)}</ul>"


def render_markdown(evaluation: dict[str, Any], history: list[dict[str, Any]], *, title: str = "Evaluation") -> str:
    """The same report as Markdown (for notebooks and the KFP Markdown viewer)."""
    png = base64.b64encode(plot_png(evaluation, history)).decode()
    lines = [
        f"## {title}",
        "",
        f"Split: `{evaluation['split']}`. Best checkpoint: **{evaluation['best']}**.",
        "",
        f"![loss and perplexity](data:image/png;base64,{png})",
        "",
        "| model | step | eval loss | perplexity |",
        "|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in _table_rows(evaluation)]
    names, rows = _task_rows(evaluation)
    if names:
        lines += ["", f"| model | {' | '.join(names)} | task seconds |", "|---" * (len(names) + 2) + "|"]
        lines += [f"| {' | '.join(row)} |" for row in rows]
    gate = gate_lines(evaluation)
    if gate:
        lines += ["", f"**Promotion gate**: {gate[0]}", *(f"- {line}" for line in gate[1:])]
    generations = generation_rows(evaluation)
    if generations:
        lines += ["", f"| question | reference | base | {evaluation['best']} | scores |", "|---|---|---|---|---|"]
        lines += [f"| {' | '.join(v.replace('|', '/').replace(chr(10), ' ') for v in row)} |" for row in generations]
    return "\n".join(lines) + "\n"
