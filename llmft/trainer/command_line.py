"""The trainer's command line, built in one place: ``llmft train [--nproc N] [--config FILE] key=value ...``.

Overrides travel as (key, value) pairs. A ``key=value`` string is split once, by the one grammar
(``split_assignment`` in llmft/trainer/config_load.py), at the edge where it comes in (:func:`override_pairs`);
a value goes back into a command line through :func:`format_override_value`. Every launcher builds its
command with :func:`train_arguments`: a PyTorchJob replica, a TrainJob node and a Katib trial
(llmft/components/lib/jobs/pytorchjob_spec.py ``trainer_command``), the local backend
(llmft/components/lib/jobs/local_train.py) and a local Optuna sweep's trials (llmft/katib/local_sweep.py).
Pure Python: the trainer image and the pipeline image both import it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from llmft.trainer.config_load import split_assignment

_PLAIN_ITEM = re.compile(r"^[A-Za-z0-9_./-]+$")


def override_pairs(items: Iterable[str]) -> list[tuple[str, str]]:
    """``key=value`` strings -> (key, raw value) pairs, by the one grammar; ConfigError names a malformed one."""
    return [split_assignment(item) for item in items]


def format_override_value(value: Any) -> str:
    """Render a value for a ``key=value`` override (YAML-parsable: true/false, null, [a,b])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        items = [format_override_value(v) for v in value]
        if all(_PLAIN_ITEM.match(item) for item in items):  # [q_proj,v_proj]: YAML, and shell-safe
            return "[" + ",".join(items) + "]"
        return json.dumps(list(value), separators=(",", ":"))
    return str(value)


def format_overrides(pairs: Iterable[tuple[str, Any]]) -> list[str]:
    """(key, value) pairs -> the ``key=value`` words of a command line."""
    return [f"{key}={format_override_value(value)}" for key, value in pairs]


def train_arguments(
    *, nproc: str | None = None, config_path: str | None = None, overrides: Iterable[tuple[str, Any]] = ()
) -> list[str]:
    """The arguments of ``llmft``: ``train``, ``--nproc N`` (when given: ``llmft train`` then starts torchrun),
    ``--config FILE`` (when given), then the overrides in order (a later key wins)."""
    args = ["train"]
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    if config_path:
        args += ["--config", config_path]
    return args + format_overrides(overrides)
