"""The one-screen summary at the end of ``llmft pipeline run-local`` (and ``make demo``).

:func:`collect_run_facts` reads the artifacts a kfp.local run left under its run folder
(``<pipeline_root>/<pipeline>-<timestamp>/<task>/<output>``); :func:`render_summary`
turns them into a few readable lines: the plan (backend, trainer image), rows accepted and rejected, base vs best
perplexity, each evaluation task's scores (base against the best checkpoint), the promoted checkpoint and the
gate's reason, the serving form, the MLflow model version and alias, the manifest
path and a sample generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmft.trainer.io import TRAINING_MANIFEST

# (task folder, output folder, file) of each fact source
SOURCES = {
    "plan": ("plan-run", "plan", "plan.json"),
    "data": ("prepare-dataset", "prepared", "report.json"),
    "tokens": ("tokenize-dataset", "tokenized", "manifest.json"),
    "training": ("train-model", "run", TRAINING_MANIFEST),
    "evaluation": ("evaluate-perplexity", "evaluation", "evaluation.json"),
    "promotion": ("promote-best-checkpoint", "promoted", "promotion.json"),
    "serving": ("choose-serving-form", "serving", "serving.json"),
    "registration": ("register-model", "registration", "registration.json"),
    "deployment": ("deploy-adapter", "deployment", "deployment.json"),
}


def latest_run_dir(pipeline_root: str | Path, pipeline_name: str) -> Path | None:
    """The newest ``<pipeline_name>-<timestamp>`` folder kfp.local created under ``pipeline_root``."""
    runs = sorted(Path(pipeline_root).glob(f"{pipeline_name}-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def collect_run_facts(run_dir: str | Path) -> dict[str, Any]:
    """Every JSON fact file the run wrote (missing ones are absent: the run stopped earlier)."""
    run_dir = Path(run_dir)
    facts: dict[str, Any] = {"run_dir": str(run_dir)}
    for name, (task, output, filename) in SOURCES.items():
        path = run_dir / task / output / filename
        if path.is_file():
            facts[name] = json.loads(path.read_text())
    report = run_dir / "evaluate-perplexity" / "report"
    if report.is_file():
        facts["report_path"] = str(report)
    manifest = run_dir / "deploy-adapter" / "manifest" / "inferenceservice.yaml"
    if manifest.is_file():
        facts["manifest_path"] = str(manifest)
    return facts


def _plan_lines(facts: dict[str, Any]) -> list[str]:
    plan = facts.get("plan")
    if not plan:
        return []
    job = plan["job"]
    return [
        f"plan        run {plan['run_id']}: training {job['backend']} "
        f"({job['num_workers']} x {job['gpus_per_worker']} GPU), image {job['image']}"
    ]


def _data_lines(facts: dict[str, Any]) -> list[str]:
    data = facts.get("data")
    if not data:
        return []
    reasons = ", ".join(f"{k}: {v}" for k, v in (data.get("reject_reasons") or {}).items()) or "none"
    splits = data.get("splits") or {}
    lines = [
        f"data        {data['accepted']} rows accepted, {data['rejected']} rejected; format {data.get('format')}; "
        f"train {splits.get('train', '?')} / val {splits.get('val', '?')}",
        f"rejects     {reasons}",
    ]
    tokens = facts.get("tokens")
    if tokens:
        train = (tokens.get("splits") or {}).get("train") or {}
        lines.append(
            f"tokens      {train.get('sequences', '?')} sequences of <= {tokens.get('max_length')} tokens, "
            f"{float(train.get('packing_efficiency', 0)):.1%} packed, "
            f"cache {'hit' if tokens.get('cache_hit') else 'miss'} ({str(tokens.get('cache_key', ''))[:12]})"
        )
    return lines


def _model_lines(facts: dict[str, Any]) -> list[str]:
    lines = []
    evaluation = facts.get("evaluation")
    if evaluation:
        best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
        base_ppl = evaluation["base"]["perplexity"]
        gain = 1.0 - best["perplexity"] / base_ppl if base_ppl else 0.0
        lines.append(
            f"perplexity  base {base_ppl:.2f} -> best {best['perplexity']:.2f} ({best['name']}, "
            f"{gain:.1%} lower; {len(evaluation['checkpoints'])} checkpoints evaluated)"
        )
        lines += curve_lines(evaluation)
        lines += task_lines(evaluation, best)
    promotion = facts.get("promotion")
    if promotion:
        lines.append(f"promoted    {promotion['checkpoint']} -> {promotion.get('destination')}")
        lines.append(f"gate        {_clip(promotion.get('reason', ''), 88)}")
    elif evaluation and evaluation.get("gate"):
        lines.append(f"gate        {_clip(evaluation['gate'].get('reason', ''), 88)}")
    gate = (promotion or (evaluation or {}).get("gate") or {}).get("guards") or []
    lines += [f"guard       {_clip(_guard_text(g), 88)}" for g in gate]
    serving = facts.get("serving")
    if serving:
        lines.append(f"serving     {serving['form']}: {_clip(serving['reason'], 80)}")
    registration = facts.get("registration")
    if registration:
        lines.append(
            f"mlflow      model {registration['model_name']!r} version {registration['version']}; "
            f"{_alias_text(registration)}"
        )
    return lines


def task_lines(evaluation: dict[str, Any], best: dict[str, Any]) -> list[str]:
    """One line per task: base -> best checkpoint on each metric, and the task's seconds per model."""
    lines = []
    for task, base_scores in (evaluation["base"].get("tasks") or {}).items():
        tuned = (best.get("tasks") or {}).get(task) or {}
        shown = ", ".join(
            f"{name} {value:.2f}->{tuned[name]:.2f}"
            for name, value in base_scores.items()
            if name not in ("seconds", "questions") and name in tuned
        )
        count = f"n={base_scores['questions']:.0f}, " if "questions" in base_scores else ""
        lines.append(f"{task:<11} {shown} ({count}{base_scores.get('seconds', 0):.0f} s/model)")
    return lines


def _guard_text(guard: dict[str, Any]) -> str:
    value, base = guard.get("value"), guard.get("base")
    shown = "missing" if value is None else f"{value:.4f}"
    against = "missing" if base is None else f"{base:.4f}"
    state = "held" if guard["held"] else "LOST"
    return f"{guard['metric']} {against}->{shown} (tolerance {guard['tolerance']:g}): {state}"


def curve_lines(evaluation: dict[str, Any]) -> list[str]:
    """The trainer's eval perplexity at each evaluation of the run (evaluation.json ``curve``), on one line."""
    curve = evaluation.get("curve") or []
    if len(curve) < 2:
        return []
    points = ", ".join(f"{int(p['step'])}:{p['perplexity']:.2f}" for p in curve[:12])
    more = f" (+{len(curve) - 12})" if len(curve) > 12 else ""
    return [f"curve       eval perplexity by step {_clip(points, 70)}{more}"]


def _alias_text(registration: dict[str, Any]) -> str:
    version, previous = registration["version"], registration.get("previous_champion_version")
    if not registration["is_champion"]:
        return f"alias champion stays on v{registration['champion_version']} (not beaten)"
    if previous is None:
        return "alias champion -> this version (first one)"
    if str(previous) == str(version):
        return "alias champion already on this version"
    return f"alias champion moved from v{previous} (beaten)"


def _deploy_lines(facts: dict[str, Any]) -> list[str]:
    deployment = facts.get("deployment")
    if not deployment:
        return []
    checked = "validated against the CRD schema" if deployment.get("schema_validated") else "schema not checked"
    lines = [
        f"manifest    {facts.get('manifest_path', deployment.get('manifest'))} ({checked})",
        f"deploy      {deployment.get('status')} ({deployment.get('mode')} mode)",
    ]
    for sample in (deployment.get("samples") or [])[:1]:
        lines += [
            f"sample      prompt:  {sample['prompt']}",
            f"            base:    {_clip(sample['base'] if sample['base'] is not None else '(none: merged form)')}",
            f"            adapter: {_clip(sample['adapter'])}",
        ]
    return lines


def _clip(text: str, width: int = 90) -> str:
    text = " ".join(str(text).split()) or "(empty)"
    return text if len(text) <= width else text[: width - 3] + "..."


def render_summary(
    facts: dict[str, Any],
    *,
    elapsed_s: float | None = None,
    status: str = "SUCCEEDED",
    pipeline_name: str = "llm-finetune",
) -> str:
    """The summary text (about 15 lines)."""
    rule = "=" * 78
    header = f"{pipeline_name} pipeline (kfp.local): {status}"
    if elapsed_s is not None:
        header += f" in {elapsed_s:.0f} s"
    lines = [rule, header, rule, *_plan_lines(facts), *_data_lines(facts), *_model_lines(facts), *_deploy_lines(facts)]
    if facts.get("report_path"):
        lines.append(f"report      {facts['report_path']} (HTML: loss and perplexity plot)")
    lines += [f"artifacts   {facts['run_dir']}", rule]
    return "\n".join(lines)
