"""What the trainer may touch and when it may start: output_dir ownership, no mixing of runs,
pruning only this run's checkpoints, training without a validation split, the restart budget,
one-line errors for a missing model, Ctrl-C, and the epoch it records."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from trainer_helpers import REPO, clean_env, events, run_trainer, train_in_process

from llmft.trainer import rundir
from llmft.trainer.io import is_complete

pytestmark = pytest.mark.slow


def _tree(path):
    """Every file under ``path`` with its bytes: what "left untouched" means."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_unrelated_output_dir_is_refused_and_left_untouched(base_overrides, tmp_path, capsys):
    precious = tmp_path / "precious"
    (precious / "final").mkdir(parents=True)
    (precious / "final" / "thesis.pdf").write_bytes(b"years of work")
    (precious / "checkpoints" / "step-9").mkdir(parents=True)
    (precious / "checkpoints" / "step-9" / "COMPLETE").write_text("ok\n")  # looks like ours, is not
    (precious / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = _tree(precious)
    code, _ = train_in_process(base_overrides("precious", max_steps=2))
    err = capsys.readouterr().err
    assert code == 1 and "not written by an llmft training run" in err and "force_output_dir=true" in err
    assert len(err.strip().splitlines()) == 1 and _tree(precious) == before
    # forced: the run writes its own files beside; it never prunes or reuses the foreign step-9, and
    # the foreign final/ is kept under another name rather than replaced
    code, stdout = train_in_process(
        base_overrides("precious", max_steps=2, save_every=1, keep_last=1, force_output_dir="true")
    )
    assert code == 0
    (kept,) = precious.glob("final.kept-*")
    assert (kept / "thesis.pdf").read_bytes() == b"years of work" and f"kept as {kept}" in stdout
    assert (precious / "checkpoints" / "step-9" / "COMPLETE").is_file()
    assert (precious / "final" / "training_manifest.json").is_file()
    assert rundir.owner_kind(precious) == rundir.RUN_KIND


def test_a_launchers_log_file_alone_does_not_make_a_directory_foreign(base_overrides, tmp_path):
    (tmp_path / "logged").mkdir()
    (tmp_path / "logged" / "train.log").write_text("starting\n")  # the pipeline's local backend writes it first
    code, _ = train_in_process(base_overrides("logged", max_steps=1))
    assert code == 0 and (tmp_path / "logged" / "final").is_dir()


def test_resume_never_in_a_used_run_directory_is_refused(base_overrides, tmp_path, capsys):
    assert train_in_process(base_overrides("used", max_steps=2, save_every=1, keep_last=5))[0] == 0
    before = _tree(tmp_path / "used")
    code, _ = train_in_process(base_overrides("used", max_steps=2, resume="never"))
    err = capsys.readouterr().err
    assert code == 1 and "resume=never would mix a new run with it" in err and "new output_dir" in err
    assert _tree(tmp_path / "used") == before


def test_pruning_touches_only_this_runs_checkpoints(tmp_path):
    from llmft.trainer import checkpoint as ckpt

    def make(step, run_id, complete=True):
        path = tmp_path / "checkpoints" / f"step-{step}"
        path.mkdir(parents=True)
        (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step, "run_id": run_id}))
        if complete:
            (path / "COMPLETE").write_text("ok\n")
        return path

    mine = [make(s, "mine") for s in (1, 2, 3)]
    theirs = [make(s, "theirs") for s in (10, 20)] + [make(30, "theirs", complete=False)]
    leftover = make(4, "mine", complete=False)
    removed = ckpt.prune_checkpoints(tmp_path, keep_last=1, best_step=1, run_id="mine")
    assert sorted(removed) == sorted([mine[1], leftover])
    assert all(p.is_dir() for p in (mine[0], mine[2], *theirs))
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path, "mine")] == [1, 3]


@pytest.fixture(scope="module")
def no_val_dir(tmp_path_factory, tiny_model_dir):
    """The shipped sample prepared with --val-fraction 0: an empty validation split."""
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("no-val")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared", val_fraction=0.0)
    tokenize_dataset(root / "prepared", str(tiny_model_dir), root / "tok", max_length=128, pack=True, num_proc=1)
    return root / "tok"


def test_no_validation_split_trains_without_evaluation_and_saves(base_overrides, no_val_dir, tmp_path):
    code, stdout = train_in_process(base_overrides("noval", data=no_val_dir, max_steps=2, eval_every=1))
    assert code == 0, stdout
    assert "training WITHOUT evaluation" in stdout and "eval_loss=" not in stdout
    manifest = json.loads((tmp_path / "noval" / "final" / "training_manifest.json").read_text())
    assert "--val-fraction 0" in manifest["evaluation"] and manifest["final_metrics"]["eval_loss"] is None
    assert is_complete(tmp_path / "noval" / "checkpoints" / "step-2") and not events(tmp_path / "noval", "eval")


def test_restart_budget_stops_a_crash_loop_before_its_first_checkpoint(base_overrides, tmp_path):
    """Real processes SIGKILLed after step 1 (before any checkpoint), as a pod OOM-killed and
    recreated by the ExitCode policy: the start after max_restarts_without_progress exits 1."""
    crash = base_overrides("loop", max_steps=4, save_every=2, max_restarts_without_progress=1)
    counter = tmp_path / "loop" / rundir.RESTARTS_FILE
    for attempt in range(2):  # the first start and one restart die
        killed = run_trainer([*crash, "debug.kill_at_step=1"])
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        record = json.loads(counter.read_text())
        assert record["starts_without_progress"] == attempt and record["outcome"] == "running"
    refused = run_trainer([*crash, "debug.kill_at_step=1"])
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert str(counter) in line and "2 starts in a row" in line and f"delete {counter}" in line
    assert not (tmp_path / "loop" / "checkpoints").exists()
    counter.unlink()  # the documented way out, once the cause is fixed
    fixed = run_trainer(crash)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert json.loads(counter.read_text())["outcome"] == 0


def test_restart_budget_counts_only_retryable_deaths_without_progress(tmp_path):
    def record(count, step, outcome):
        rundir._write_restarts(tmp_path, count, step, outcome)

    record(0, 0, "running")
    assert rundir.restarts_before(tmp_path, 3) == 1  # died unrecorded (SIGKILL, OOM kill, abort)
    record(3, 0, 143)
    with pytest.raises(rundir.ConfigError, match="4 starts in a row"):
        rundir.restarts_before(tmp_path, 3)
    assert rundir.restarts_before(tmp_path, 0) == 4  # 0 = no limit
    record(3, 0, 1)
    assert rundir.restarts_before(tmp_path, 3) == 0  # exit 1 is not retried: a person re-ran it
    record(3, 0, "running")
    step = tmp_path / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "COMPLETE").write_text("ok\n")
    assert rundir.restarts_before(tmp_path, 3) == 0  # a new checkpoint since: progress


@pytest.mark.parametrize("name", ["/no/such/model-dir", "no-such-org/no-such-model"])
def test_missing_model_directory_or_unknown_hub_id_is_one_line(base_overrides, tmp_path, capsys, name):
    code, _ = train_in_process(base_overrides("nomodel", max_steps=1, model__name_or_path=name))
    err = capsys.readouterr().err
    assert code == 1 and f"model.name_or_path={name}" in err.replace("'", ""), err
    assert len(err.strip().splitlines()) == 1, err


def test_sigint_commits_a_checkpoint_and_exits_130(base_overrides, tmp_path):
    out = tmp_path / "ctrl-c"
    cmd = [sys.executable, "-m", "llmft.trainer", *base_overrides("ctrl-c", max_steps=500)]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=err, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step=2 "):
                proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, "".join(lines[-20:])
    stderr = err_path.read_text().splitlines()
    assert any(line.startswith("[llmft] SIGINT: checkpoint step-") for line in stderr), stderr[-10:]  # on stderr
    committed = [p for p in (out / "checkpoints").iterdir() if is_complete(p)]
    assert len(committed) == 1 and 2 <= int(committed[0].name.split("-")[1]) < 500 and not (out / "final").exists()
    assert json.loads((out / rundir.RESTARTS_FILE).read_text())["outcome"] == 130


def test_epoch_in_trainer_state_matches_the_loader(base_overrides, tokenized_dir, tmp_path):
    from llmft.trainer.data.loader import PackedLoader

    loader = PackedLoader(tokenized_dir, "train", global_sequences=8, micro_sequences=8, rank=0, world_size=1, seed=3)
    per_epoch = loader.steps_per_epoch
    overrides = base_overrides(
        "epochs",
        batch__global_sequences=8,
        batch__micro_sequences=8,
        max_steps=per_epoch + 1,
        save_every=per_epoch,
        keep_last=5,
        log_every=per_epoch,
        eval__max_sequences=4,
    )
    assert train_in_process(overrides)[0] == 0
    for step in (per_epoch, per_epoch + 1):
        state = json.loads((tmp_path / "epochs" / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())
        assert state["epoch"] == state["data_position"]["epoch"] == loader.batch(step).epoch, step
        assert state["data_position"]["step_in_epoch"] == (per_epoch if step == per_epoch else 1)
