"""`make demo`'s short profile (llmft/pipelines/defaults.py DEMO_DEFAULTS): a real pretrained model
(SmolLM2-135M-Instruct) learns three shipped made-up facts through the whole pipeline on kfp.local, and the run
shows it: the adapter's held-out score (phrasings no training row uses; the answer contains the fact) beats the
base's, which is what the promote gate followed; its eval perplexity is below the base's and the deploy step's
answer states a learned fact that the base's does not.

The profile: the rows of the three facts the deploy check asks about (75 of the 200), 6 steps evaluated and
checkpointed at the pipeline's default fractions (the summary shows the eval curve), 6 held-out questions, and
the deploy step's check with transformers (serving_deploy_mode=local) instead of a vLLM server start (the
real-vLLM tests are tests/serving/, and `make demo-real` serves with vLLM). This test IS `make demo`'s run (CI
does not run `make demo` itself). Budget: under 8 minutes on an idle 2-core machine, the model conversion
included (about a minute, once per checkout: .cache/real-model)."""

from __future__ import annotations

import os

import pytest

from llmft.pipelines.defaults import DEMO_DEFAULTS, DEMO_QUESTIONS


@pytest.mark.slow
def test_a_real_model_learns_made_up_facts_and_beats_its_base_on_held_out_questions(
    real_model_dir, tmp_path, monkeypatch
):
    from llmft.pipelines.local_run import run_pipeline_locally
    from llmft.pipelines.real_demo import heldout_report, learning_report

    # a 135M model: both cores as make demo (run-local's default of 1 suits the tiny one), or this pytest-xdist
    # worker's share of them (tests/conftest.py): two workers' threads on two cores wait on each other
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    outcome = run_pipeline_locally(
        {"base_model": str(real_model_dir)}, work_dir=tmp_path / "work", extra_defaults=DEMO_DEFAULTS
    )
    assert outcome.succeeded, outcome.render(0.0)
    lines, problems = learning_report(outcome.facts)
    heldout, heldout_problems = heldout_report(outcome.facts)
    print("\n".join(lines + heldout))
    assert not problems + heldout_problems, "\n".join(lines + heldout)
    evaluation = outcome.facts["evaluation"]
    assert evaluation["metric"] == "heldout.contains" and len(evaluation["generations"]) == DEMO_QUESTIONS
    assert outcome.facts["promotion"]["metric"] == "heldout.contains"
    assert len(evaluation["curve"]) >= 2 and "eval perplexity by step" in outcome.render(1.0)  # the default fractions
