"""The train step's loss curve for the KFP UI: an HTML page with an inline SVG (no script, no image library: the
step runs in the pipeline image), and the curve's end points for the run summary.

Read from the run directory's ``metrics.jsonl`` (the trainer's event log: ``train`` rows carry ``loss``,
``eval`` rows ``eval_loss``; a resumed run truncates what it replays, so each step appears once).
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import read_metrics_history

WIDTH, HEIGHT, MARGIN = 640, 320, 48
SERIES = (("train", "loss", "train loss", "#1f77b4"), ("eval", "eval_loss", "eval loss", "#ff7f0e"))
"""(event, key, label, colour) of each line drawn."""


def series(history: list[dict[str, Any]], event: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the rows of ``event``, finite values only, in step order."""
    points = {}
    for row in history:
        value, step = row.get(key), row.get("step")
        if row.get("event") == event and isinstance(step, int) and isinstance(value, int | float):
            if math.isfinite(value):
                points[step] = float(value)
    return sorted(points.items())


def curve_facts(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The curve's end points: first and last train loss (with their steps), last eval loss, and how many points."""
    train, evals = series(history, "train", "loss"), series(history, "eval", "eval_loss")
    facts: dict[str, Any] = {"train_points": len(train), "eval_points": len(evals)}
    if train:
        facts |= {"first_step": train[0][0], "first_loss": train[0][1]}
        facts |= {"last_step": train[-1][0], "last_loss": train[-1][1]}
    if evals:
        facts |= {"last_eval_step": evals[-1][0], "last_eval_loss": evals[-1][1]}
    return facts


def render_loss_html(run_dir: str | Path, *, title: str) -> tuple[str, dict[str, Any]]:
    """(the HTML page, :func:`curve_facts`) of the run's ``metrics.jsonl``."""
    history = read_metrics_history(Path(run_dir) / "metrics.jsonl")
    facts = curve_facts(history)
    lines = [(label, colour, series(history, event, key)) for event, key, label, colour in SERIES]
    body = (
        _svg(lines) if any(points for _, _, points in lines) else "<p>No loss was logged (metrics.jsonl is empty).</p>"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif}</style></head><body>"
        f"<h2>{html.escape(title)}</h2>{body}<p>{html.escape(_caption(facts))}</p></body></html>\n"
    )
    return page, facts


def _caption(facts: dict[str, Any]) -> str:
    if "first_loss" not in facts:
        return "No training steps logged."
    text = (
        f"Train loss {facts['first_loss']:.4g} at step {facts['first_step']} -> {facts['last_loss']:.4g} at step "
        f"{facts['last_step']} ({facts['train_points']} log steps)"
    )
    if "last_eval_loss" in facts:
        text += f"; eval loss {facts['last_eval_loss']:.4g} at step {facts['last_eval_step']}"
    return text + "."


def _svg(lines: list[tuple[str, str, list[tuple[int, float]]]]) -> str:
    points = [p for _, _, pts in lines for p in pts]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1.0)

    def at(step: int, value: float) -> tuple[float, float]:
        x = MARGIN + (step - x0) / (x1 - x0) * (WIDTH - 2 * MARGIN)
        return x, HEIGHT - MARGIN - (value - y0) / (y1 - y0) * (HEIGHT - 2 * MARGIN)

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' role='img'>",
        f"<rect x='{MARGIN}' y='{MARGIN}' width='{WIDTH - 2 * MARGIN}' height='{HEIGHT - 2 * MARGIN}' "
        "fill='none' stroke='#ccc'/>",
        f"<text x='{MARGIN}' y='{MARGIN - 8}' font-size='11'>loss {y1:.4g}</text>",
        f"<text x='{MARGIN}' y='{HEIGHT - MARGIN + 14}' font-size='11'>{y0:.4g} (step {x0})</text>",
        f"<text x='{WIDTH - MARGIN}' y='{HEIGHT - MARGIN + 14}' font-size='11' text-anchor='end'>step {x1}</text>",
    ]
    for i, (label, colour, pts) in enumerate(lines):
        xy = [at(step, value) for step, value in pts]
        if xy:
            joined = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='{joined}'/>")
            parts += [f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{colour}'/>" for x, y in xy[:50]]
        parts.append(
            f"<text x='{WIDTH - MARGIN - 4}' y='{MARGIN + 16 + 14 * i}' font-size='12' text-anchor='end' "
            f"fill='{colour}'>{html.escape(label)}</text>"
        )
    return "".join(parts) + "</svg>"
