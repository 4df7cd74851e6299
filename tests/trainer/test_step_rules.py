"""The rules of one training step, each in milliseconds: the torchrun runs of test_distributed.py and the training
runs of test_resume.py / test_lora_run.py show them end to end in 40-60 s each; these catch a broken rule in
`make test-fast`. The loss scale over ranks and micro steps, the non-finite guard with and without fused AdamW,
the consecutive bad-step limit, the last step's schedule, and the best checkpoint that pruning keeps."""

from __future__ import annotations

import contextlib
import json
import signal
from types import SimpleNamespace

import pytest
import torch
from float_bounds import close

from llmft.trainer import checkpoint as ckpt
from llmft.trainer.config import TrainConfig
from llmft.trainer.distributed import DistInfo, Engine
from llmft.trainer.io import COMPLETE_MARKER
from llmft.trainer.steps import StepActions, StepCounters, TrainingAborted, loss_scale, step_actions
from llmft.trainer.train import Trainer

CPU = torch.device("cpu")
ONE = DistInfo(0, 1, 0, CPU)


class _Micro:
    """A micro batch: some tokens' inputs and targets."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def to_torch(self, device, pin=False) -> dict:
        return {"x": self.x, "y": self.y}


def _token_sum(model, tensors) -> torch.Tensor:
    """A per-token loss summed over the micro batch's tokens, like the trainer's NLL sum."""
    return ((model(tensors["x"]).squeeze(-1) - tensors["y"]) ** 2).sum()


def _engine(model, *, fused: bool = False, lr: float = 0.1) -> Engine:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    return Engine(
        model,
        optimizer,
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        info=ONE,
        backend="ddp",
        max_grad_norm=1.0,
        fused_skip=fused,
    )


def _forward_backward(model, *, rank: int, world: int, micro_batches: list, global_targets: int):
    """Trainer.forward_backward as rank ``rank`` of ``world`` (the engine of one process: the gradients it leaves
    are this rank's, before DDP averages them)."""
    trainer = Trainer.__new__(Trainer)
    trainer.info = DistInfo(rank, world, rank, CPU)
    trainer.engine, trainer.cfg = _engine(model), TrainConfig()
    trainer.method, trainer.loss_fn = SimpleNamespace(autocast=contextlib.nullcontext), _token_sum
    model.zero_grad(set_to_none=True)
    trainer.forward_backward(SimpleNamespace(step=1, micro_batches=micro_batches, global_targets=global_targets))
    return [p.grad.clone() for p in model.parameters()]


def test_the_update_is_the_token_mean_whatever_the_ranks_and_micro_steps():
    """Two ranks of two micro batches of uneven token counts, DDP's average over ranks: the gradient of the mean
    loss over all tokens, as one process with one batch computes it (float64: rounding only)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    sizes = [[3, 1], [2, 4]]  # tokens of each micro batch, per rank
    micro = [
        [_Micro(torch.randn(n, 3, dtype=torch.float64), torch.randn(n, dtype=torch.float64)) for n in r] for r in sizes
    ]
    tokens = sum(map(sum, sizes))

    model.zero_grad(set_to_none=True)
    x = torch.cat([m.x for r in micro for m in r])
    (_token_sum(model, {"x": x, "y": torch.cat([m.y for r in micro for m in r])}) / tokens).backward()
    reference = [p.grad.clone() for p in model.parameters()]

    per_rank = [
        _forward_backward(model, rank=r, world=2, micro_batches=micro[r], global_targets=tokens) for r in (0, 1)
    ]
    averaged = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]  # DDP: all-reduce, then / world size
    one_rank = _forward_backward(model, rank=0, world=1, micro_batches=micro[0] + micro[1], global_targets=tokens)
    for ref, two, one in zip(reference, averaged, one_rank, strict=True):
        torch.testing.assert_close(two, ref, **close(ref, tokens + 3, torch.float64))
        torch.testing.assert_close(one, ref, **close(ref, tokens + 3, torch.float64))
    assert loss_scale(4, 0) == 4.0  # a batch without targets never divides by zero


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_non_finite_step_leaves_the_weights_as_they_were(fused):
    """Without fused AdamW (a GPU without it, or optim.fused=false) the engine must skip the update itself; fused
    AdamW skips on the device through found_inf. A finite step after it updates."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    engine = _engine(model, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(2, 3)).sum() * float("nan")
    engine.backward(loss)
    _, bad = engine.step(loss.detach())
    assert bool(bad)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

    loss = model(torch.ones(2, 3)).sum()
    engine.backward(loss)
    norm, bad = engine.step(loss.detach())
    assert not bool(bad) and torch.isfinite(norm)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def _counters(pattern: list[bool], max_bad: int) -> StepCounters:
    counters = StepCounters(CPU)
    for step, is_bad in enumerate(pattern, start=1):
        bad = torch.tensor(is_bad)
        loss = torch.tensor(float("nan") if is_bad else 2.0)
        counters.update(step, loss, torch.tensor(1.0), bad, bad, max_bad)
    return counters


def test_bad_steps_abort_only_when_consecutive():
    """max_bad_steps counts a streak: good steps between bad ones reset it; the total of skipped steps is kept."""
    scattered = _counters([True, True, False, True, True, False, True, True], max_bad=3)
    scattered.check_bad_streak(ONE, 3)  # six bad steps, never three in a row: training goes on
    assert int(scattered.skipped) == 6 and float(scattered.loss_sum / scattered.good_steps) == 2.0
    with pytest.raises(TrainingAborted, match=r"^step 5: 3 consecutive steps with a non-finite loss"):
        _counters([True, False, True, True, True, True], max_bad=3).check_bad_streak(ONE, 3)
    _counters([True, True], max_bad=3).check_bad_streak(ONE, 3)  # below the limit


SCHEDULE = {"log_every": 5, "eval_every": 4, "save_every": 3}


def test_the_last_step_always_logs_evaluates_and_saves():
    assert step_actions(7, 7, **SCHEDULE, stop_signal=0) == StepActions(log=True, evaluate=True, save=True, stop=False)
    assert step_actions(1, 7, **SCHEDULE, stop_signal=0) == StepActions(
        log=False, evaluate=False, save=False, stop=False
    )
    assert step_actions(6, 7, **SCHEDULE, stop_signal=0) == StepActions(
        log=False, evaluate=False, save=True, stop=False
    )
    assert step_actions(4, 7, **SCHEDULE, stop_signal=0) == StepActions(
        log=False, evaluate=True, save=False, stop=False
    )
    assert step_actions(5, 7, **SCHEDULE, stop_signal=0) == StepActions(
        log=True, evaluate=False, save=False, stop=False
    )
    never = {"log_every": 100, "eval_every": 0, "save_every": 0}  # 0: only at the end
    assert step_actions(3, 7, **never, stop_signal=0) == StepActions(log=False, evaluate=False, save=False, stop=False)
    assert step_actions(7, 7, **never, stop_signal=0) == StepActions(log=True, evaluate=True, save=True, stop=False)


def test_a_stop_signal_saves_and_stops_but_the_last_step_completes_the_run():
    assert step_actions(2, 7, **SCHEDULE, stop_signal=signal.SIGTERM) == StepActions(
        log=True, evaluate=False, save=True, stop=True
    )
    assert step_actions(7, 7, **SCHEDULE, stop_signal=signal.SIGINT) == StepActions(
        log=True, evaluate=True, save=True, stop=False
    )


def _checkpoint(root, step: int, run_id: str, eval_loss: float | None = None):
    path = root / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    evaluation = None if eval_loss is None else {"eval_loss": eval_loss, "step": step}
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step, "run_id": run_id, "eval": evaluation}))
    (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def test_pruning_keeps_the_best_evaluated_checkpoint_and_the_newest(tmp_path):
    for step, loss in ((1, 3.0), (2, 1.5), (3, None), (4, 2.0), (5, 1.5), (6, None)):
        _checkpoint(tmp_path, step, "mine", loss)
    _checkpoint(tmp_path, 7, "theirs", 0.1)  # another run's better checkpoint is not this run's best
    best = ckpt.best_checkpoint_step(tmp_path, "mine")
    assert best == 2  # the lowest eval loss; a tie keeps the earlier step
    ckpt.prune_checkpoints(tmp_path, keep_last=2, best_step=best, run_id="mine")
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path, "mine")] == [2, 5, 6]
    assert (tmp_path / "checkpoints" / "step-7").is_dir()
    assert ckpt.best_checkpoint_step(tmp_path / "none", "mine") is None


def test_a_shards_minus_100_labels_are_no_targets_and_token_0_is_one(tmp_path):
    """Labels as every tokenized folder on the volume holds them (-100: not a target; written here, not imported).
    Token id 0 is a real token (Qwen's "!"): a reply that contains it is trained on it."""
    from llmft.trainer.data.loader import build_micro_batch, count_targets
    from llmft.trainer.data.shards import open_split, write_split

    ids = [5, 6, 0, 7, 8, 9, 0, 3]  # two documents of 4 tokens in one packed sequence
    labels = [-100, -100, 0, 7, -100, -100, 0, 3]  # prompts ignored; the replies "0 7" and "0 3"
    write_split(tmp_path / "train", ids, labels, [0, 4, 8], [0, 2])
    split = open_split(tmp_path, "train")
    assert count_targets(split, [0])[:2] == (4, 8)
    micro = build_micro_batch(split, [0])
    assert micro.targets.tolist() == [-100, 0, 7, -100, -100, 0, 3, -100]  # never across the documents
    batch = micro.to_torch(CPU)
    assert batch["supervised"].tolist() == [1, 2, 5, 6]


def test_the_streak_message_names_the_rank_or_the_gradients_and_starts_from_the_resumed_count():
    counters = StepCounters(CPU, skipped=5)  # a resumed run carries its skipped steps on
    for step in (8, 9):
        counters.update(step, torch.tensor(float("nan")), torch.tensor(1.0), torch.tensor(True), torch.tensor(True), 2)
    assert int(counters.skipped) == 7 and int(counters.hit_step) == 9
    with pytest.raises(TrainingAborted) as caught:
        counters.check_bad_streak(ONE, 2)
    assert str(caught.value) == (
        "step 9: 2 consecutive steps with a non-finite loss or gradient norm (non-finite loss on rank(s) [0]); "
        "updates were skipped, stopping. Lower optim.lr, check the data, or raise max_bad_steps."
    )
    gradients = StepCounters(CPU)  # every rank's loss finite: the all-reduced gradient norm was not
    for step in (1, 2):
        bad = torch.tensor(True)
        gradients.update(step, torch.tensor(1.0), torch.tensor(float("inf")), bad, torch.tensor(False), 2)
    with pytest.raises(TrainingAborted, match=r"\(non-finite loss in the gradients \(all-reduced over every rank\)\)"):
        gradients.check_bad_streak(ONE, 2)


def test_a_stop_exits_128_plus_the_signal_and_says_where():
    from llmft.trainer.steps import Stopped

    stopped = Stopped(signal.SIGTERM, 12)
    assert stopped.exit_code == 143 and str(stopped) == "SIGTERM at step 12"
    assert Stopped(signal.SIGINT, 3).exit_code == 130


def test_garbage_is_collected_on_schedule_and_seeds_repeat(monkeypatch):
    import gc
    import random

    import numpy as np

    from llmft.trainer.steps import collect_garbage, scheduled_gc, seed_all

    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    for step in range(1, 7):
        collect_garbage(step, 3)
        collect_garbage(step, 0)  # 0: the automatic collector, never a scheduled one
    assert calls == [1, 1]
    with scheduled_gc(0):
        assert gc.isenabled()
    with scheduled_gc(5):
        assert not gc.isenabled()
    assert gc.isenabled()

    def draws(seed: int) -> tuple:
        seed_all(seed)
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    assert draws(2**32 + 7) == draws(2**32 + 7) != draws(8)
    seed_all(2**32 + 7)
    state = np.random.get_state()[1][0]
    seed_all(7)
    assert np.random.get_state()[1][0] == state  # numpy takes the seed modulo 2**32


def test_fresh_counters_start_at_nothing_on_the_device_in_their_types():
    counters = StepCounters(CPU, skipped=2)
    expected = {
        "streak": (0, torch.int64),
        "hit_step": (-1, torch.int64),
        "hit_local": (False, torch.bool),
        "skipped": (2, torch.int64),
        "loss_sum": (0.0, torch.float32),
        "good_steps": (0.0, torch.float32),
        "grad_norm": (0.0, torch.float32),
    }
    for name, (value, dtype) in expected.items():
        tensor = getattr(counters, name)
        assert tensor.item() == value and tensor.dtype == dtype and tensor.device == CPU, name
    counters.update(1, torch.tensor(3.0), torch.tensor(0.5), torch.tensor(False), torch.tensor(False), 2)
    assert counters.loss_sum.item() == 3.0 and counters.good_steps.item() == 1.0 and counters.grad_norm.item() == 0.5
    assert counters.streak.item() == 0 and counters.hit_step.item() == -1 and counters.skipped.item() == 2


def test_the_stop_request_starts_clear_and_says_exactly_which_signals(monkeypatch):
    from llmft.trainer.errors import SignalStop
    from llmft.trainer.steps import StopRequest, collect_garbage, seed_all

    request = StopRequest()
    assert request.signum == 0
    request.signum = signal.SIGTERM
    previous = request.install()
    try:
        assert request.signum == 0  # a new run's request starts clear
        request._handle(signal.SIGINT, None)
        with pytest.raises(SignalStop) as caught:
            request._handle(signal.SIGINT, None)
    finally:
        StopRequest.restore(previous)
    assert str(caught.value) == "interrupted by a second Ctrl-C: stopped at once, without a checkpoint"

    import gc

    steps: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: steps.append(generation))
    for step in range(1, 5):
        before = len(steps)
        collect_garbage(step, 1)  # every step
        collect_garbage(step, 2)  # even steps only
        steps[before:] = [step] * (len(steps) - before)
    assert steps == [1, 2, 2, 3, 4, 4]

    import numpy as np

    seed_all(100)
    ours = np.random.rand()
    np.random.seed(100)
    assert ours == np.random.rand()
