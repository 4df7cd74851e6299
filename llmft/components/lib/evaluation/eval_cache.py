"""The offline cache of lm-eval task data on the data volume (``<volume>/eval-cache``, /data/eval-cache on a cluster).

Air-gapped clusters cannot reach a dataset hub. ``llmft eval cache arc_easy mmlu_abstract_algebra --cache DIR``
runs on a connected machine (:func:`cache_tasks`): it resolves each name with lm-eval's own task index (a task, a
group or a tag; groups and tags expand to their tasks), downloads each task's dataset with
``datasets.load_dataset`` exactly as lm-eval would (its ``dataset_path``, ``dataset_name``, ``dataset_kwargs``),
and writes every split the task reads (test, validation, training, few-shot) as one Parquet file, plus
``index.json``: per name its tasks; per task the registry YAML it came from, the dataset, the task version, the
metrics it reports, and each split's file, rows, bytes and SHA-256. Copy DIR to the volume's ``eval-cache``.

Offline, the evaluate step hands lm-eval the registry's own task config with only its data source replaced by
those files (:func:`offline_config`: ``dataset_path: parquet``, ``data_files`` per split), which ``datasets``' packaged
Parquet builder reads without a hub. The plan step checks in seconds that every file is there with its size
(:func:`check_cached`), or refuses in one line naming the task, its dataset and the command that caches it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmft.components.lib.evaluation.lm_eval_registry import families, registry_dir
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.io import atomic_write_json

INDEX = "index.json"
INDEX_FORMAT = 1
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")
"""The fields of an lm-eval task config that name a split it reads."""
DEFAULT_METRICS = {
    "loglikelihood": ["perplexity", "acc"],
    "loglikelihood_rolling": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    "multiple_choice": ["acc", "acc_norm"],
    "generate_until": ["exact_match"],
}
"""The metrics of a task config without ``metric_list``: lm_eval 0.4.13 ``lm_eval/api/registry.py`` 449-457."""


def cache_command(names: list[str]) -> str:
    return f"llmft eval cache {' '.join(names)} --cache <dir>"


def read_index(cache_dir: str | Path) -> dict[str, Any]:
    """The cache's index.json (empty when there is none); DataError naming the file when it is not ours."""
    path = Path(cache_dir) / INDEX
    if not path.is_file():
        return {"format": INDEX_FORMAT, "names": {}, "tasks": {}}
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DataError(f"{path}: not the JSON index `llmft eval cache` writes ({exc}); re-run the command") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise DataError(f"{path}: not an index of format {INDEX_FORMAT}; re-run `llmft eval cache` to rewrite it")
    return index


def check_cached(cache_dir: str | Path, name: str) -> dict[str, Any] | None:
    """The cache's entry for ``name`` (its tasks' entries under ``tasks``) with every file present at its recorded
    size; None when the cache has no entry; DataError naming the missing or changed file."""
    index = read_index(cache_dir)
    entry = index["names"].get(name)
    if entry is None:
        return None
    tasks = {leaf: index["tasks"][leaf] for leaf in entry["leaves"]}
    for leaf, task in tasks.items():
        for split, record in task["splits"].items():
            path = Path(cache_dir) / record["file"]
            size = path.stat().st_size if path.is_file() else None
            if size != record["bytes"]:
                state = "missing" if size is None else f"{size} bytes, not the {record['bytes']} cached"
                raise DataError(
                    f"eval task {name!r}: {path} ({leaf}, split {split}) is {state}; re-run "
                    f"`{cache_command([name])}` on a connected machine and copy the folder to {cache_dir}"
                )
    return {**entry, "tasks": tasks, "lm_eval": index.get("lm_eval", "")}


def offline_config(cache_dir: str | Path, leaf: str, task: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's config of registry task ``leaf`` (the installed registry's YAML, its ``!function`` helpers
    included: lm-eval's own code) reading the cached Parquet files instead of a hub."""
    from lm_eval.tasks._yaml_loader import load_yaml  # heavy: lm_eval

    root = registry_dir()
    if root is None:
        raise ConfigError(f"eval task {leaf!r} needs lm-eval in the evaluate step's image: pip install "
                          "'kfp-llm-finetune[eval]'")  # fmt: skip
    config = dict(load_yaml(root / task["yaml"], resolve_func=True))
    for key in ("tag", "group", "task_list"):
        config.pop(key, None)
    files = {split: str(Path(cache_dir) / record["file"]) for split, record in task["splits"].items()}
    return {
        **config,
        **task.get("overrides", {}),
        "task": leaf,
        "dataset_path": "parquet",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": files},
    }


# ----------------------------------------------------------------------------- the cache command (connected)


def cache_tasks(
    names: list[str], cache_dir: str | Path, *, load_dataset: Callable[..., Any] | None = None
) -> list[str]:
    """Download and write the data of every task ``names`` stand for (see the module docstring); the lines to
    print. ``load_dataset``: ``datasets.load_dataset`` unless given (tests hand in a generated dataset)."""
    from lm_eval import __version__ as lm_eval_version  # heavy: lm_eval
    from lm_eval.tasks._index import TaskIndex  # heavy: lm_eval

    if load_dataset is None:
        import datasets  # heavy: datasets

        load_dataset = datasets.load_dataset
    cache_dir = Path(cache_dir)
    root = registry_dir()
    folders = families(names) or ([root] if root else [])
    registry = TaskIndex.build(folders)
    index = read_index(cache_dir)
    lines = []
    for name in names:
        leaves = _expand(name, registry, {})
        for leaf, (yaml_path, overrides) in leaves.items():
            index["tasks"][leaf] = _cache_leaf(leaf, yaml_path, overrides, cache_dir, load_dataset)
            splits = index["tasks"][leaf]["splits"]
            lines.append(f"{leaf}: " + ", ".join(f"{s} {r['rows']} rows" for s, r in splits.items()))
        index["names"][name] = {"kind": registry[name].kind.name.lower(), "leaves": sorted(leaves)}
    index["lm_eval"] = lm_eval_version
    atomic_write_json(cache_dir / INDEX, index)
    return lines + [
        f"cached {len(names)} name(s) in {cache_dir}; copy it to eval-cache/ on the data volume (/data/eval-cache)"
    ]


def _expand(name: str, registry: dict, overrides: dict) -> dict[str, tuple[Path, dict]]:
    """Task name -> (its YAML, overrides a group applies) for every task ``name`` stands for."""
    from lm_eval.tasks._index import Kind  # heavy: lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml  # heavy: lm_eval

    entry = registry.get(name)
    if entry is None:
        raise ConfigError(f"{name!r} is not an lm-eval task, group or tag of lm-eval's registry (lm_eval/tasks)")
    if entry.kind == Kind.TAG:
        return {k: v for tag in sorted(entry.tags) for k, v in _expand(tag, registry, overrides).items()}
    if entry.kind != Kind.GROUP:
        return {name: (entry.yaml_path, overrides)}
    config = load_yaml(entry.yaml_path, resolve_func=False)
    members = config.get("task") or []
    found: dict[str, tuple[Path, dict]] = {}
    for item in members if isinstance(members, list) else [members]:
        child, extra = (item, {}) if isinstance(item, str) else (item["task"], {k: v for k, v in item.items()})
        extra.pop("task", None)
        found |= _expand(child, registry, {**overrides, **extra})
    return found


def _cache_leaf(leaf: str, yaml_path: Path, overrides: dict, cache_dir: Path, load_dataset) -> dict[str, Any]:
    from lm_eval.tasks._yaml_loader import load_yaml  # heavy: lm_eval

    config = {**load_yaml(yaml_path, resolve_func=False), **overrides}
    path, name = str(config.get("dataset_path") or ""), config.get("dataset_name")
    if not path:
        raise ConfigError(f"lm-eval task {leaf!r} ({yaml_path}) names no dataset_path: nothing to cache")
    data = load_dataset(path=path, name=name, **(config.get("dataset_kwargs") or {}))
    wanted = sorted({str(config[k]) for k in SPLIT_KEYS if config.get(k)})
    folder = Path(_safe(path)) / _safe(str(name or "default"))
    splits = {}
    for split in wanted:
        if split not in data:
            continue
        target = cache_dir / folder / f"{split}.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        data[split].to_parquet(str(tmp))
        tmp.replace(target)
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        splits[split] = {"file": str(folder / target.name), "rows": len(data[split]), "bytes": target.stat().st_size,
                         "sha256": digest}  # fmt: skip
    root = registry_dir()
    metrics = [m["metric"] for m in config.get("metric_list") or [] if isinstance(m.get("metric"), str)]
    filters = [f["name"] for f in config.get("filter_list") or [] if isinstance(f, dict) and f.get("name")]
    return {
        "yaml": str(Path(yaml_path).resolve().relative_to(root.resolve())) if root else str(yaml_path),
        "dataset_path": path,
        "dataset_name": name,
        "version": (config.get("metadata") or {}).get("version"),
        "output_type": config.get("output_type", ""),
        "metrics": metric_names(metrics or DEFAULT_METRICS.get(config.get("output_type", ""), []), filters),
        "overrides": overrides,
        "splits": splits,
    }


def metric_names(metrics: list[str], filters: list[str]) -> list[str]:
    """Our names of lm-eval's ``<metric>,<filter>`` result keys: ``acc`` for filter ``none``, else
    ``<metric>_<filter>`` (``exact_match_strict_match``)."""
    return [m if f == "none" else f"{m}_{f.replace('-', '_')}" for m in metrics for f in (filters or ["none"])]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "__", text).strip(".") or "_"
