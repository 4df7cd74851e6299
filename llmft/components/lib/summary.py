"""The run summary: the one-screen text at the end of ``llmft pipeline run-local`` (and ``make demo``), and the
same facts as a Markdown artifact in the KFP UI (the ``summarize-run`` step).

:func:`collect_run_facts` reads the artifacts a kfp.local run left under its run folder
(``<pipeline_root>/<pipeline>-<timestamp>/<task>/<output>``); the summarize step builds the same dict from its
input artifacts (:data:`SOURCES` names each fact's file). :func:`summary_rows` turns the facts into labelled
rows, once: the plan (backend, where it trained), rows kept and rejected, the training curve's end points, base
vs best perplexity, each evaluation task's scores (base against the best checkpoint), the gate's decision and
reason, the serving form, the MLflow model version and alias (or why nothing was registered), the manifest, the
endpoint and a sample generation. :func:`render_summary` prints them as text, :func:`render_markdown` as a
table with a copy-paste ``curl`` for the endpoint.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

from llmft.components.lib.serving.inferenceservice import CHAT_ROUTE
from llmft.trainer.io import TRAINING_MANIFEST

# (task folder, output folder, file) of each fact source
SOURCES = {
    "plan": ("plan-run", "plan", "plan.json"),
    "data": ("prepare-dataset", "prepared", "report.json"),
    "tokens": ("tokenize-dataset", "tokenized", "manifest.json"),
    "training": ("train-model", "run", TRAINING_MANIFEST),
    "curve": ("train-model", "run", "curve.json"),
    "evaluation": ("evaluate-perplexity", "evaluation", "evaluation.json"),
    "promotion": ("promote-best-checkpoint", "promoted", "promotion.json"),
    "serving": ("choose-serving-form", "serving", "serving.json"),
    "registration": ("register-model", "registration", "registration.json"),
    "deployment": ("deploy-adapter", "deployment", "deployment.json"),
}

Row = tuple[str, str]


def latest_run_dir(pipeline_root: str | Path, pipeline_name: str) -> Path | None:
    """The newest ``<pipeline_name>-<timestamp>`` folder kfp.local created under ``pipeline_root``."""
    runs = sorted(Path(pipeline_root).glob(f"{pipeline_name}-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def collect_run_facts(run_dir: str | Path) -> dict[str, Any]:
    """Every JSON fact file the run wrote (missing ones are absent: the run stopped earlier, or the gate said no)."""
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


def where_it_trained(job: dict[str, Any]) -> str:
    """``2 workers x 8 GPUs`` / ``1 process on CPU``: never a ``1 x 0 GPU``."""
    workers, gpus = int(job.get("num_workers") or 1), int(job.get("gpus_per_worker") or 0)
    if gpus <= 0:
        return f"{workers} process{'es' if workers != 1 else ''} on CPU"
    return f"{workers} worker{'s' if workers != 1 else ''} x {gpus} GPU{'s' if gpus != 1 else ''}"


def _plan_rows(facts: dict[str, Any]) -> list[Row]:
    plan = facts.get("plan")
    if not plan:
        return []
    job = plan["job"]
    return [
        ("plan", f"run {plan['run_id']}: training {job['backend']} ({where_it_trained(job)}), image {job['image']}")
    ]


def _data_rows(facts: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    data = facts.get("data")
    if data:
        reasons = ", ".join(f"{k}: {v}" for k, v in (data.get("reject_reasons") or {}).items()) or "none"
        splits = data.get("splits") or {}
        rows += [
            (
                "data",
                f"{data['accepted']} rows accepted, {data['rejected']} rejected; format {data.get('format')}; "
                f"train {splits.get('train', 0)} / val {splits.get('val', 0)}",
            ),
            ("rejects", reasons),
        ]
    tokens = facts.get("tokens")
    if tokens:
        train = (tokens.get("splits") or {}).get("train") or {}
        rows.append(
            (
                "tokens",
                f"{train.get('sequences', 0)} sequences of <= {tokens.get('max_length')} tokens, "
                f"{float(train.get('packing_efficiency', 0)):.1%} packed, "
                f"cache {'hit' if tokens.get('cache_hit') else 'miss'} ({str(tokens.get('cache_key', ''))[:12]})",
            )
        )
    return rows


def _curve_rows(facts: dict[str, Any]) -> list[Row]:
    curve = facts.get("curve") or {}
    if "first_loss" not in curve:
        return []
    text = (
        f"loss {curve['first_loss']:.4g} (step {curve['first_step']}) -> {curve['last_loss']:.4g} "
        f"(step {curve['last_step']})"
    )
    if "last_eval_loss" in curve:
        text += f"; eval loss {curve['last_eval_loss']:.4g} (step {curve['last_eval_step']})"
    return [("training", text)]


def _evaluation_rows(facts: dict[str, Any]) -> list[Row]:
    evaluation = facts.get("evaluation")
    if not evaluation:
        return []
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    base_ppl = evaluation["base"]["perplexity"]
    gain = 1.0 - best["perplexity"] / base_ppl if base_ppl else 0.0
    rows = [
        (
            "perplexity",
            f"base {base_ppl:.2f} -> best {best['perplexity']:.2f} ({best['name']}, {gain:.1%} lower; "
            f"{_count(len(evaluation['checkpoints']), 'checkpoint')} evaluated)",
        )
    ]
    return rows + curve_rows(evaluation) + task_rows(evaluation, best)


def task_rows(evaluation: dict[str, Any], best: dict[str, Any]) -> list[Row]:
    """One row per task: base -> best checkpoint on each metric, and the task's seconds per model."""
    rows = []
    for task, base_scores in (evaluation["base"].get("tasks") or {}).items():
        tuned = (best.get("tasks") or {}).get(task) or {}
        shown = ", ".join(
            f"{name} {value:.2f}->{tuned[name]:.2f}"
            for name, value in base_scores.items()
            if name not in ("seconds", "questions") and name in tuned
        )
        count = f"n={base_scores['questions']:.0f}, " if "questions" in base_scores else ""
        rows.append((task, f"{shown} ({count}{base_scores.get('seconds', 0):.0f} s/model)"))
    return rows


def task_lines(evaluation: dict[str, Any], best: dict[str, Any]) -> list[str]:
    """:func:`task_rows` as text lines."""
    return [_line(label, text) for label, text in task_rows(evaluation, best)]


def _decision_rows(facts: dict[str, Any]) -> list[Row]:
    """The gate's decision (promote's, else the evaluate step's preview of it) and each guard's verdict."""
    promotion, evaluation = facts.get("promotion"), facts.get("evaluation") or {}
    if promotion and promotion.get("promoted", True):
        rows = [
            ("promoted", f"{promotion['checkpoint']} -> {promotion.get('destination')}"),
            ("gate", promotion["reason"]),
        ]
    elif promotion:
        rows = [("gate", f"not promoted: {promotion.get('reason', '')}")]
    elif evaluation.get("gate"):
        rows = [("gate", evaluation["gate"].get("reason", ""))]
    else:
        rows = []
    guards = (promotion or evaluation.get("gate") or {}).get("guards") or []
    return rows + [("guard", _guard_text(g)) for g in guards]


def _serving_rows(facts: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    serving = facts.get("serving")
    if serving:
        rows.append(("serving", f"{serving['form']}: {serving['reason']}"))
    registration = facts.get("registration")
    if registration is not None and registration.get("registered", True):
        uri = f" ({registration['model_uri']})" if registration.get("model_uri") else ""
        name, version = registration["model_name"], registration["version"]
        rows.append(("mlflow", f"model {name!r} version {version}{uri}; {_alias_text(registration)}"))
    elif registration is not None:
        rows.append(("mlflow", f"not registered: {registration.get('reason', '')}"))
    elif facts.get("promotion") and not facts["promotion"].get("promoted", True):
        rows.append(("mlflow", "not registered: not promoted"))
    return rows


def _guard_text(guard: dict[str, Any]) -> str:
    value, base = guard.get("value"), guard.get("base")
    shown = "missing" if value is None else f"{value:.4f}"
    against = "missing" if base is None else f"{base:.4f}"
    state = "held" if guard["held"] else "LOST"
    return f"{guard['metric']} {against}->{shown} (tolerance {guard['tolerance']:g}): {state}"


def curve_rows(evaluation: dict[str, Any]) -> list[Row]:
    """The trainer's eval perplexity at each evaluation of the run (evaluation.json ``curve``), on one row."""
    curve = evaluation.get("curve") or []
    if len(curve) < 2:
        return []
    points = ", ".join(f"{int(p['step'])}:{p['perplexity']:.2f}" for p in curve[:12])
    more = f" (+{len(curve) - 12})" if len(curve) > 12 else ""
    return [("curve", f"eval perplexity by step {_clip(points, 70)}{more}")]


def _alias_text(registration: dict[str, Any]) -> str:
    version, previous = registration["version"], registration.get("previous_champion_version")
    if not registration["is_champion"]:
        return f"alias champion stays on v{registration['champion_version']} (not beaten)"
    if previous is None:
        return "alias champion -> this version (first one)"
    if str(previous) == str(version):
        return "alias champion already on this version"
    return f"alias champion moved from v{previous} (beaten)"


def _deploy_rows(facts: dict[str, Any]) -> list[Row]:
    deployment = facts.get("deployment")
    if not deployment:
        promotion = facts.get("promotion") or {}
        return [("deploy", "skipped: not promoted")] if promotion and not promotion.get("promoted", True) else []
    checked = "validated against the CRD schema" if deployment.get("schema_validated") else "schema not checked"
    rows = [
        ("manifest", f"{facts.get('manifest_path', deployment.get('manifest'))} ({checked})"),
        ("deploy", f"{deployment.get('status')} ({deployment.get('mode')} mode){_deploy_note(deployment)}"),
    ]
    if deployment.get("url"):
        rows.append(("endpoint", f"{deployment['url']}{CHAT_ROUTE} (model {deployment.get('lora_name')!r})"))
    for sample in (deployment.get("samples") or [])[:1]:
        rows += [
            ("sample", f"prompt:  {sample['prompt']}"),
            ("", f"base:    {_said(sample['base']) if sample['base'] is not None else '(none: merged form)'}"),
            ("", f"adapter: {_said(sample['adapter'])}"),
        ]
    return rows


def _said(text: str) -> str:
    return " ".join(str(text).split()) or "(empty)"


def _deploy_note(deployment: dict[str, Any]) -> str:
    return f"; {deployment['note']}" if deployment.get("note") else ""


def summary_rows(facts: dict[str, Any]) -> list[Row]:
    """Every fact of the run, labelled, in the order the run made them."""
    return [
        *_plan_rows(facts),
        *_data_rows(facts),
        *_curve_rows(facts),
        *_evaluation_rows(facts),
        *_decision_rows(facts),
        *_serving_rows(facts),
        *_deploy_rows(facts),
    ]


def _line(label: str, text: str, width: int = 90) -> str:
    return f"{label:<11} {_clip(text, width)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


WRAPPED = {"gate": 3}
"""Rows whose text is the point of the summary: wrapped over at most this many lines, not clipped."""


def _clip(text: str, width: int = 90) -> str:
    text = re.sub(r"\s*[\r\n\t]+\s*", " ", str(text)).strip() or "(empty)"  # one line; aligned spaces stay
    return text if len(text) <= width else text[: width - 3] + "..."


def outcome_status(facts: dict[str, Any], status: str = "SUCCEEDED") -> str:
    """The header's status: a run the gate stopped says so beside SUCCEEDED."""
    promotion = facts.get("promotion") or {}
    if status == "SUCCEEDED" and promotion and not promotion.get("promoted", True):
        return "SUCCEEDED (not promoted)"
    return status


def render_summary(
    facts: dict[str, Any],
    *,
    elapsed_s: float | None = None,
    status: str = "SUCCEEDED",
    pipeline_name: str = "llm-finetune",
) -> str:
    """The summary text (about 15 lines)."""
    rule = "=" * 78
    header = f"{pipeline_name} pipeline (kfp.local): {outcome_status(facts, status)}"
    if elapsed_s is not None:
        header += f" in {elapsed_s:.0f} s"
    lines = [rule, header, rule]
    for label, text in summary_rows(facts):
        if label in WRAPPED:
            wrapped = textwrap.wrap(" ".join(text.split()), 88)
            shown = wrapped[: WRAPPED[label] - 1] + [_clip(" ".join(wrapped[WRAPPED[label] - 1 :]), 88)]
            lines += [_line(label if i == 0 else "", part, 88) for i, part in enumerate(shown) if part != "(empty)"]
        else:
            width = 80 if label == "serving" else 90
            lines.append(_line(label, text, 10_000 if "/" in text else width))  # a path, image or URL stays whole
    if facts.get("report_path"):
        lines.append(f"report      {facts['report_path']} (HTML: loss and perplexity plot)")
    lines += [f"artifacts   {facts['run_dir']}", rule]
    return "\n".join(lines)


def curl_command(facts: dict[str, Any]) -> str | None:
    """A copy-paste ``curl`` to the served model: the deployed URL, or (deploy=false, or checked only on this
    machine) the URL the InferenceService will have once its manifest is applied, read with kubectl."""
    deployment, plan = facts.get("deployment") or {}, facts.get("plan") or {}
    name = deployment.get("lora_name")
    if not name:
        return None
    asked = [s["prompt"] for s in deployment.get("samples") or [] if s.get("prompt")]
    prompt = (asked or (plan.get("serving") or {}).get("prompts") or ["Hello!"])[0]
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64})
    if deployment.get("url"):
        url = shlex.quote(deployment["url"] + CHAT_ROUTE)
    else:
        serving = plan.get("serving") or {}
        namespace = f" -n {shlex.quote(serving['namespace'])}" if serving.get("namespace") else ""
        isvc = shlex.quote(str(deployment.get("name") or serving.get("name") or name))
        url = f"\"$(kubectl get inferenceservice {isvc}{namespace} -o jsonpath='{{.status.url}}'){CHAT_ROUTE}\""
    return f"curl -sS {url} -H 'Content-Type: application/json' -d {shlex.quote(body)}"


def render_markdown(facts: dict[str, Any]) -> str:
    """The summary as Markdown for the KFP UI: the decision first, then the table, then how to call the model."""
    plan = facts.get("plan") or {}
    promotion = facts.get("promotion") or {}
    title = f"# {plan.get('pipeline', 'llm-finetune')} run {plan.get('run_id', '')}".rstrip()
    lines = [title, ""]
    if promotion:
        verdict = "promoted" if promotion.get("promoted", True) else "not promoted"
        lines += [f"**Decision: {verdict}.** {_md(promotion.get('reason', ''))}", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {_md(label) or ' '} | {_md(text)} |" for label, text in summary_rows(facts)]
    curl = curl_command(facts)
    if curl:
        deployment = facts.get("deployment") or {}
        where = "the endpoint" if deployment.get("url") else "the InferenceService, once its manifest is applied"
        lines += ["", f"Ask {where}:", "", "```bash", curl, "```"]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _deploy_lines(facts: dict[str, Any]) -> list[str]:
    """The deploy rows as text lines (what run-local prints for them)."""
    return [_line(label, text) for label, text in _deploy_rows(facts)]


def facts_from_artifacts(artifact_dirs: dict[str, str]) -> dict[str, Any]:
    """The facts dict from a step's input artifacts: fact name (a key of :data:`SOURCES`) -> the artifact's folder."""
    facts: dict[str, Any] = {"run_dir": ""}
    for name, folder in artifact_dirs.items():
        path = Path(folder) / SOURCES[name][2]
        if path.is_file():
            facts[name] = json.loads(path.read_text())
    return facts


def write_markdown_summary(artifact_dirs: dict[str, str], output: str) -> str:
    """Write :func:`render_markdown` of the artifacts' facts to ``output`` (the summarize step), print it, and
    return the decision (``promoted`` / ``not promoted``)."""
    facts = facts_from_artifacts(artifact_dirs)
    text = render_markdown(facts)
    Path(output).write_text(text, encoding="utf-8")
    print(text)
    return "promoted" if (facts.get("promotion") or {}).get("promoted") else "not promoted"
