"""What ``llmft pipeline run-local --real`` (``make demo-real``) shows after the run: that the adapter learned.

A real pretrained model (SmolLM2-135M-Instruct) is fine-tuned on made-up facts about Velmora
(llmft/demo/sample_data/generate_facts.py) by the whole pipeline. :func:`learning_report` reads the
run's facts (llmft/components/lib/summary.py) and says, in a few lines:

* the eval perplexity of the best checkpoint against the base's (held-out rows ask the same facts in other
  words);
* each probe question's answer by the base and by base + adapter, as the deploy step's server gave them
  (``serving_deploy_mode=vllm``: a real vLLM; ``local``: transformers), and whether it contains the learned fact;
* with the merged model's answers (the merged form served alone), whether they say what base + adapter said.

Learning is shown when the perplexity fell, at least one adapter answer states its fact, and no base answer
does; otherwise the report's problems say what is missing and the command exits 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import beats, metric_value, task_scores
from llmft.components.lib.contracts.schema import read_plan
from llmft.components.lib.evaluation.checkpoints import generation_rows
from llmft.components.lib.serving.deployment import deploy_promoted, plan_deploy_request
from llmft.components.lib.serving.serving_form import merged_model
from llmft.pipelines.defaults import DEMO_PROBES


def answer_pairs(deployment: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(prompt, base answer, adapter answer) of each prompt the deploy step asked (deployment.json): ``samples``
    of the local mode (``base`` / ``adapter``) or of the vLLM mode (``answers`` by served name: ``base_name``,
    ``lora_name``; the merged form has no base)."""
    pairs = []
    adapter, base = deployment.get("lora_name"), deployment.get("base_name")
    for sample in deployment.get("samples") or []:
        answers = sample.get("answers")
        if isinstance(answers, dict):
            pairs.append((sample["prompt"], str(answers.get(base, "")), str(answers.get(adapter, ""))))
        else:
            pairs.append((sample["prompt"], str(sample.get("base", "")), str(sample.get("adapter", ""))))
    return pairs


def keyword_for(prompt: str) -> str | None:
    return next((keyword for question, keyword in DEMO_PROBES if question == prompt), None)


def _has(text: str, keyword: str | None) -> bool:
    return bool(keyword) and str(keyword).lower() in text.lower()


def learning_report(facts: dict[str, Any], merged_answers: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(lines to print, problems): perplexity, then each probe's base / adapter (/ merged) answer."""
    lines, problems = ["", "Did it learn? (made-up facts about Velmora, which the base model cannot know)"], []
    evaluation = facts.get("evaluation")
    if evaluation:
        best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
        base_ppl, best_ppl = evaluation["base"]["perplexity"], best["perplexity"]
        lines.append(f"  eval perplexity (held-out rows): base {base_ppl:.2f} -> adapter {best_ppl:.2f}")
        if not best_ppl < base_ppl:
            problems.append(f"the adapter's eval perplexity {best_ppl:.2f} is not below the base's {base_ppl:.2f}")
    else:
        problems.append("no evaluation.json: the run stopped before the evaluate step")
    deployment = facts.get("deployment") or {}
    pairs = answer_pairs(deployment)
    if not pairs:
        problems.append("the deploy step recorded no answers")
    server = "vLLM" if deployment.get("mode") == "vllm" else str(deployment.get("mode") or "?")
    learned = 0
    for prompt, base, adapter in pairs:
        keyword = keyword_for(prompt)
        mark = "learned" if _has(adapter, keyword) else "not learned"
        learned += _has(adapter, keyword)
        lines += [
            f"  Q: {prompt}   (fact: {keyword})",
            f"     base ({server}):    {base.strip()!r}",
            f"     adapter ({server}): {adapter.strip()!r}  [{mark}]",
        ]
        if merged_answers is not None:
            merged = merged_answers.get(prompt, "")
            same = "same as base + adapter" if merged.strip() == adapter.strip() else "differs from base + adapter"
            lines.append(f"     merged alone:     {merged.strip()!r}  [{same}]")
            if not _has(merged, keyword) and _has(adapter, keyword):
                problems.append(f"the merged model does not state what base + adapter learned for {prompt!r}")
        if _has(base, keyword):
            problems.append(f"the base model already answers {prompt!r} with {keyword!r}: not a made-up fact")
    if pairs and not learned:
        problems.append("no adapter answer states a learned fact")
    lines.append("  verdict: LEARNED" if not problems else "  verdict: NOT SHOWN: " + "; ".join(problems))
    return lines, problems


def heldout_report(facts: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(lines, problems): the evaluate step's held-out questions, base against the promoted checkpoint (the
    per-question table of evaluation.json), and whether the adapter's score on the promote metric beats the
    base's (``make demo``'s verdict; the promote gate already refused a run where it did not)."""
    evaluation = facts.get("evaluation") or {}
    rows = generation_rows(evaluation) if evaluation.get("checkpoints") else []
    if not rows:
        return [], ["the evaluate step recorded no held-out answers (promote_eval_tasks lacks heldout?)"]
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    metric = str(evaluation.get("metric", "perplexity"))
    lines = ["", f"Held-out questions (phrasings no training row uses), base against {best['name']}:"]
    for question, reference, base, adapter, marks in rows:
        lines += [f"  Q: {question}   (reference: {reference})", f"     base:    {base.strip()!r}"]
        lines += [f"     adapter: {adapter.strip()!r}   [{marks}]"]
    scores = [(n, v, task_scores(best).get(n)) for n, v in task_scores(evaluation["base"]).items()]
    lines.append("  scores: " + ", ".join(f"{n} {v:.2f} -> {t:.2f}" for n, v, t in scores if t is not None))
    base_value, value = metric_value(evaluation["base"], metric), metric_value(best, metric)
    problems = []
    if base_value is None or value is None or not beats(value, base_value, metric, 0.0):
        problems.append(f"the adapter's {metric} ({value}) does not beat the base's ({base_value})")
    lines.append("  verdict: " + ("ADAPTER BEATS BASE" if not problems else "NOT SHOWN: " + "; ".join(problems)))
    return lines, problems


def merged_answers(run_dir: str | Path, facts: dict[str, Any]) -> dict[str, str]:
    """prompt -> the merged model's answer, served alone the way the deploy step serves the merged form.

    The run served base + adapter (form lora); here the promoted adapter is merged into its base
    (:func:`llmft.components.lib.serving.serving_form.merged_model`, ``llmft export --merge``) at the plan's
    ``merged_dir`` and deployed with the run's deploy mode as form ``merged`` (serving_deploy_mode=vllm: a second
    vLLM server with the merged model as the one served name)."""

    plan = read_plan(Path(run_dir) / "plan-run" / "plan")
    adapter_dir = str(facts["promotion"]["destination"])
    merged_model(adapter_dir, plan.serving.merged_dir)
    request = plan_deploy_request(  # the deploy step's own request, serving the merged form
        plan,
        adapter_dir=adapter_dir,
        registered=facts["registration"],
        form="merged",
        model_dir=plan.serving.merged_dir,
        form_reason="make demo-real: the merged form served alone, beside the run's LoRA form",
    )
    request = dataclasses.replace(request, deploy=True, is_champion=True)  # served whatever the run's policy said
    manifest = Path(run_dir) / "demo-real-merged" / "inferenceservice.yaml"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    result = deploy_promoted(request, manifest_path=manifest)
    return {prompt: adapter for prompt, _base, adapter in answer_pairs(result)}
