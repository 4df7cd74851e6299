"""The one Kubernetes-name validator: object names as apimachinery validates them.

Kubernetes names follow apimachinery's validation (``k8s.io/apimachinery/pkg/util/validation``):
an RFC 1123 label (``[a-z0-9]([-a-z0-9]*[a-z0-9])?``, at most 63 characters) for most names,
an RFC 1035 label (starts with a letter) for Services and the objects that create them, and an
RFC 1123 subdomain (labels joined by dots, at most 253) for PVCs and Secrets. Katib, KServe and
the Training Operator add their own length limits; callers pass ``max_length``.

It lives in llmft/katib/, the lowest layer whose code names Kubernetes objects: katib's webhook rules and
llmft/components/ (which imports katib) use it; the trainer does not.
"""

from __future__ import annotations

import re

from llmft.trainer.errors import ConfigError

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

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
