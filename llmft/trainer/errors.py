"""The one exit-code contract, and the errors a user can fix.

Every command (``llmft ...``, ``python -m llmft.trainer``, the KFP components) maps its outcome
to these codes. The Training Operator's ``ExitCode`` restart policy treats 1-127 as permanent
and 128-255 as retryable, so only a bad input or configuration exits 1 and everything a
re-run can cure exits >= 128.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 1  # bad input or configuration: never retried
EXIT_USAGE = 2  # the command line itself is wrong (argparse)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, a checkpoint was committed where a run was training
EXIT_PREEMPTED = 143  # 128 + SIGTERM: checkpoint committed, retryable under restartPolicy ExitCode
EXIT_INTERNAL = 3  # an unexpected error (a bug): one line on stderr, LLMFT_DEBUG=1 shows the traceback; not retried
EXIT_TRANSIENT = 200  # a transient fault (I/O error, full disk, unreachable server): retryable, above every signal code

EXIT_CODE_MEANINGS: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_USER_ERROR: "bad input or configuration (the message names the file, line or key, and the fix); never retried",
    EXIT_USAGE: "usage: the command line itself is wrong",
    EXIT_INTERNAL: "internal error (a bug: please report it; LLMFT_DEBUG=1 shows the traceback); not retried",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (SIGINT); a training run commits a checkpoint first",
    EXIT_PREEMPTED: "stopped by SIGTERM (preemption): a training run commits a checkpoint first, a data step "
    "writes nothing; retried",
    EXIT_TRANSIENT: "transient fault: I/O error, full or read-only disk, unreachable server; retried",
}
"""What each exit code means: ``llmft --help`` and the README's table are written from this."""


class LlmftError(Exception):
    """Base class of every error the project raises on purpose: the message says what is
    wrong, where, and how to fix it. ``exit_code`` is what the command exits with."""

    exit_code = EXIT_USER_ERROR


class ConfigError(LlmftError):
    """A configuration key, value or combination is invalid."""


class DataError(LlmftError):
    """Input data is malformed or fails validation."""


class OutputNotOursError(ConfigError):
    """An output path holds something this program did not write (see trainer.io.check_output_target)."""


class TransientError(LlmftError):
    """A fault that a re-run may cure (I/O error, full disk, a server that did not answer)."""

    exit_code = EXIT_TRANSIENT


class SignalStop(KeyboardInterrupt):
    """A signal that stops the process at once, without a checkpoint: SIGTERM or Ctrl-C while the
    trainer starts (before its own handlers; nothing to checkpoint yet), or a Ctrl-C after a stop
    request (the message says which). ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum
