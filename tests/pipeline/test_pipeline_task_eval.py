"""Task evaluation (issue 36): held-out scoring, the plan's checks of promote_eval_tasks / promote_metric /
promote_eval_questions, the gate on a task metric, the best checkpoint by it, and the numbers in the report."""

from __future__ import annotations

import json

import pytest
from plan_helpers import make_plan
from test_pipeline_promote_eval import finish_run, make_checkpoint

from llmft.components.lib.contracts.metrics import best_of
from llmft.components.lib.evaluation.checkpoints import evaluate_run, kfp_metrics, render_html, render_markdown
from llmft.components.lib.evaluation.promote import PromotionRefused, decide, promote
from llmft.components.lib.evaluation.questions import Question, read_questions
from llmft.components.lib.evaluation.scoring import score_answer
from llmft.components.lib.evaluation.task_eval import parse_tasks
from llmft.components.lib.evaluation.task_plan import resolve_task
from llmft.components.lib.evaluation.task_runner import TaskRunner
from llmft.trainer.errors import ConfigError, DataError


def test_an_answer_is_scored_by_exact_match_contains_and_token_f1():
    assert score_answer("Paris.", "paris") == {"exact_match": 1.0, "contains": 1.0, "token_f1": 1.0}
    scores = score_answer("The capital is Paris", "Paris")
    assert scores["exact_match"] == 0.0 and scores["contains"] == 1.0
    # 'the' is an article (SQuAD): 1 common token of 3 answered and 1 referenced: P 1/3, R 1 -> F1 = 0.5
    assert scores["token_f1"] == pytest.approx(0.5, abs=1e-12)
    assert score_answer("Lyon", "Paris") == {"exact_match": 0.0, "contains": 0.0, "token_f1": 0.0}
    assert score_answer("", "Paris")["contains"] == 0.0


def test_the_plan_refuses_an_unknown_task_and_a_metric_no_task_computes():
    with pytest.raises(ConfigError, match="`promote_eval_tasks`: 'no_such_task' is not heldout, a shipped task"):
        make_plan(promote_eval_tasks="heldout,no_such_task")
    with pytest.raises(DataError, match="eval task 'mmlu': its datasets is not in the evaluation cache"):
        make_plan(promote_eval_tasks="heldout,mmlu")  # a registry group, but offline and not cached
    with pytest.raises(ConfigError, match="`promote_metric`='heldout.contains'"):
        make_plan(promote_eval_tasks="", promote_metric="heldout.contains")
    with pytest.raises(ConfigError, match="`promote_metric`='bleu'"):
        make_plan(promote_metric="bleu")
    with pytest.raises(ConfigError, match="promote_eval_max_questions"):
        make_plan(promote_eval_max_questions=0)
    plan = make_plan(promote_eval_tasks="heldout, heldout", promote_metric="heldout.contains")
    assert plan.evaluation.tasks == ("heldout",) and plan.registry.promote_metric == "heldout.contains"
    assert make_plan().evaluation.tasks == ("heldout",) and make_plan().registry.promote_metric == "perplexity"


def test_every_shipped_task_has_metrics_and_parse_keeps_order():
    assert parse_tasks("") == () and parse_tasks("velmora_mc, heldout,velmora_mc") == ("velmora_mc", "heldout")
    assert "token_f1" in resolve_task("heldout", "/nowhere", {}).metrics


def test_a_questions_file_with_a_wrong_schema_is_refused_in_one_line_naming_file_line_and_field(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text('{"question": "Q1?", "answer": "A1"}\n{"question": "Q2?", "reply": "A2"}\n')
    with pytest.raises(DataError) as caught:
        read_questions(path, 10)
    message = str(caught.value)
    assert "\n" not in message and f"{path}:2" in message and "`answer`" in message
    with pytest.raises(DataError, match=f"{path}:2"):  # the plan step reads it before any GPU time
        make_plan(promote_eval_questions=str(path))
    path.write_text('{"question": "Q1?", "answer": "A1", "system": "Be brief."}\n' * 5)
    questions = read_questions(path, 3)
    assert len(questions) == 3 and questions[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert make_plan(promote_eval_questions=str(path)).evaluation.questions == str(path)


def _evaluation(base: dict, **checkpoints: tuple[float, dict]) -> dict:
    entries = [
        {"name": name, "step": int(name.split("-")[1]), "path": f"/ckpt/{name}", "perplexity": ppl, "eval_loss": 1.0,
         "tasks": {"heldout": tasks}}
        for name, (ppl, tasks) in checkpoints.items()
    ]  # fmt: skip
    return {"split": "val", "base": {"name": "base", "perplexity": 50.0, "eval_loss": 3.9, "tasks": {"heldout": base}},
            "checkpoints": entries, "best": entries[0]["name"]}  # fmt: skip


def test_the_gate_refuses_an_adapter_whose_task_score_did_not_improve_though_its_perplexity_did(tmp_path):
    evaluation = _evaluation(
        {"contains": 0.5}, **{"step-10": (20.0, {"contains": 0.5}), "step-20": (10.0, {"contains": 0.25})}
    )
    assert decide(evaluation, 0.01).promoted, "perplexity alone would promote: 10 < 50 * 0.99"
    decision = decide(evaluation, 0.01, "heldout.contains")
    assert not decision.promoted and decision.checkpoint == "step-10", "best by contains; ties: lower perplexity"
    assert decision.metric == "heldout.contains" and decision.base_value == 0.5 and decision.threshold == 0.51
    assert "refusing to promote" in decision.reason and "heldout.contains" in decision.reason
    with pytest.raises(PromotionRefused, match="heldout.contains 0.5000 but must be above 0.5100"):
        promote(evaluation, tmp_path / "models" / "m" / "run", margin=0.01, metric="heldout.contains")
    recorded = json.loads((tmp_path / "models" / "m" / "run.decision.json").read_text())
    assert recorded["metric"] == "heldout.contains" and not recorded["promoted"]


def test_a_task_metric_promotes_the_checkpoint_best_by_it_not_by_perplexity():
    evaluation = _evaluation(
        {"contains": 0.0}, **{"step-10": (30.0, {"contains": 0.75}), "step-20": (10.0, {"contains": 0.5})}
    )
    decision = decide(evaluation, 0.01, "heldout.contains")
    assert decision.promoted and decision.checkpoint == "step-10" and decision.value == 0.75
    assert decision.improvement == pytest.approx(0.75) and decision.perplexity == 30.0
    with pytest.raises(PromotionRefused, match="not computed for the base"):
        decide(evaluation, 0.01, "heldout.token_f1")
    assert best_of(evaluation["checkpoints"], "perplexity")["name"] == "step-20"


class _FakeEvaluator:
    """Stands in for PerplexityEvaluator.applied: yields the adapter path as 'the model'."""

    def applied(self, model_path, adapter_path=None):
        import contextlib

        return contextlib.nullcontext(adapter_path or model_path)


def test_evaluate_run_scores_each_model_on_its_tasks_and_picks_the_best_by_the_metric(tmp_path, monkeypatch):
    run_dir = tmp_path
    for step in (10, 20):
        make_checkpoint(run_dir, step)
    finish_run(run_dir)
    answers = {"base": "no idea", "step-10": "It is Velmora", "step-20": "velmora"}
    monkeypatch.setattr(
        "llmft.components.lib.evaluation.generations.generate_answers",
        lambda model, tokenizer, prompts, **kw: [answers[model.rsplit("/", 1)[-1]]] * len(prompts),
    )
    heldout = resolve_task("heldout", "/nowhere", {})
    runner = TaskRunner(
        _FakeEvaluator(), None, (heldout,), [Question("1", [{"role": "user", "content": "Q?"}], ("Velmora",))]
    )
    ppl = {None: 50.0, "step-10": 20.0, "step-20": 30.0}

    def fake_evaluate(model_path, dataset_dir, *, adapter_path=None, split="val"):
        name = adapter_path.rsplit("/", 1)[-1] if adapter_path else None
        return {"eval_loss": 1.0, "perplexity": ppl[name], "tokens": 10}

    result = evaluate_run(run_dir, "base", "d", evaluate_fn=fake_evaluate, metric="heldout.exact_match", task_fn=runner)
    assert result["best"] == "step-20" and result["metric"] == "heldout.exact_match", "exact match beats perplexity"
    assert result["base"]["tasks"]["heldout"]["contains"] == 0.0
    assert result["checkpoints"][0]["tasks"]["heldout"]["contains"] == 1.0
    assert result["checkpoints"][0]["tasks"]["heldout"]["exact_match"] == 0.0
    result["generations"] = runner.table()
    row = result["generations"][0]
    assert row["reference"] == "Velmora" and row["answers"]["step-20"]["text"] == "velmora"
    numbers = kfp_metrics(result)
    assert numbers["base_heldout.contains"] == 0.0 and numbers["best_heldout.exact_match"] == 1.0
    assert "seconds" not in " ".join(numbers), "a task's wall time is not a score"
    page = render_html(result, [], title="t")
    assert "heldout.token_f1" in page and "Held-out questions" in page and "no idea" in page
    assert "| base | " in render_markdown(result, []) and "velmora" in render_markdown(result, [])


@pytest.fixture
def client(mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return MlflowClient(tracking_uri=mlflow_server)


@pytest.mark.slow
def test_the_champion_follows_the_promote_metric_and_the_version_carries_the_reason(client, adapter_dir):
    import dataclasses
    import uuid

    from test_pipeline_registry import registration

    from llmft.components.lib.registry.mlflow_registry import CHAMPION_ALIAS, register_adapter

    name = f"model-{uuid.uuid4().hex[:8]}"

    def scored(run_id: str, ppl: float, contains: float):
        reg = registration(name, adapter_dir, run_id, ppl)
        tags = {"llmft.promotion_reason": f"{run_id} promoted on contains"}
        return dataclasses.replace(reg, metric="heldout.contains", scores={"heldout.contains": contains}, tags=tags)

    first = register_adapter(scored("run-a", 10.0, 0.5))
    better = register_adapter(scored("run-b", 20.0, 0.75))  # worse perplexity, better task score
    lower = register_adapter(scored("run-c", 5.0, 0.25))  # the best perplexity, the worst task score
    assert first["is_champion"] and better["is_champion"] and not lower["is_champion"]
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == better["version"]
    assert "heldout.contains 0.2500 does not beat champion" in lower["alias_reason"]
    version = client.get_model_version(name, better["version"])
    assert version.tags["llmft.eval.heldout.contains"] == "0.75" and version.tags["llmft.promote_metric"] == (
        "heldout.contains"
    )
    assert version.tags["llmft.promotion_reason"] == "run-b promoted on contains"
    run = client.get_run(version.run_id)
    assert run.data.metrics["heldout.contains"] == 0.75


def test_the_run_summary_shows_each_task_base_against_the_best_and_the_gate():
    from llmft.components.lib.summary import render_summary

    heldout = {"exact_match": 0.0, "contains": 0.25, "token_f1": 0.1, "questions": 4.0, "seconds": 3.2}
    tuned = {"exact_match": 0.5, "contains": 1.0, "token_f1": 0.8, "questions": 4.0, "seconds": 3.0}
    facts = {
        "run_dir": "/w",
        "evaluation": {
            "base": {"perplexity": 50.0, "eval_loss": 3.9, "tasks": {"heldout": heldout}},
            "best": "step-4",
            "checkpoints": [
                {"name": "step-4", "step": 4, "perplexity": 40.0, "eval_loss": 3.7, "tasks": {"heldout": tuned}}
            ],
        },
        "promotion": {"checkpoint": "step-4", "destination": "/m", "reason": "step-4 has heldout.contains 1.0000"},
    }
    text = render_summary(facts)
    assert "heldout     exact_match 0.00->0.50, contains 0.25->1.00, token_f1 0.10->0.80 (n=4, 3 s/model)" in text
    assert "gate        step-4 has heldout.contains 1.0000" in text
    assert all(len(line) <= 100 for line in text.splitlines()), "one screen: the summary's lines fit 100 columns"


def _guarded(base_acc: float, **checkpoints: tuple[float, float]) -> dict:
    """Evaluation where each checkpoint has (heldout.contains, arc_easy.acc); the base (0.25, base_acc)."""
    entries = [
        {"name": name, "step": int(name.split("-")[1]), "path": f"/ckpt/{name}", "perplexity": 10.0, "eval_loss": 1.0,
         "tasks": {"heldout": {"contains": contains}, "arc_easy": {"acc": acc}}}
        for name, (contains, acc) in checkpoints.items()
    ]  # fmt: skip
    base = {"name": "base", "perplexity": 50.0, "eval_loss": 3.9,
            "tasks": {"heldout": {"contains": 0.25}, "arc_easy": {"acc": base_acc}}}  # fmt: skip
    return {"split": "val", "base": base, "checkpoints": entries, "best": entries[0]["name"]}


def test_guards_refuse_a_checkpoint_that_loses_a_guard_task():
    guards = [("arc_easy.acc", 0.02)]
    lost = _guarded(0.61, **{"step-20": (0.75, 0.58)})  # contains up 50 points, arc_easy down 3
    assert decide(lost, 0.01, "heldout.contains").promoted, "without the guard it would be promoted"
    decision = decide(lost, 0.01, "heldout.contains", guards)
    assert not decision.promoted and decision.checkpoint == "step-20"
    assert decision.reason == (
        "refusing to promote: no checkpoint keeps every guard; the best, step-20, loses arc_easy.acc 0.5800 against "
        "the base's 0.6100, beyond the tolerance 0.02 (limit 0.5900)"
    )
    (guard,) = decision.guards
    assert guard["held"] is False and guard["limit"] == pytest.approx(0.59, abs=1e-12)
    # exactly at the limit holds (>=); a checkpoint that keeps the guard is preferred to a better one that does not
    edge = _guarded(0.61, **{"step-10": (0.5, 0.59), "step-20": (0.75, 0.5)})
    chosen = decide(edge, 0.01, "heldout.contains", guards)
    assert chosen.promoted and chosen.checkpoint == "step-10" and chosen.guards[0]["held"]
    assert "guards held: arc_easy.acc 0.5900 (base 0.6100, limit 0.5900)" in chosen.reason
    missing = decide(_guarded(0.61, **{"step-10": (0.5, 0.7)}), 0.01, "heldout.contains", [("velmora_mc.acc", 0.0)])
    assert not missing.promoted and "velmora_mc.acc missing" in missing.reason, "an unmeasured guard never holds"


def test_a_perplexity_guard_is_relative_and_a_nan_never_ranks_first():
    evaluation = _guarded(0.5, **{"step-10": (0.5, 0.5), "step-20": (0.6, 0.5)})
    evaluation["checkpoints"][1]["perplexity"] = 53.0  # base 50: 6% worse
    decision = decide(evaluation, 0.01, "heldout.contains", [("perplexity", 0.05)])
    assert decision.checkpoint == "step-10", "step-20 loses perplexity beyond 5%: limit 52.5"
    evaluation["checkpoints"][1]["tasks"]["heldout"]["contains"] = float("nan")
    for order in (evaluation["checkpoints"], evaluation["checkpoints"][::-1]):
        assert best_of(order, "heldout.contains")["name"] == "step-10"
