"""What the trainer's steps share besides :class:`~llmft.trainer.train.Trainer` itself: the stop
request (SIGTERM / SIGINT), the per-step counters kept on the device, the loss scale and the schedule of
one step, the garbage-collection schedule, and seeding.
"""

from __future__ import annotations

import contextlib
import gc
import random
import signal
from dataclasses import dataclass

import numpy as np
import torch

from llmft.trainer.distributed import ranks_with_flag
from llmft.trainer.errors import LlmftError, SignalStop


class Stopped(Exception):
    """SIGTERM or SIGINT arrived and a checkpoint was committed: exit 128 + the signal number
    (143 is retried under the ExitCode restart policy, and the restarted pod resumes)."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.exit_code = 128 + signum


class TrainingAborted(LlmftError):
    """Too many consecutive non-finite steps (exit 1: permanent)."""


class StopRequest:
    """SIGTERM or SIGINT: stop after the step in flight (also when it arrives while the model is
    still loading: the first step then stops). A SIGINT after either raises SignalStop (a KeyboardInterrupt)
    whose message names both signals."""

    def __init__(self):
        self.signum = 0

    def install(self) -> dict:
        """Handle both signals; returns the previous handlers for :meth:`restore`."""
        self.signum = 0
        return {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.signum:
            first = (
                "a second Ctrl-C"
                if self.signum == signal.SIGINT
                else f"Ctrl-C after {signal.Signals(self.signum).name}"
            )
            raise SignalStop(signum, f"interrupted by {first}: stopped at once, without a checkpoint")
        self.signum = self.signum or signum

    @staticmethod
    def restore(previous: dict) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


STOP = StopRequest()


class StepCounters:
    """Per-step bookkeeping kept on the device so that nothing syncs between log steps."""

    def __init__(self, device, skipped: int = 0):
        z = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        self.streak, self.hit_step, self.hit_local = z(0, torch.int64), z(-1, torch.int64), z(False, torch.bool)
        self.skipped = z(skipped, torch.int64)
        self.loss_sum, self.good_steps, self.grad_norm = z(0.0), z(0.0), z(0.0)

    def update(self, step: int, global_loss, grad_norm, bad, local_bad, max_bad: int) -> None:
        self.streak = (self.streak + 1) * bad
        hit = (self.streak >= max_bad) & (self.hit_step < 0)
        self.hit_step = torch.where(hit, step, self.hit_step)
        self.hit_local = torch.where(hit, local_bad, self.hit_local)
        self.skipped += bad
        good = ~bad
        self.loss_sum += torch.where(good, global_loss.float(), 0.0)
        self.good_steps += good.float()
        self.grad_norm = grad_norm.float()

    def check_bad_streak(self, info, max_bad: int) -> None:
        """At a log step: raise TrainingAborted once ``max_bad`` consecutive steps were non-finite."""
        hit_step = int(self.hit_step.item())
        if hit_step < 0:
            return
        ranks = ranks_with_flag(self.hit_local, info)
        where = f"on rank(s) {ranks}" if ranks else "in the gradients (all-reduced over every rank)"
        raise TrainingAborted(
            f"step {hit_step}: {max_bad} consecutive steps with a non-finite loss or gradient norm "
            f"(non-finite loss {where}); updates were skipped, stopping. Lower optim.lr, check the data, "
            "or raise max_bad_steps."
        )


def loss_scale(world_size: int, global_targets: int) -> float:
    """What each rank multiplies its token-NLL sum by before ``backward``: world size / the global target count.

    Micro steps add their gradients and both engines average gradients over ranks (DDP's all-reduce / world,
    DeepSpeed likewise), so the update is the gradient of every rank's NLL over every micro step divided by the
    global target count: the single-process mean over the same tokens, whatever the ranks and accumulation."""
    return world_size / max(global_targets, 1)


@dataclass(frozen=True)
class StepActions:
    """What the trainer does after a step."""

    log: bool  # read the device counters, log, check the non-finite streak
    evaluate: bool  # score the validation split (when there is one)
    save: bool  # commit a checkpoint
    stop: bool  # exit 128 + the signal after the checkpoint


def step_actions(
    step: int, total_steps: int, *, log_every: int, eval_every: int, save_every: int, stop_signal: int
) -> StepActions:
    """The schedule of one step (every N steps; 0 = only at the end). The last step always logs, evaluates and
    saves (final/ and the evaluate step read it); a stop signal logs and saves, then stops the run, unless it
    came on the last step: that run completes (exit 0) and says so."""
    final = step == total_steps
    return StepActions(
        log=step % log_every == 0 or final or bool(stop_signal),
        evaluate=bool(eval_every and step % eval_every == 0) or final,
        save=bool(save_every and step % save_every == 0) or final or bool(stop_signal),
        stop=bool(stop_signal) and not final,
    )


@contextlib.contextmanager
def scheduled_gc(every: int):
    """Python's automatic garbage collector off during training (a collection of the many objects
    compile and the model leave behind can stall one step); :func:`collect_garbage` collects young
    objects every ``every`` steps instead. ``every`` 0 leaves it automatic."""
    if every <= 0:
        yield
        return
    gc.collect()
    gc.freeze()  # what exists now (model, compiled code) is never scanned again
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def collect_garbage(step: int, every: int) -> None:
    if every > 0 and step % every == 0:
        gc.collect(1)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
