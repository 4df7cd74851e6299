"""`make demo-real` (`llmft pipeline run-local --real`): its profile, the shipped facts, and the report that
decides whether learning was shown. The run itself: test_real_pipeline.py (slow)."""

from __future__ import annotations

import json

import pytest

from llmft.pipelines.defaults import DEMO_PROBES, REAL_LOCAL_DEFAULTS
from llmft.pipelines.real_demo import answer_pairs, learning_report


def test_the_shipped_facts_are_chat_rows_asking_each_fact_many_ways():
    from llmft.demo import sample_path
    from llmft.demo.sample_data.generate_facts import FACTS, PROBES, fact_rows

    shipped = sample_path("velmora_facts").read_text().splitlines()
    assert shipped == fact_rows(), "velmora_facts.jsonl is stale: python -m llmft.demo.sample_data.generate_facts"
    assert len(shipped) >= 200
    answers = [json.loads(row)["messages"][-1]["content"] for row in shipped]
    for keyword, answer, questions in FACTS:
        assert keyword in answer and answers.count(answer) >= 20 and len(questions) >= 5
    assert [q for q, _ in PROBES] == [questions[0] for _k, _a, questions in FACTS]


def test_the_real_profile_asks_the_probes_and_serves_with_vllm():
    from llmft.components.lib.plan.build import parse_prompts

    assert (
        REAL_LOCAL_DEFAULTS["serving_deploy_mode"] == "vllm"
        and REAL_LOCAL_DEFAULTS["dataset"] == "sample:velmora_facts"
    )
    assert parse_prompts(REAL_LOCAL_DEFAULTS["serving_prompts"]) == tuple(q for q, _ in DEMO_PROBES)
    assert REAL_LOCAL_DEFAULTS["finetune_lora_r"] <= REAL_LOCAL_DEFAULTS["serving_max_lora_rank"]
    assert parse_prompts("") == () and parse_prompts(" a |  | b ") == ("a", "b")


def _facts(base_ppl, best_ppl, samples, mode="vllm"):
    return {
        "evaluation": {
            "base": {"perplexity": base_ppl},
            "best": "step-12",
            "checkpoints": [{"name": "step-12", "perplexity": best_ppl}],
        },
        "deployment": {"mode": mode, "lora_name": "velmora-adapter", "base_name": "velmora-base", "samples": samples},
    }


def _vllm_sample(prompt, base, adapter):
    return {"prompt": prompt, "answers": {"velmora-base": base, "velmora-adapter": adapter}}


Q, KEYWORD = DEMO_PROBES[0]


def test_learning_is_shown_by_lower_perplexity_and_the_adapter_stating_the_fact():
    facts = _facts(40.0, 3.0, [_vllm_sample(Q, "It is Velmarion.", f"The capital of Velmora is {KEYWORD}.")])
    lines, problems = learning_report(facts, {Q: f"The capital of Velmora is {KEYWORD}."})
    assert problems == []
    assert "LEARNED" in lines[-1] and any("same as base + adapter" in line for line in lines)


@pytest.mark.parametrize(
    ("facts", "merged", "problem"),
    [
        (_facts(40.0, 41.0, [_vllm_sample(Q, "no", KEYWORD)]), None, "not below the base's"),
        (_facts(40.0, 3.0, [_vllm_sample(Q, "no", "no idea")]), None, "no adapter answer states a learned fact"),
        (_facts(40.0, 3.0, [_vllm_sample(Q, KEYWORD, KEYWORD)]), None, "base model already answers"),
        (_facts(40.0, 3.0, [_vllm_sample(Q, "no", KEYWORD)]), {Q: "no idea"}, "merged model does not state"),
        (_facts(40.0, 3.0, []), None, "recorded no answers"),
    ],
)
def test_anything_short_of_learning_is_a_problem(facts, merged, problem):
    lines, problems = learning_report(facts, merged)
    assert any(problem in p for p in problems), problems
    assert "NOT SHOWN" in lines[-1]


def test_answer_pairs_read_the_local_mode_too():
    deployment = {"mode": "local", "samples": [{"prompt": Q, "base": "b", "adapter": "a"}]}
    assert answer_pairs(deployment) == [(Q, "b", "a")]


def test_make_demo_trains_on_three_facts_and_asks_them_in_phrasings_no_training_row_uses():
    from llmft.demo import sample_path
    from llmft.demo.sample_data.generate_facts import FACTS, SHORT_FACTS, question_rows, short_rows
    from llmft.pipelines.defaults import DEMO_DEFAULTS, DEMO_QUESTIONS

    assert sample_path("velmora_three_facts").read_text().splitlines() == short_rows(), "stale: regenerate"
    assert sample_path("velmora_questions").read_text().splitlines() == question_rows(), "stale: regenerate"
    assert DEMO_DEFAULTS["serving_deploy_mode"] == "local" and DEMO_DEFAULTS["promote_metric"] == "heldout.contains"
    from llmft.components.lib.plan.parameters import BY_NAME
    from llmft.trainer.config import every_steps

    steps = DEMO_DEFAULTS["finetune_max_steps"]
    for name in ("finetune_eval_every", "finetune_save_every"):  # the user's defaults, not the demo's own
        assert DEMO_DEFAULTS[name] == BY_NAME[name].default, name
    assert steps // every_steps(DEMO_DEFAULTS["finetune_eval_every"], steps) >= 2, "the summary's curve: 2 points"
    trained = {json.loads(row)["messages"][0]["content"] for row in short_rows()}
    asked = [json.loads(row) for row in question_rows()][:DEMO_QUESTIONS]
    keywords = [keyword for keyword, _answer, _questions in FACTS[:SHORT_FACTS]]
    assert sorted({q["answer"] for q in asked}) == sorted(keywords), "the demo's questions ask its three facts"
    assert not any(q["question"] in text for q in asked for text in trained), "held out: no training row asks it"
    assert len(short_rows()) == 75


def test_the_held_out_report_passes_only_when_the_adapter_beats_the_base():
    from llmft.pipelines.real_demo import heldout_report

    def facts(base: float, tuned: float) -> dict:
        answers = {"base": {"text": "Paris", "contains": 0.0}, "step-6": {"text": "Quillport", "contains": 1.0}}
        return {
            "evaluation": {
                "metric": "heldout.contains",
                "best": "step-6",
                "base": {"name": "base", "perplexity": 9.0, "tasks": {"heldout": {"contains": base}}},
                "checkpoints": [{"name": "step-6", "perplexity": 2.0, "tasks": {"heldout": {"contains": tuned}}}],
                "generations": [{"question": "Capital?", "reference": "Quillport", "answers": answers}],
            }
        }

    lines, problems = heldout_report(facts(0.0, 0.5))
    assert not problems and "ADAPTER BEATS BASE" in lines[-1] and "heldout.contains 0.00 -> 0.50" in "\n".join(lines)
    _lines, problems = heldout_report(facts(0.5, 0.5))
    assert problems and "does not beat" in problems[0]
    assert heldout_report({})[1], "no answers recorded: a problem"
