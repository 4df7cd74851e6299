"""Errors a user can fix. The CLI prints them without a traceback and exits 1
(the Training Operator's ExitCode restart policy treats 1-127 as permanent, so a
bad config or bad data is never retried)."""
from __future__ import annotations

EXIT_USER_ERROR = 1
EXIT_PREEMPTED = 143  # 128 + SIGTERM: retryable under restartPolicy ExitCode


class LlmftError(Exception):
    """Base class: the message says what is wrong, where, and how to fix it."""


class ConfigError(LlmftError):
    """A configuration key, value or combination is invalid."""


class DataError(LlmftError):
    """Input data is malformed or fails validation."""
