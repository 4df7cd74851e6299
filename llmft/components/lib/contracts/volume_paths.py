"""Parameters that become folder names on the shared data volume: one plain path component each.

:func:`check_path_component` refuses separators, ``..`` and hidden names, and :func:`path_under`
resolves the result and checks it stays under its root.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmft.trainer.errors import ConfigError

PATH_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 255
"""The longest file name (in bytes) Linux file systems hold (ext4, XFS, NFS: NAME_MAX in <linux/limits.h>);
a longer folder name fails with ENAMETOOLONG ("File name too long"). MLflow's registry holds model names of
up to 256 characters (mlflow/store/model_registry/dbmodels/models.py, ``String(256)``), so the volume is
the tighter limit for ``mlflow_model_name``."""


def check_path_component(value: str, field: str, *, max_length: int = NAME_MAX) -> str:
    """Return ``value`` if it is one plain path component (no '/', '..', leading '.' or '-') of at most
    ``max_length`` characters (ASCII only, so bytes too)."""
    if not PATH_COMPONENT.match(value or "") or value in (".", ".."):
        raise ConfigError(
            f"{field}={value!r} is used as a folder name on the data volume: use letters, digits, '.', '_' and '-' "
            "only, starting with a letter or digit (no '/' or '..')"
        )
    if len(value) > max_length:
        raise ConfigError(
            f"{field} is {len(value)} characters long ({value[:24]}...): it is used as a folder name on the data "
            f"volume, and a file name holds at most {max_length}; use a shorter name"
        )
    return value


def path_under(root: str | Path, *parts: str) -> Path:
    """``root/part/...`` resolved, refusing a result outside ``root`` (symlinks followed)."""
    base = Path(root).resolve()
    target = base.joinpath(*parts).resolve()
    if target != base and base not in target.parents:
        raise ConfigError(f"{'/'.join(parts)} resolves to {target}, outside {base}; refusing to write there")
    return target
