"""The run summary (issue 44 items 2, 3 and 5): the same rows in run-local's text and the KFP UI's Markdown: the
gate's decision and reason, the MLflow version or why nothing was registered, the endpoint with a copy-paste curl,
and no placeholder such as "1 x 0 GPU"."""

from __future__ import annotations

import json
import shlex

from llmft.components.lib.serving.inferenceservice import CHAT_ROUTE
from llmft.components.lib.summary import (
    curl_command,
    render_markdown,
    render_summary,
    where_it_trained,
    write_markdown_summary,
)

REASON = (
    "best checkpoint step-2 has heldout.contains 0.0000 but must be above 0.0100 (base 0.0000 with the 0.0100 points "
    "margin): refusing to promote"
)


def _facts(**more) -> dict:
    return {
        "run_dir": "/w/kfp/run",
        "plan": {
            "pipeline": "llm-finetune",
            "run_id": "r1",
            "job": {"backend": "local", "num_workers": 1, "gpus_per_worker": 0, "image": "img:1"},
            "serving": {"prompts": [], "namespace": "team-a", "name": "chat"},
        },
        "data": {
            "accepted": 75,
            "rejected": 2,
            "reject_reasons": {"invalid_json": 2},
            "format": "messages",
            "splits": {"train": 70, "val": 5},
        },  # fmt: skip
        "curve": {
            "first_step": 2,
            "first_loss": 2.5,
            "last_step": 6,
            "last_loss": 0.25,
            "last_eval_step": 6,
            "last_eval_loss": 0.3,
            "train_points": 3,
            "eval_points": 1,
        },  # fmt: skip
        "evaluation": {
            "base": {"perplexity": 28.7, "eval_loss": 3.36, "tasks": {"heldout": {"contains": 0.0, "questions": 6.0}}},
            "best": "step-6",
            "checkpoints": [
                {
                    "name": "step-6",
                    "step": 6,
                    "perplexity": 1.05,
                    "eval_loss": 0.05,
                    "tasks": {"heldout": {"contains": 1.0, "questions": 6.0}},
                }
            ],  # fmt: skip
        },
        **more,
    }


def test_no_placeholder_claims_gpus_a_cpu_run_did_not_have():
    text = render_summary(_facts())
    assert "x 0 GPU" not in text and "training local (1 process on CPU)" in text
    assert where_it_trained({"num_workers": 2, "gpus_per_worker": 8}) == "2 workers x 8 GPUs"
    assert where_it_trained({"num_workers": 1, "gpus_per_worker": 1}) == "1 worker x 1 GPU"


def test_a_refused_gate_is_a_green_run_with_the_reason_in_both_summaries():
    facts = _facts(promotion={"promoted": False, "checkpoint": "step-2", "reason": REASON})
    text = render_summary(facts, elapsed_s=12.0)
    assert "pipeline (kfp.local): SUCCEEDED (not promoted) in 12 s" in text
    gate = [line for line in text.splitlines() if line.startswith("gate ") or line.startswith(" " * 12)]
    assert " ".join(" ".join(line.split()) for line in gate) == f"gate not promoted: {REASON}"  # wrapped, not clipped
    assert "mlflow      not registered: not promoted" in text and "deploy      skipped: not promoted" in text
    assert all(len(line) <= 100 for line in text.splitlines() if "/" not in line)
    markdown = render_markdown(facts)
    assert markdown.startswith("# llm-finetune run r1\n\n**Decision: not promoted.** " + REASON)
    assert f"| gate | not promoted: {REASON} |" in markdown and "curl" not in markdown


def test_the_markdown_names_data_curve_scores_version_and_a_curl_for_the_endpoint():
    registration = {"registered": True, "model_name": "velmora", "version": "3", "model_uri": "models:/velmora/3",
                    "is_champion": True, "previous_champion_version": "2", "champion_version": "3"}  # fmt: skip
    deployment = {"status": "deployed", "mode": "kserve", "schema_validated": True, "lora_name": "velmora",
                  "name": "chat", "url": "https://chat.team-a.example.com",
                  "samples": [{"prompt": "Who rules Velmora?", "base": "b", "adapter": "a"}]}  # fmt: skip
    facts = _facts(
        promotion={"promoted": True, "checkpoint": "step-6", "destination": "/data/models/v/r1", "reason": "beats it"},
        registration=registration,
        deployment=deployment,
    )
    markdown = render_markdown(facts)
    for row in (
        "| data | 75 rows accepted, 2 rejected; format messages; train 70 / val 5 |",
        "| training | loss 2.5 (step 2) -> 0.25 (step 6); eval loss 0.3 (step 6) |",
        "| perplexity | base 28.70 -> best 1.05 (step-6, 96.3% lower; 1 checkpoint evaluated) |",
        "| heldout | contains 0.00->1.00 (n=6, 0 s/model) |",
        "| mlflow | model 'velmora' version 3 (models:/velmora/3); alias champion moved from v2 (beaten) |",
        f"| endpoint | https://chat.team-a.example.com{CHAT_ROUTE} (model 'velmora') |",
    ):
        assert row in markdown, row
    curl = curl_command(facts)
    assert curl in markdown and markdown.index("```bash") < markdown.index(curl)
    words = shlex.split(curl)
    assert words[:3] == ["curl", "-sS", f"https://chat.team-a.example.com{CHAT_ROUTE}"]
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "velmora" and body["messages"][0]["content"] == "Who rules Velmora?"


def test_without_a_deployed_url_the_curl_reads_it_from_the_inferenceservice():
    deployment = {"status": "checked-locally", "mode": "local", "lora_name": "velmora", "name": "chat", "samples": []}
    curl = curl_command(_facts(deployment=deployment))
    assert "$(kubectl get inferenceservice chat -n team-a -o jsonpath='{.status.url}')" + CHAT_ROUTE in curl
    assert "once its manifest is applied" in render_markdown(_facts(deployment=deployment))


def test_a_run_without_mlflow_says_so_and_why_the_adapter_was_served():
    registration = {"registered": False, "reason": "no MLflow server configured (...)", "model_name": "m"}
    deployment = {"status": "checked-locally", "mode": "local", "lora_name": "m", "note": "no MLflow registry: ..."}
    text = render_summary(_facts(registration=registration, deployment=deployment))
    assert "mlflow      not registered: no MLflow server configured (...)" in text
    assert "deploy      checked-locally (local mode); no MLflow registry: ..." in text


def test_the_summarize_step_reads_the_same_facts_from_its_artifacts(tmp_path):
    facts = _facts(promotion={"promoted": False, "reason": REASON})
    folders = {}
    for name, file in (("plan", "plan.json"), ("data", "report.json"), ("evaluation", "evaluation.json"),
                       ("promotion", "promotion.json"), ("curve", "curve.json")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(json.dumps(facts[name]))
        folders[name] = str(tmp_path / name)
    out = tmp_path / "summary.md"
    assert write_markdown_summary(folders, str(out)) == "not promoted"
    assert out.read_text() == render_markdown({**facts, "run_dir": ""})
