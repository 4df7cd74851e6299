"""The one place names are validated: Kubernetes object names and path components.

Kubernetes names follow apimachinery's validation (``k8s.io/apimachinery/pkg/util/validation``):
an RFC 1123 label (``[a-z0-9]([-a-z0-9]*[a-z0-9])?``, at most 63 characters) for most names,
an RFC 1035 label (starts with a letter) for Services and the objects that create them, and an
RFC 1123 subdomain (labels joined by dots, at most 253) for PVCs and Secrets. Katib, KServe and
the Training Operator add their own length limits; callers pass ``max_length``.

A parameter that becomes part of a path on a shared volume must be a single, plain component:
:func:`check_path_component` refuses separators, ``..`` and hidden names, and :func:`path_under`
resolves the result and checks it stays under its root.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmft.trainer.errors import ConfigError

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PATH_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 255
"""The longest file name (in bytes) Linux file systems hold (ext4, XFS, NFS: NAME_MAX in <linux/limits.h>);
a longer folder name fails with ENAMETOOLONG ("File name too long"). MLflow's registry holds model names of
up to 256 characters (mlflow/store/model_registry/dbmodels/models.py, ``String(256)``), so the volume is
the tighter limit for ``mlflow_model_name``."""

_KINDS = {
    "label": (RFC1123_LABEL, 63, "lowercase letters, digits and '-', starting and ending with a letter or digit"),
    "dns1035": (RFC1035_LABEL, 63, "lowercase letters, digits and '-', starting with a letter"),
    "subdomain": (RFC1123_SUBDOMAIN, 253, "lowercase letters, digits, '-' and '.'"),
}


def is_k8s_name(value: str, *, kind: str = "label", max_length: int | None = None) -> bool:
    pattern, limit, _ = _KINDS[kind]
    return bool(pattern.match(value or "")) and len(value) <= (max_length or limit)


def check_k8s_name(value: str, field: str, *, kind: str = "label", max_length: int | None = None) -> str:
    """Return ``value`` if it is a valid Kubernetes name of ``kind``; else ConfigError naming ``field``."""
    pattern, limit, rule = _KINDS[kind]
    limit = max_length or limit
    if not is_k8s_name(value, kind=kind, max_length=limit):
        raise ConfigError(f"{field}={value!r} is not a Kubernetes name: at most {limit} characters, {rule}")
    return value


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
