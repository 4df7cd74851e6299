"""Checkpoints, resume and preemption with real trainer processes (`python -m llmft.trainer`)."""

from __future__ import annotations

import shutil
import signal

import pytest
import torch
from trainer_helpers import adapter_tensors, events, run_trainer, train_in_process

from llmft.trainer.io import is_complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir, tokenized_dir):
    """The reference: 6 steps with LoRA dropout on (so resuming must restore the RNG too)."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    overrides = _overrides(tiny_model_dir, tokenized_dir, out)
    result = run_trainer(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, overrides


def _overrides(model, data, out, *extra) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data={data}",
        f"output_dir={out}",
        "lora.r=4",
        "lora.alpha=8",
        "lora.dropout=0.1",
        "optim.lr=5e-3",
        "batch.global_sequences=4",
        "batch.micro_sequences=2",
        "eval.max_sequences=4",
        "observe.progress_bar=false",
        "max_steps=6",
        "save_every=2",
        "eval_every=2",
        "log_every=1",
        "keep_last=5",
        "seed=11",
        *extra,
    ]


def test_sigkill_then_resume_equals_uninterrupted_and_skips_unmarked(uninterrupted, tmp_path):
    reference, overrides = uninterrupted
    out = tmp_path / "killed"
    overrides = [o.replace(str(reference), str(out)) for o in overrides]
    killed = run_trainer([*overrides, "debug.kill_at_step=5"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-2", "step-4"] and not (out / "final").exists()
    # A newer checkpoint without its COMPLETE marker (a crash mid-commit) must be ignored.
    fake = out / "checkpoints" / "step-5"
    shutil.copytree(out / "checkpoints" / "step-4", fake)
    (fake / "COMPLETE").unlink()
    tensors = adapter_tensors(fake)
    from safetensors.torch import save_file

    save_file({k: v + 1.0 for k, v in tensors.items()}, str(fake / "adapter_model.safetensors"))

    resumed = run_trainer(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step-4" in resumed.stdout
    final, expected = adapter_tensors(out / "final"), adapter_tensors(reference / "final")
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    # the killed run's step-5 log events were dropped on resume: one event per step
    assert [e["step"] for e in events(out, "train")] == [1, 2, 3, 4, 5, 6]
    assert not fake.exists()  # uncommitted leftovers are pruned


def test_changed_config_on_resume_is_refused_with_a_diff(uninterrupted, tmp_path):
    reference, overrides = uninterrupted
    changed = run_trainer([*overrides, "optim.lr=0.001", "seed=12"])
    assert changed.returncode == 1
    assert "cannot resume" in changed.stderr
    assert "optim.lr: 0.005 -> 0.001" in changed.stderr and "seed: 11 -> 12" in changed.stderr
    assert "force_resume=true" in changed.stderr
    assert is_complete(reference / "checkpoints" / "step-6")
    # forced: resumes (at the last step, so it only re-evaluates and re-writes final/) and lists the diff
    code, stdout = train_in_process([*overrides, "optim.lr=0.001", "force_resume=true"])
    assert code == 0 and "force_resume=true: resuming although these differ" in stdout
    assert "optim.lr: 0.005 -> 0.001" in stdout and "resuming from" in stdout


def test_sigterm_commits_a_checkpoint_and_exits_143(tiny_model_dir, tokenized_dir, tmp_path):
    out = tmp_path / "preempted"
    result = run_trainer(_overrides(tiny_model_dir, tokenized_dir, out, "debug.sigterm_at_step=3"))
    assert result.returncode == 143, result.stderr[-3000:]
    stopped = "SIGTERM: checkpoint step-3 committed; exiting 143"
    assert stopped in result.stderr and stopped not in result.stdout  # issue 35: the stop's reason is on stderr
    assert is_complete(out / "checkpoints" / "step-3")  # the step in flight finished and was committed
    assert not (out / "checkpoints" / "step-4").exists() and not (out / "final").exists()
    import json

    state = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data_position"]["sequences_consumed"] == 12


def test_sigterm_on_the_last_step_completes_the_run_and_says_so(tiny_model_dir, tokenized_dir, tmp_path):
    """Issue 35: a stop signal after the output was committed stops nothing: exit 0, one line on stderr."""
    out = tmp_path / "last-step"
    result = run_trainer(_overrides(tiny_model_dir, tokenized_dir, out, "debug.sigterm_at_step=6"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"SIGTERM arrived after the run's output was committed ({out}/final)" in result.stderr
    assert (out / "final").is_dir() and "exiting 143" not in result.stderr


class _Payload:
    """A pickle that runs a shell command when it is unpickled (what a tampered file on the shared
    volume would carry)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _copy_run(reference, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(reference, out)
    return out


def test_checkpoints_hold_no_pickles_beyond_tensors_and_tampered_ones_are_refused(uninterrupted, tmp_path, capsys):
    """scheduler state and RNG are JSON; optimizer.pt and files of the earlier pickle format load with
    weights_only=True (plus NumPy's types for the old RNG files): a planted payload never runs."""
    reference, overrides = uninterrupted
    step = reference / "checkpoints" / "step-6"
    assert (step / "scheduler.json").is_file() and (step / "rng" / "rank-0.json").is_file()
    assert not (step / "scheduler.pt").exists() and not list((step / "rng").glob("*.pt"))
    marker = tmp_path / "payload-ran"
    torch.save(_Payload(marker), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)  # the payload is live when unpickled
    assert marker.exists()
    marker.unlink()
    for target, replaced in (
        ("optimizer.pt", None),
        ("scheduler.pt", "scheduler.json"),  # a checkpoint of the earlier format
        ("rng/rank-0.pt", "rng/rank-0.json"),
    ):
        out = _copy_run(reference, tmp_path, target.replace("/", "-"))
        ckpt = out / "checkpoints" / "step-6"
        if replaced:
            (ckpt / replaced).unlink()
        torch.save({"state": _Payload(marker)}, ckpt / target)
        code, _ = train_in_process([o.replace(str(reference), str(out)) for o in overrides])
        err = capsys.readouterr().err
        assert code == 1 and "refused to load" in err and target in err and "posix.system" in err, err
        assert not marker.exists(), target
        assert [line for line in err.splitlines() if "error" in line] == [err[err.index("error: ") :].strip()]


def test_checkpoint_of_the_earlier_pickle_format_still_resumes(uninterrupted, tmp_path, capsys):
    """scheduler.pt and rng/rank-<r>.pt as llmft wrote them before (torch.save of the state dict and of
    Python/NumPy/torch generator states) load through the allow-list, warning-free."""
    import json
    import random

    import numpy as np

    reference, overrides = uninterrupted
    out = _copy_run(reference, tmp_path, "legacy")
    ckpt = out / "checkpoints" / "step-6"
    torch.save(json.loads((ckpt / "scheduler.json").read_text()), ckpt / "scheduler.pt")
    (ckpt / "scheduler.json").unlink()
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        ckpt / "rng" / "rank-0.pt",
    )
    (ckpt / "rng" / "rank-0.json").unlink()
    code, stdout = train_in_process([o.replace(str(reference), str(out)) for o in overrides])
    assert code == 0, capsys.readouterr().err
    assert "resuming from" in stdout and "warning" not in stdout


def test_resume_without_a_ranks_rng_state_warns(uninterrupted, tmp_path):
    reference, overrides = uninterrupted
    out = _copy_run(reference, tmp_path, "no-rng")
    (out / "checkpoints" / "step-6" / "rng" / "rank-0.json").unlink()
    code, stdout = train_in_process([o.replace(str(reference), str(out)) for o in overrides])
    assert code == 0
    assert "warning: rank 0:" in stdout and "has no rank-0.json" in stdout and "start from the seed" in stdout


def test_force_resume_with_max_steps_below_the_checkpoint_is_a_clear_error(uninterrupted, tmp_path, capsys):
    reference, overrides = uninterrupted
    out = _copy_run(reference, tmp_path, "shorter")
    before = (out / "final" / "training_manifest.json").read_text()
    code, _ = train_in_process(
        [o.replace(str(reference), str(out)) for o in overrides] + ["max_steps=4", "force_resume=true"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "step-6 is at step 6, past this run's 4 steps" in err and "Raise max_steps" in err
    assert (out / "final" / "training_manifest.json").read_text() == before


def test_a_truncated_newest_optimizer_falls_back_to_the_older_checkpoint_and_keeps_the_bad_one(uninterrupted, tmp_path):
    """Issue 35 item 5: the corrupt step-4 is named, set aside as step-4.corrupt, and the run resumes from
    step-2 and ends where the uninterrupted run did (was exit 3, or 200: a retried permanent fault)."""
    reference, overrides = uninterrupted
    out = _copy_run(reference, tmp_path, "corrupt")
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-6")
    optimizer = out / "checkpoints" / "step-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    code, stdout = train_in_process([o.replace(str(reference), str(out)) for o in overrides])
    assert code == 0
    [warning] = [line for line in stdout.splitlines() if "warning:" in line]
    assert f"{optimizer}: truncated or corrupt" in warning and "resuming from step-2" in warning
    assert "resuming from" in stdout and f"{out / 'checkpoints' / 'step-2'} at step 2" in stdout
    assert (out / "checkpoints" / "step-4.corrupt" / "optimizer.pt").stat().st_size == 1000
    final, expected = adapter_tensors(out / "final"), adapter_tensors(reference / "final")
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
