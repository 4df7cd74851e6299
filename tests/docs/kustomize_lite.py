"""The subset of kustomize that deploy/kustomization.yaml uses, in plain Python.

Tests render deploy/ with this when `kubectl` is absent, and compare it with
`kubectl kustomize` when present, so the manifests are checked either way.
Supported: resources (files), namespace, labels (metadata only), configMapGenerator
from env files with the local-config annotation, and replacements whose targets
are selected by kind and name with dotted field paths (and options.delimiter/index).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

LOCAL_CONFIG = "config.kubernetes.io/local-config"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "replacements"}


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments ignored (kustomize's env-file rules)."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        key, value = line.split("=", 1)
        values[key.strip()] = value
    return values


def _generated_config_maps(kustomization: dict, root: Path) -> list[dict]:
    objects = []
    for generator in kustomization.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for env in generator.get("envs", []):
            data.update(read_env_file(root / env))
        annotations = dict(generator.get("options", {}).get("annotations", {}))
        metadata: dict[str, Any] = {"name": generator["name"]}
        if annotations:
            metadata["annotations"] = annotations
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return objects


def _apply_namespace(objects: list[dict], namespace: str | None) -> None:
    if not namespace:
        return
    for obj in objects:
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace
        elif obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace


def _apply_labels(objects: list[dict], label_sets: list[dict]) -> None:
    for label_set in label_sets:
        if label_set.get("includeSelectors"):
            raise NotImplementedError("labels.includeSelectors is not supported by kustomize_lite")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def _set_path(obj: Any, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    parent = _get_path(obj, ".".join(parts[:-1])) if len(parts) > 1 else obj
    last = parts[-1]
    if isinstance(parent, list):
        parent[int(last)] = value
    else:
        parent[last] = value


def _matches(obj: dict, selector: dict) -> bool:
    if obj["kind"] != selector.get("kind", obj["kind"]):
        return False
    return "name" not in selector or obj["metadata"]["name"] == selector["name"]


def _apply_replacements(objects: list[dict], replacements: list[dict]) -> None:
    for replacement in replacements:
        source_sel = replacement["source"]
        sources = [o for o in objects if _matches(o, source_sel)]
        if len(sources) != 1:
            raise ValueError(f"replacement source {source_sel} matches {len(sources)} objects, expected 1")
        value = _get_path(sources[0], source_sel["fieldPath"])
        for target in replacement["targets"]:
            matched = [o for o in objects if _matches(o, target["select"])]
            if not matched:
                raise ValueError(f"replacement target {target['select']} matches nothing")
            for obj in matched:
                for field_path in target["fieldPaths"]:
                    _set_path(obj, field_path, _with_options(_get_path(obj, field_path), value, target))


def _with_options(current: Any, value: Any, target: dict) -> Any:
    """kustomize's replacement ``options``: with ``delimiter``, replace only field ``index`` of the target's value."""
    options = target.get("options") or {}
    if "delimiter" not in options:
        return value
    parts = str(current).split(options["delimiter"])
    parts[int(options.get("index", 0))] = str(value)
    return options["delimiter"].join(parts)


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` would print, in resource order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise NotImplementedError(f"kustomize_lite does not support {sorted(unknown)}")
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        objects.extend(d for d in yaml.safe_load_all((directory / resource).read_text()) if d)
    objects.extend(_generated_config_maps(kustomization, directory))
    objects = copy.deepcopy(objects)
    _apply_namespace(objects, kustomization.get("namespace"))
    _apply_labels(objects, kustomization.get("labels", []))
    _apply_replacements(objects, kustomization.get("replacements", []))
    return [o for o in objects if o["metadata"].get("annotations", {}).get(LOCAL_CONFIG) != "true"]
