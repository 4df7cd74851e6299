"""lm-eval's task registry read as files, without importing lm_eval (the plan step and ``llmft pipeline compile``
run where importing it costs 20 s and indexing its ~14,000 task YAMLs with its own TaskManager ~100 s).

:func:`registry_dir` finds the installed package's ``tasks/`` folder (``importlib.util.find_spec`` loads nothing);
:func:`families` scans the YAML text once for the names asked (a whole-word match, about 5 s over the whole
registry) and returns the top-level task folders that mention them: lm-eval's own index of just those folders
(eval_cache.py) then resolves the names exactly as lm-eval does. :func:`defined` says whether a name is a task,
group or tag the registry declares (``task:``, ``group:``, ``tag:`` keys), :func:`dataset_of` which hub dataset a
task file reads (following its ``include:``), for the plan step's one-line refusal.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

import yaml

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,199}$")
"""What an lm-eval task, group or tag name looks like here (letters, digits, _ . : + -; at most 200 characters)."""


@functools.cache
def registry_dir() -> Path | None:
    """``<site-packages>/lm_eval/tasks`` of the installed lm-eval, or None without it."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tasks"
    return folder if folder.is_dir() else None


@functools.cache
def _texts() -> tuple[tuple[Path, str], ...]:
    root = registry_dir()
    found: list[tuple[Path, str]] = []
    if root is None:
        return ()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for name in files:
            if name.endswith((".yaml", ".yml")):
                path = Path(folder, name)
                found.append((path, path.read_text(encoding="utf-8", errors="replace")))
    return tuple(found)


def _mentions(name: str) -> list[tuple[Path, str]]:
    word = re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])")
    return [(path, text) for path, text in _texts() if name in text and word.search(text)]


def families(names: list[str]) -> list[Path]:
    """The top-level folders of ``lm_eval/tasks`` whose YAMLs mention any of ``names`` as a whole word."""
    root = registry_dir()
    if root is None:
        return []
    found = {root / path.relative_to(root).parts[0] for name in names for path, _ in _mentions(name)}
    return sorted(p for p in found if p.is_dir())


def _declares(text: str, name: str) -> bool:
    key = re.compile(rf"^(task|group|tag):\s*['\"]?{re.escape(name)}['\"]?\s*(#.*)?$", re.M)
    listed = re.compile(rf"^tag:\s*\n(\s+-\s*\S+\s*\n)*?\s+-\s*['\"]?{re.escape(name)}['\"]?\s*$", re.M)
    inline = re.compile(rf"^tag:\s*\[[^\]]*(?<![\w.-]){re.escape(name)}(?![\w.-])[^\]]*\]", re.M)
    return bool(key.search(text) or listed.search(text) or inline.search(text))


def defined(name: str) -> Path | None:
    """The first registry YAML that declares ``name`` as a task, group or tag; None when none does (or without
    lm-eval here)."""
    return next((path for path, text in _mentions(name) if _declares(text, name)), None)


class _Lenient(yaml.SafeLoader):
    """Reads lm-eval's YAML for its data fields only: a ``!function`` tag is read as its text, never run."""


_Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)


def dataset_of(path: Path, depth: int = 0) -> tuple[str, str]:
    """(dataset_path, dataset_name) a task YAML reads, following ``include:`` (('', '') when it names none)."""
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_Lenient)  # noqa: S506 - a safe loader
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return "", ""
    if not isinstance(config, dict):
        return "", ""
    found = (str(config.get("dataset_path") or ""), str(config.get("dataset_name") or ""))
    include = config.get("include")
    if not found[0] and isinstance(include, str) and depth < 8:
        inherited = dataset_of(path.parent / include, depth + 1)
        return inherited[0], found[1] or inherited[1]
    return found
