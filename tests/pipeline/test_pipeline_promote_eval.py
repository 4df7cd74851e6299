"""Logic of the evaluate and promote steps on hand-made run directories."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest

from llmft.components.lib.evaluation.checkpoints import evaluate_run, render_html, render_markdown
from llmft.components.lib.evaluation.promote import PromotionRefused, decide, promote
from llmft.trainer.errors import DataError
from llmft.trainer.io import is_complete

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRAINER_RUN = "0123456789ab"  # the trainer's run_id (llmft/trainer/rundir.py plan_start), kept in trainer_state.json


def make_checkpoint(
    run_dir: Path, step: int, *, complete: bool = True, lora: bool = True, run_id: str | None = TRAINER_RUN
) -> Path:
    """A checkpoint laid out as llmft/trainer/checkpoint.py writes it; ``run_id=None``: no trainer_state.json."""
    path = run_dir / "checkpoints" / f"step-{step}"
    (path / "rng").mkdir(parents=True)
    if lora:
        (path / "adapter_model.safetensors").write_bytes(b"weights-%d" % step)
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    else:
        (path / "model.safetensors").write_bytes(b"full-%d" % step)
    (path / "config.json").write_text(json.dumps({"trainer": "config"}))
    (path / "optimizer.pt").write_bytes(b"optimizer")
    (path / "scheduler.pt").write_bytes(b"scheduler")
    (path / "rng" / "rank-0.pt").write_bytes(b"rng")
    if run_id is not None:
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    if complete:
        (path / "COMPLETE").write_text("ok\n")
    return path


def finish_run(run_dir: Path, run_id: str = TRAINER_RUN) -> None:
    """``final/training_manifest.json`` as the trainer writes it at the end of a run (it names the run_id)."""
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "training_manifest.json").write_text(json.dumps({"run_id": run_id, "steps": 30}))


def evaluation(base_ppl: float, *ppls: float, run_dir: Path | None = None) -> dict:
    checkpoints = [
        {
            "name": f"step-{10 * (i + 1)}",
            "step": 10 * (i + 1),
            "eval_loss": 1.0 + i,
            "perplexity": p,
            "path": str(run_dir / "checkpoints" / f"step-{10 * (i + 1)}") if run_dir else None,
        }
        for i, p in enumerate(ppls)
    ]
    best = min(checkpoints, key=lambda c: (c["perplexity"], -c["step"]))["name"]
    return {
        "split": "val",
        "base": {"name": "base", "eval_loss": 5.0, "perplexity": base_ppl},
        "checkpoints": checkpoints,
        "best": best,
    }


# ----------------------------------------------------------------------------- evaluate


def test_only_the_finished_runs_complete_checkpoints_are_evaluated(tmp_path):
    """The trainer's listing (llmft/trainer/checkpoint.py complete_checkpoints): COMPLETE marker, trainer_state.json
    and the run_id of final/training_manifest.json. A folder another run left (force_output_dir), or a
    step-N that is not the trainer's, is never loaded as this run's model."""
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20, complete=False)
    make_checkpoint(tmp_path, 30)
    make_checkpoint(tmp_path, 40, run_id="another-run")
    make_checkpoint(tmp_path, 50, run_id=None)  # a COMPLETE marker, no trainer_state.json
    (tmp_path / "checkpoints" / ".step-60.partial").mkdir()
    finish_run(tmp_path)
    seen = []

    def fake_evaluate(model_path, dataset_dir, *, adapter_path=None, split="val"):
        seen.append(adapter_path)
        return {"eval_loss": 1.0, "perplexity": 2.7}

    result = evaluate_run(tmp_path, "base", "d", evaluate_fn=fake_evaluate)
    assert [c["step"] for c in result["checkpoints"]] == [10, 30]
    assert seen == [None, str(tmp_path / "checkpoints/step-10"), str(tmp_path / "checkpoints/step-30")]


def test_a_run_that_did_not_finish_is_not_evaluated(tmp_path):
    make_checkpoint(tmp_path, 10)
    with pytest.raises(DataError, match=r"final/training_manifest.json: missing .* did not finish"):
        evaluate_run(tmp_path, "base", "d", evaluate_fn=lambda *a, **k: pytest.fail("nothing may be evaluated"))


def test_evaluate_run_scores_base_and_each_checkpoint_with_its_adapter(tmp_path):
    finish_run(tmp_path)
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20)
    make_checkpoint(tmp_path, 30, complete=False)
    calls = []

    def fake_evaluate(model_path, dataset_dir, *, adapter_path=None, split="val"):
        calls.append((model_path, adapter_path, split))
        ppl = 100.0 if adapter_path is None else 50.0 if adapter_path.endswith("step-10") else 40.0
        return {"eval_loss": math.log(ppl), "perplexity": ppl, "tokens": 123}

    result = evaluate_run(tmp_path, "base-model", "/data/tok", evaluate_fn=fake_evaluate)
    assert calls == [
        ("base-model", None, "val"),
        ("base-model", str(tmp_path / "checkpoints/step-10"), "val"),
        ("base-model", str(tmp_path / "checkpoints/step-20"), "val"),
    ]
    assert result["best"] == "step-20" and result["base"]["perplexity"] == 100.0
    assert [c["step"] for c in result["checkpoints"]] == [10, 20]


def test_full_weight_checkpoints_are_loaded_as_the_model(tmp_path):
    finish_run(tmp_path)
    make_checkpoint(tmp_path, 5, lora=False)
    seen = []
    evaluate_run(
        tmp_path,
        "base",
        "d",
        evaluate_fn=lambda m, d, adapter_path=None, split="val": (
            seen.append((m, adapter_path)) or {"eval_loss": 1.0, "perplexity": 2.7}
        ),
    )
    assert seen[1] == (str(tmp_path / "checkpoints/step-5"), None)


def test_no_complete_checkpoint_is_a_clear_error(tmp_path):
    finish_run(tmp_path)
    make_checkpoint(tmp_path, 10, complete=False)
    with pytest.raises(DataError, match="no complete checkpoint of run"):
        evaluate_run(tmp_path, "base", "d", evaluate_fn=lambda *a, **k: {})


@pytest.mark.slow
def test_report_embeds_a_real_png_plot_and_the_table(tmp_path):
    result = evaluation(80.0, 30.0, 20.0, 25.0)
    history = [{"event": "train", "step": s, "loss": 4.0 - s / 10} for s in range(1, 31)]
    html = render_html(result, history, title="Run x")
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html).group(1)
    assert base64.b64decode(png).startswith(PNG_MAGIC)
    assert "step-20 (best)" in html and "80.0000" in html
    markdown = render_markdown(result, history)
    assert "| step-20 (best) | 20 |" in markdown and "![loss and perplexity](data:image/png;base64," in markdown


# ----------------------------------------------------------------------------- promote


def test_best_checkpoint_is_chosen_by_perplexity_with_ties_to_the_later_step():
    decision = decide(evaluation(100.0, 30.0, 20.0, 20.0), margin=0.05)
    assert decision.promoted and decision.checkpoint == "step-30" and decision.perplexity == 20.0
    assert decision.improvement == pytest.approx(0.8)


def test_refuses_unless_the_base_model_is_beaten_by_the_margin():
    assert not decide(evaluation(100.0, 99.5), margin=0.01).promoted  # 0.5% better, 1% required
    assert decide(evaluation(100.0, 98.9), margin=0.01).promoted
    assert not decide(evaluation(100.0, 100.0), margin=0.0).promoted  # equal is not better
    with pytest.raises(PromotionRefused, match="out of range"):
        decide(evaluation(100.0, 50.0), margin=1.0)


def test_promote_copies_servable_files_atomically_and_records_why(tmp_path):
    run = tmp_path / "run"
    for step in (10, 20):
        make_checkpoint(run, step)
    destination = tmp_path / "models" / "m" / "run-1"
    decision = promote(evaluation(100.0, 30.0, 20.0, run_dir=run), destination, margin=0.01)
    assert decision.checkpoint == "step-20" and is_complete(destination)
    names = sorted(p.name for p in destination.iterdir())
    assert names == [
        ".llmft-owner.json",
        "COMPLETE",
        "adapter_config.json",
        "adapter_model.safetensors",
        "promotion.json",
    ]
    assert (destination / "adapter_model.safetensors").read_bytes() == b"weights-20"
    recorded = json.loads((tmp_path / "models" / "m" / "run-1.decision.json").read_text())
    assert recorded["promoted"] and "beats the required margin" in recorded["reason"]
    assert not list(destination.parent.glob(".*tmp"))  # no temp folder left behind


def test_a_refusal_writes_its_reason_and_copies_nothing(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 10)
    destination = tmp_path / "models" / "m" / "run-2"
    with pytest.raises(PromotionRefused, match="refusing to promote"):
        promote(evaluation(10.0, 9.99, run_dir=run), destination, margin=0.01)
    assert not destination.exists()
    recorded = json.loads((destination.parent / "run-2.decision.json").read_text())
    assert recorded["promoted"] is False and recorded["checkpoint"] == "step-10"


def test_a_checkpoint_without_marker_is_never_promoted(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 10, complete=False)
    with pytest.raises(PromotionRefused, match="COMPLETE"):
        promote(evaluation(100.0, 10.0, run_dir=run), tmp_path / "dest", margin=0.0)
    assert not (tmp_path / "dest").exists()


def test_full_weights_keep_their_model_config(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 10, lora=False)
    promote(evaluation(100.0, 10.0, run_dir=run), tmp_path / "dest", margin=0.0)
    assert {"model.safetensors", "config.json"} <= {p.name for p in (tmp_path / "dest").iterdir()}


def test_promote_refuses_an_adapter_vllm_cannot_serve_before_anything_is_copied(tmp_path, tiny_model_dir):
    """The servability gate runs in the promote step: an adapter the vLLM runtime would
    refuse (here rank 16 over --max-lora-rank 8) is never promoted, so never registered; the same
    adapter passes under a runtime that serves rank 16."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmft.components.lib.serving.servability import AdapterNotServableError

    run = tmp_path / "run"
    checkpoint = make_checkpoint(run, 10)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=16, lora_alpha=32))
    model.save_pretrained(checkpoint, safe_serialization=True)  # a real adapter over the stand-in files
    result = evaluation(10.0, 5.0, run_dir=run)
    with pytest.raises(AdapterNotServableError, match="max_lora_rank"):
        promote(result, tmp_path / "models" / "m" / "r1", margin=0.01, max_lora_rank=8)
    assert not (tmp_path / "models" / "m" / "r1").exists()
    decision = promote(result, tmp_path / "models" / "m" / "r1", margin=0.01, max_lora_rank=16)
    assert decision.promoted and is_complete(tmp_path / "models" / "m" / "r1")
