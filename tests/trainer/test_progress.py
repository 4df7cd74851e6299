"""Progress and ETA (issue 44 item 1): the one progress line, its ETA, when plain lines are printed instead of a
tqdm bar, and the numbers MLflow gets (llmft/trainer/progress.py, llmft/trainer/observe.py)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from llmft.trainer.observe import HF_METRIC_NAMES, Observer, mlflow_metrics
from llmft.trainer.progress import PLAIN_EVERY_S, Progress, ProgressClock, duration, parse_line


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_line_names_step_total_percent_speed_loss_elapsed_and_eta():
    line = Progress(step=4, total=12, elapsed_s=80.4, eta_s=160.0, tokens_per_s=1234.6, loss=1.23456).line()
    assert line == "progress: step 4/12 (33%), 1,235 tokens/s, loss 1.235, elapsed 1m20s, ETA 2m40s"
    assert parse_line("[llmft-1-master-0] " + line) == (4, 12)
    assert "=" not in line  # Katib's StdOut collector reads name=value pairs: none here
    unknown = Progress(step=0, total=5, elapsed_s=3.0, eta_s=None).line()
    assert unknown == "progress: step 0/5 (0%), elapsed 3s, ETA unknown"  # no NaN, no placeholder numbers


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0, "0s"), (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"), (47 * 3600 + 60, "47h01m"),
     (49 * 3600, "2d01h"), (float("nan"), "unknown"), (-1, "unknown")],
)  # fmt: skip
def test_durations_are_short_and_exact(seconds, shown):
    assert duration(seconds) == shown


def test_the_eta_is_this_processs_pace_after_its_first_step_times_the_steps_left():
    clock = Clock()
    progress = ProgressClock(total=10, start_step=0, clock=clock)
    assert progress.at(0).eta_s is None  # nothing trained yet
    clock.now += 30.0  # the first step: compilation and all
    first = progress.at(1)
    assert first.eta_s == pytest.approx(30.0 * 9) and first.elapsed_s == pytest.approx(30.0)
    clock.now += 2.0
    clock.now += 2.0
    third = progress.at(3)  # two steps of 2 s since the first ended: the warm-up is left out
    assert third.eta_s == pytest.approx(2.0 * 7) and third.percent == pytest.approx(30.0)
    clock.now += 2.0
    assert progress.at(10).eta_s == 0.0


def test_a_resumed_run_counts_its_earlier_time_and_paces_from_its_own_steps():
    clock = Clock()
    progress = ProgressClock(total=100, start_step=60, elapsed_before_s=500.0, clock=clock)
    clock.now += 10.0
    progress.at(61)
    clock.now += 4.0
    resumed = progress.at(63)
    assert resumed.elapsed_s == pytest.approx(514.0)
    assert resumed.eta_s == pytest.approx(2.0 * 37) and resumed.step == 63


def test_plain_lines_come_at_most_every_ten_seconds_and_always_at_the_last_step():
    clock = Clock()
    progress = ProgressClock(total=50, start_step=0, clock=clock)
    shown = []
    for step in range(1, 51):
        clock.now += 1.0
        if progress.plain_due(step):
            shown.append(step)
    assert shown[0] == 1 and shown[-1] == 50
    gaps = [b - a for a, b in zip(shown, shown[1:-1], strict=False)]
    assert all(gap >= PLAIN_EVERY_S for gap in gaps), shown


def _observer(tmp_path, monkeypatch, *, tty: bool, bar: bool = True) -> tuple[Observer, io.StringIO]:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    monkeypatch.setattr("llmft.trainer.langfuse_sink.configured", lambda: False)
    stderr = io.StringIO()
    stderr.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr("sys.stderr", stderr)
    observe = SimpleNamespace(progress_bar=bar, tensorboard=False, run_name="", mlflow_experiment="", peak_tflops=0.0)
    cfg = SimpleNamespace(output_dir=str(tmp_path / "out"), observe=observe)
    return Observer(cfg, {}, is_main=True, total_steps=3, start_step=0), stderr


def test_in_a_pods_log_the_trainer_prints_plain_progress_lines_and_no_tqdm(tmp_path, monkeypatch, capsys):
    """Issue 44: a pod's stdout is a file; tqdm's \\r-joined redraws piled up there. Not a terminal: no bar."""
    observer, stderr = _observer(tmp_path, monkeypatch, tty=False)
    observer.training_started()
    for step in (1, 2, 3):
        observer.log_train(step, {"loss": 2.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0})
        observer.progress(step, loss=2.0 / step, tokens_per_s=100.0)
    observer.finish({}, None)
    out = capsys.readouterr().out
    assert observer._bar is None and "\r" not in stderr.getvalue() and "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("progress: ")]
    assert lines[0].startswith("progress: step 1/3 (33%), 100 tokens/s, loss 2, elapsed ")
    assert lines[-1].startswith("progress: step 3/3 (100%)") and lines[-1].endswith("ETA 0s")


def test_on_a_terminal_the_bar_shows_and_no_plain_lines(tmp_path, monkeypatch, capsys):
    observer, stderr = _observer(tmp_path, monkeypatch, tty=True)
    observer.training_started()
    observer.progress(1, loss=1.0, tokens_per_s=10.0)
    observer.finish({}, None)
    assert observer._bar is not None and "progress: " not in capsys.readouterr().out
    assert "1/3" in stderr.getvalue()


def test_progress_bar_false_means_plain_lines_even_on_a_terminal(tmp_path, monkeypatch, capsys):
    observer, _ = _observer(tmp_path, monkeypatch, tty=True, bar=False)
    observer.training_started()
    observer.progress(1, loss=1.0, tokens_per_s=10.0)
    assert observer._bar is None and "progress: step 1/3" in capsys.readouterr().out


def test_mlflow_gets_our_names_and_hugging_faces_side_by_side():
    numbers = {"loss": 1.5, "lr": 2e-4, "grad_norm": 0.7, "tokens_per_s": 900.0, "progress_percent": 50.0}
    logged = mlflow_metrics("train", {**numbers, "eta_seconds": 12.0})
    assert logged["train/loss"] == logged["loss"] == 1.5
    assert logged["train/lr"] == logged["learning_rate"] == 2e-4 and "lr" not in logged
    assert logged["grad_norm"] == 0.7 and logged["progress_percent"] == 50.0 and logged["eta_seconds"] == 12.0
    assert "tokens_per_s" not in logged and logged["train/tokens_per_s"] == 900.0  # no HF name: ours only
    evaluated = mlflow_metrics("eval", {"eval_loss": 0.9, "perplexity": 2.46})
    assert evaluated == {"eval/eval_loss": 0.9, "eval/perplexity": 2.46, "eval_loss": 0.9, "eval_perplexity": 2.46}
    assert set(HF_METRIC_NAMES) == {"train", "eval"}


def test_the_train_events_carry_progress_and_eta(tmp_path, monkeypatch):
    import json

    observer, _ = _observer(tmp_path, monkeypatch, tty=False)
    observer.training_started()
    observer.log_train(1, {"loss": 2.0})
    observer.log_train(2, {"loss": 1.0})
    events = [json.loads(line) for line in observer.metrics_path.read_text().splitlines()]
    assert [e["progress_percent"] for e in events] == pytest.approx([100 / 3, 200 / 3])
    assert "eta_seconds" in events[-1] and events[-1]["eta_seconds"] >= 0
