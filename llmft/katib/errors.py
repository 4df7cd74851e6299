"""Errors of the katib package: :class:`SweepError` is an ``LlmftError``.

llmft/katib/ is a leaf package: besides itself it imports only ``llmft.trainer.errors`` (the project's
one error root and exit-code contract), so the CLI maps a sweep error to its exit code the same
way as any other (``llmft.cli``), without a try/except per command.
"""

from __future__ import annotations

from llmft.trainer.errors import EXIT_TRANSIENT, LlmftError


class SweepError(LlmftError):
    """A sweep specification, Experiment or trial result is invalid; the message says how to fix it (exit 1)."""


class ExperimentFailed(SweepError):
    """The Katib Experiment ended in the Failed condition (or a local sweep exceeded its failure budget)."""

    def __init__(self, message: str, state=None):
        super().__init__(message)
        self.state = state


class SweepTimeout(SweepError, TimeoutError):
    """The Experiment did not finish within the wait; it keeps running (exit 200: waiting again may succeed)."""

    exit_code = EXIT_TRANSIENT
