"""Issue 27 item 6: what a signal during the trainer's start says. Before the fix any Ctrl-C that was not
handled as a stop request (one during start-up, or one after a SIGTERM) printed "interrupted by a second
Ctrl-C", and a SIGTERM before the trainer installed its handlers killed it without a word."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from llmft.trainer.__main__ import TRAINER
from llmft.trainer.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from llmft.trainer.failures import describe_failure


@pytest.fixture
def stop_request():
    from llmft.trainer.steps import STOP

    previous = STOP.install()
    yield STOP
    STOP.restore(previous)


@pytest.mark.parametrize(
    ("first", "wording"), [(signal.SIGTERM, "Ctrl-C after SIGTERM"), (signal.SIGINT, "a second Ctrl-C")]
)
def test_a_ctrl_c_after_a_stop_request_names_both_signals(stop_request, first, wording):
    stop_request._handle(first, None)  # what the handler does when the signal arrives (e.g. during model load)
    with pytest.raises(KeyboardInterrupt) as info:
        stop_request._handle(signal.SIGINT, None)
    code, message = describe_failure(info.value, TRAINER)
    assert code == EXIT_INTERRUPTED and wording in message and "without a checkpoint" in message


def test_a_ctrl_c_before_any_handler_is_not_called_a_second_one():
    code, message = describe_failure(KeyboardInterrupt(), TRAINER)
    assert code == EXIT_INTERRUPTED and "second" not in message and "starting" in message


@pytest.mark.slow  # starts a Python process that imports the trainer
def test_sigterm_while_the_trainer_starts_is_one_line_and_exit_143():
    """The trainer's entry point with its run replaced by one that gets SIGTERM before Trainer.build."""
    script = (
        "import os, signal, sys, time\n"
        "from llmft.trainer import __main__ as m\n"
        "def run(args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "m.run = run\n"
        "sys.exit(m.main([]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LLMFT_DEBUG", "WORLD_SIZE", "RANK")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == EXIT_PREEMPTED, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "stopped by SIGTERM while the trainer was starting" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
