"""A shortened `make demo-real`: a real pretrained model (SmolLM2-135M-Instruct) learns the shipped made-up
facts through the whole pipeline on kfp.local, and the run shows it: the adapter's eval perplexity is below the
base's and the adapter's answer states a learned fact that the base's does not.

Shortened against the demo: the rows of the three facts the deploy check asks about (75 of the 200), 6 steps,
one checkpoint, and the deploy step's check with transformers (deploy_mode=local) instead of a vLLM server
start (about two minutes here): the real-vLLM tests are tests/serving/, and `make demo-real` serves with vLLM.
Budget: under 8 minutes on an idle 2-core machine, the model conversion included (about a minute, once per
checkout: .cache/real-model)."""

from __future__ import annotations

import pytest

from llmft.pipelines.defaults import REAL_LOCAL_DEFAULTS

SHORT = {
    "max_steps": 6,
    "train_overrides": (
        "save_every=6 eval_every=6 log_every=2 keep_last=1 batch.global_sequences=4 "
        "schedule.warmup_steps=1 observe.progress_bar=false"
    ),
    "deploy_mode": "local",
}


def rows_of_probed_facts() -> list[str]:
    """The shipped rows whose answer states one of the facts the deploy check asks about (DEMO_PROBES)."""
    import json

    from llmft.pipelines.defaults import DEMO_PROBES
    from llmft.trainer.data.samples import sample_path

    keywords = [keyword for _question, keyword in DEMO_PROBES]
    rows = sample_path("velmora_facts").read_text().splitlines()
    return [row for row in rows if any(k in json.loads(row)["messages"][-1]["content"] for k in keywords)]


@pytest.mark.slow
def test_a_real_model_learns_made_up_facts_through_the_pipeline(real_model_dir, tmp_path, monkeypatch):
    from llmft.pipelines.local_run import run_pipeline_locally
    from llmft.pipelines.real_demo import learning_report

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a 135M model: both cores (run-local's default of 1 suits the tiny one)
    dataset = tmp_path / "three_facts.jsonl"
    dataset.write_text("\n".join(rows_of_probed_facts()) + "\n")
    arguments = {"model": str(real_model_dir), "dataset": str(dataset), **SHORT}
    outcome = run_pipeline_locally(arguments, work_dir=tmp_path / "work", extra_defaults=REAL_LOCAL_DEFAULTS)
    assert outcome.succeeded, outcome.render(0.0)
    lines, problems = learning_report(outcome.facts)
    print("\n".join(lines))
    assert not problems, "\n".join(lines)
