"""Known noise of the libraries we use, kept off the screen: a first run shows what the user needs, and an error line
is not preceded by warnings about things the user cannot change.

Each entry is one message or logger of a named package and version, with why it is noise here. Nothing else is
filtered: a new warning still shows. :func:`quiet_known_noise` is called by every entry point that may load these
libraries: ``llmft`` (llmft/cli.py), ``python -m llmft.trainer`` (every rank), the KFP components that load a
model or a tracking client (evaluate, serving form, register, deploy) and the notebooks (notebooks/nb_setup.py); it
imports none of them.
"""

from __future__ import annotations

import logging
import warnings

KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        r"`is_gradient_checkpointing` is deprecated",
        "peft 0.21 reads transformers' deprecated alias each time it wraps a model (peft/peft_model.py line 184, "
        "getattr(model, 'is_gradient_checkpointing', True); transformers 5.24 modeling_utils.py line 3312 warns): "
        "nothing of ours to change",
    ),
)
"""(category, message regex, why) of the warnings filtered out."""

QUIET_LOGGERS: tuple[tuple[str, int, str], ...] = (
    (
        "bitsandbytes.backends.cpu.ops",
        logging.ERROR,
        "bitsandbytes (imported by peft) warns at import on AVX512-BF16 CPUs that it cannot fetch an optional CPU "
        "kernel from a hub (backends/cpu/ops.py)",
    ),
    (
        "mlflow.store.db.utils",
        logging.WARNING,
        "MLflow 3.17 logs 'Creating initial MLflow database tables...' and 'Updating database tables' at INFO when a "
        "run opens a new sqlite store (mlflow/store/db/utils.py): the local run's first start",
    ),
)
"""(logger, level, why): these loggers show only messages at or above the level."""

DROPPED_LOG_MESSAGES: tuple[tuple[str, str, str], ...] = (
    (
        "DeepSpeed",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
        "DeepSpeed 0.19.8 logs it at WARNING on import on every machine without CUDA "
        "(deepspeed/accelerator/real_accelerator.py line 213); on a CPU machine that is the expected case. It "
        "re-creates its logger's level at import (utils/logging.py LoggerFactory), so a filter drops the message",
    ),
)
"""(logger, exact message, why): one message dropped; the logger's other messages still show."""


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def quiet_known_noise() -> None:
    """Install the filters above (idempotent)."""
    for category, message, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, level, _why in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name, message, _why in DROPPED_LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.message == message for f in logger.filters):
            logger.addFilter(_DropMessage(message))
