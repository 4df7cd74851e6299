"""The live Langfuse trace of a training run, with the real SDK talking to a recording fake server
(tests/langfuse_fake.py) over HTTP: what the trainer processes actually export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from langfuse_fake import FakeLangfuse
from trainer_helpers import REPO, clean_env, events, run_trainer

from llmft.trainer.langfuse_sink import RUN_RECORD, run_trace_id, seeded_id

pytestmark = pytest.mark.slow

STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s")


@pytest.fixture
def langfuse():
    with FakeLangfuse() as server:
        yield server


def test_a_preempted_run_resumes_into_the_same_trace_with_an_observation_per_log_step(
    langfuse, base_overrides, tmp_path
):
    env = clean_env(**langfuse.env())
    overrides = base_overrides("lf", max_steps=4, save_every=2, eval_every=2, log_every=1)
    stopped = run_trainer([*overrides, "debug.sigterm_at_step=3"], env=env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    record = json.loads((tmp_path / "lf" / RUN_RECORD).read_text())
    resumed = run_trainer(overrides, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "lf" / RUN_RECORD).read_text()) == record  # the resume kept the trace

    state = json.loads((tmp_path / "lf" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    trace_id = run_trace_id(state["run_id"])
    assert record["trace_id"] == trace_id and f"langfuse: trace {trace_id}" in resumed.stdout
    langfuse.wait_for(lambda f: len(f.scores) >= 3 and any(s.name == "finished" for s in f.spans))
    spans = langfuse.spans
    assert {s.trace_id for s in spans} == {trace_id}  # both processes, one trace

    starts = {s.name: s for s in spans if s.metadata.get("start_step") is not None}
    assert set(starts) == {"train", "resume at step 3"}
    assert starts["resume at step 3"].metadata["start_step"] == 3
    assert starts["train"].input["lora"]["r"] == 4  # the config is the trace's input
    for start in starts.values():
        assert start.attr("langfuse.internal.as_root") is True
        assert start.attr("langfuse.trace.name") == "llmft-train lf" and start.attr("session.id") == "lf"

    steps = sorted((s for s in spans if s.metadata.get("kind") == "train"), key=lambda s: s.metadata["step"])
    assert [s.name for s in steps] == ["step 1", "step 2", "step 3", "step 4"]  # one per log step, none twice
    logged = {e["step"]: e for e in events(tmp_path / "lf", "train")}
    for span in steps:
        step = span.metadata["step"]
        parent = starts["train" if step <= 3 else "resume at step 3"]
        assert span.type == "event" and span.parent_span_id == parent.span_id
        assert set(STEP_METRICS) <= set(span.output)
        assert span.output["loss"] == logged[step]["loss"]  # the numbers metrics.jsonl has

    names = [s.name for s in spans]
    assert sorted(n for n in names if n.startswith("checkpoint")) == [
        "checkpoint step-2",
        "checkpoint step-3",
        "checkpoint step-4",
    ]
    assert sorted(n for n in names if n.startswith("eval")) == ["eval step 2", "eval step 4"]
    (stop,) = [s for s in spans if s.name == "stopped"]
    assert stop.metadata["exit_code"] == 143 and stop.attr("langfuse.observation.level") == "WARNING"
    assert stop.parent_span_id == starts["train"].span_id

    manifest = json.loads((tmp_path / "lf" / "final" / "training_manifest.json").read_text())
    (finished,) = [s for s in spans if s.name == "finished"]
    assert finished.attr("langfuse.internal.as_root") is True  # its output becomes the trace's output
    assert finished.output["eval_loss"] == manifest["final_metrics"]["eval_loss"]
    scores = {s["name"]: s for s in langfuse.scores}
    assert set(scores) == {"eval_loss", "perplexity", "train_loss"}
    for name, score in scores.items():
        assert score["traceId"] == trace_id and score["value"] == manifest["final_metrics"][name]
        assert score["id"] == seeded_id(f"{trace_id}/{name}")  # a retried finish updates, never duplicates


def test_without_langfuse_keys_nothing_is_imported_and_nothing_is_sent(langfuse, base_overrides, tmp_path):
    """LANGFUSE_HOST alone (no keys): the trainer never imports the SDK and the server hears nothing."""
    overrides = base_overrides("plain", max_steps=2)
    code = (
        "import sys\n"
        "from llmft.trainer.__main__ import main\n"
        f"code = main({overrides!r})\n"
        "print('LANGFUSE_IMPORTED', 'langfuse' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    env = clean_env(LANGFUSE_HOST=langfuse.url)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LANGFUSE_IMPORTED False" in result.stdout
    said = [line for line in result.stdout.splitlines() if line.startswith("[llmft] langfuse")]
    assert said == ["[llmft] langfuse: LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY not set, no trace"]
    assert langfuse.requests == [] and not (tmp_path / "plain" / RUN_RECORD).exists()
