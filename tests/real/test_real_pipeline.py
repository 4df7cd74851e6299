"""A shortened `make demo-real`: a real pretrained model (SmolLM2-135M-Instruct) learns the shipped made-up
facts through the whole pipeline on kfp.local, and the run shows it: the adapter's eval perplexity is below the
base's and the adapter's answer states a learned fact that the base's does not.

Shortened against the demo: fewer steps, one checkpoint, and the deploy step's check with transformers
(deploy_mode=local) instead of a vLLM server start (about two minutes here): the real-vLLM tests are
tests/serving/, and `make demo-real` serves with vLLM. Budget: under 8 minutes on an idle 2-core machine,
the model conversion included (about a minute, once per checkout: .cache/real-model)."""

from __future__ import annotations

import pytest
from llmft.pipelines.defaults import REAL_LOCAL_DEFAULTS

SHORT = {
    "max_steps": 8,
    "train_overrides": (
        "save_every=8 eval_every=8 log_every=2 keep_last=1 batch.global_sequences=4 "
        "schedule.warmup_steps=1 observe.progress_bar=false"
    ),
    "deploy_mode": "local",
}


@pytest.mark.slow
def test_a_real_model_learns_made_up_facts_through_the_pipeline(real_model_dir, tmp_path, monkeypatch):
    from llmft.pipelines.local_run import run_pipeline_locally
    from llmft.pipelines.real_demo import learning_report

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a 135M model: both cores (run-local's default of 1 suits the tiny one)
    outcome = run_pipeline_locally(
        {"model": str(real_model_dir), **SHORT}, work_dir=tmp_path / "work", extra_defaults=REAL_LOCAL_DEFAULTS
    )
    assert outcome.succeeded, outcome.render(0.0)
    lines, problems = learning_report(outcome.facts)
    print("\n".join(lines))
    assert not problems, "\n".join(lines)
