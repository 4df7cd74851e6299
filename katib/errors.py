"""Errors of the katib package.

katib/ is a leaf package (it imports nothing of ours from outside katib/), so it
cannot subclass trainer.errors.LlmftError; the `llmft sweep` command catches
:class:`SweepError`, prints its message and exits 1.
"""

from __future__ import annotations


class SweepError(Exception):
    """A sweep specification, Experiment or trial result is invalid; the message says how to fix it."""


class ExperimentFailed(SweepError):
    """The Katib Experiment ended in the Failed condition (or a local sweep exceeded its failure budget)."""

    def __init__(self, message: str, state=None):
        super().__init__(message)
        self.state = state
