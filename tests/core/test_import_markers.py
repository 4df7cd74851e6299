"""A function-local import says why it is there, and what it says is measured (issue 26; issue 38 item 6).

A function-local import hides an import from the cycle check and from a reader, so it exists only to
defer a heavy package or to try an optional one, and its marker says which (docs/architecture.md, "Imports"):

- ``# heavy: a, b`` (at the end of the import, or on the line above it): in a fresh interpreter, after the
  module that holds it is imported, running the import statement newly loads every package it names, and
  each of them is in :data:`HEAVY`. A marker that names a light package, or one the import does not load
  (already loaded by the module itself, or not loaded at all), fails with the file, line and the fix.
- ``# optional: <module>``: the import sits inside ``try: ... except ImportError`` (or
  ModuleNotFoundError), so a missing package takes the fallback instead of raising.

What is heavy, measured: ``python -X importtime -c "import <what the code imports>"``, the top line's
cumulative time, best of 5, on the shared 2-core development machine (torch 2.13 CPU, transformers 5,
kfp 2.17), and the number of modules it adds to ``sys.modules``. The threshold is 250 ms or 500
modules: what ``llmft --help`` (about 60 ms of our own imports) and the pipeline image's light entry
points would notice. Below it, import at module level. One exception, said in :data:`HEAVY`: pyarrow,
just under the bar, outside the base install, and needed by one input kind (.parquet) only.

============================================== ======= ========  ====
what is imported                                 ms     modules  heavy
============================================== ======= ========  ====
``import orjson``                                   ~5       22   no
``import yaml`` (pyyaml, C loader)                 ~20       28   no
``import docstring_parser``                        ~25       24   no
``import jinja2``                                  ~40       63   no
``import numpy``                                   ~60      116   no
``import tqdm``                                    ~60       93   no
``import urllib3``                                 ~70      117   no
``import jsonschema``                              ~80      105   no
``import kfp_server_api``                         ~120      228   no
``import pyarrow.parquet``                        ~170      168   yes (see above)
``import optuna``                                 ~300      371   yes
``import matplotlib.pyplot``                      ~400      400   yes
``import kubeflow_katib_api.models`` (pydantic)   ~500      160   yes
``import langfuse``                               ~700      672   yes
``import kubernetes``                             ~770     1395   yes
``import kfp``                                    ~950     1593   yes
``from transformers import AutoTokenizer``       ~1100      600   yes
``import datasets``                              ~1300     1044   yes
``import kserve``                                ~1900     2462   yes
``import torch``                                 ~1900     1064   yes
``import mlflow``                                ~2000     1876   yes
``import deepspeed`` / bitsandbytes / peft      4000-7000  2500+  yes
============================================== ======= ========  ====

A package absent from this environment (GPU-only: triton, liger_kernel, flash_attn) cannot be measured:
it is listed in :data:`GPU_ONLY`, and a marker naming it passes when the import statement or the module it
imports names that package in an import (read from the source), the rest of the marker measured as usual.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_imports import REPO, module_name, package_files

from llmft import SUBPACKAGES

HEAVY = {
    "torch": "~1.9 s, 1,064 modules",
    "transformers": "~1.1 s and 600 modules for the first model or tokenizer class (the package itself is lazy)",
    "peft": "~7 s: loads torch and transformers",
    "safetensors": "safetensors.torch loads torch (the bare package is 1 ms: name torch where that is the point)",
    "tokenizers": "the Rust tokenizers' Python side; only with transformers (~1.1 s together)",
    "huggingface_hub": "snapshot_download loads the hub client, requests and filelock (~0.3 s)",
    "datasets": "~1.3 s, 1,044 modules (pyarrow, pandas, fsspec)",
    "deepspeed": "~4.8 s: loads torch and its op builders",
    "bitsandbytes": "~5 s: loads torch and its CUDA/CPU kernels",
    "compressed_tensors": "~6 s: loads torch and transformers",
    "kfp": "~1 s, 1,593 modules (kfp_server_api, google.protobuf, kubernetes)",
    "kubernetes": "~0.8 s, 1,395 modules (every API model)",
    "kubeflow": "kubeflow.training ~0.8 s and kubeflow.trainer ~1.6 s: kubernetes and the API models",
    "kubeflow_trainer_api": "its models: pydantic models of every Trainer API type (~0.5 s)",
    "kubeflow_katib_api": "its models: pydantic models of every Katib API type (~0.5 s)",
    "pydantic": "only together with the API models above, which build their schemas at import",
    "mlflow": "~2 s, 1,876 modules",
    "langfuse": "~0.7 s, 672 modules (opentelemetry)",
    "kserve": "~1.9 s, 2,462 modules",
    "matplotlib": "pyplot ~0.4 s, 400 modules",
    "optuna": "~0.3 s, 371 modules (sqlalchemy, alembic)",
    "pyarrow": "pyarrow.parquet ~0.2 s, 168 modules, outside the base install: read for .parquet inputs only",
    "lm_eval": "lm_eval.models.huggingface loads torch and transformers",
}
"""Packages worth deferring, with what importing them costs (measured as the module docstring says)."""

LIGHT = (
    "yaml",
    "tqdm",
    "orjson",
    "urllib3",
    "jsonschema",
    "numpy",
    "jinja2",
    "docstring_parser",
    "kfp_server_api",
    "llmft",
)
"""Measured and found light (see the table above): import them at module level."""

GPU_ONLY = {
    "triton": "CUDA kernels' compiler: installs with torch on CUDA only",
    "liger_kernel": "the gpu extra; needs triton",
    "flash_attn": "built against CUDA",
}
"""Packages a CPU environment has not got: a marker naming one is checked by reading the source."""

MARKER = re.compile(r"#\s*(heavy|optional):\s*(.*)$")
PACKAGE = re.compile(r"[A-Za-z_]\w*(\.\w+)*$")


@dataclass(frozen=True)
class Marked:
    """One import statement that carries a marker."""

    path: Path
    line: int
    kind: str  # "heavy" or "optional"
    text: str  # what follows "heavy:" / "optional:"
    statement: str  # the import statement, as source
    guarded: bool  # inside the body of ``try:`` whose handlers catch ImportError
    function_local: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def names(self) -> list[str]:
        return [name.strip() for name in self.text.split(",")]


def marker_of(lines: list[str], node: ast.stmt) -> tuple[str, str] | None:
    """(kind, text) of the marker of an import statement: at the end of its last line, else on the line
    above it (a comment line, or the ``try:`` that opens its guard)."""
    for index in (node.end_lineno - 1, node.lineno - 2):
        if index < 0:
            continue
        line = lines[index]
        found = MARKER.search(line)
        if found and (index == node.end_lineno - 1 or line.strip().startswith(("#", "try:"))):
            return found.group(1), found.group(2).strip()
    return None


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught] if caught else []
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _walk(body: list[ast.stmt], guarded: bool, local: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every statement under ``body`` with (guarded, function_local) as they hold at it."""
    for node in body:
        yield node, guarded, local
        inner_local = local or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if isinstance(node, ast.Try | ast.TryStar):
            catches = any(_catches_import_error(h) for h in node.handlers)
            yield from _walk(node.body, guarded or catches, inner_local)
            for part in (node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _walk(part, guarded, inner_local)
            continue
        for field in ("body", "orelse", "finalbody"):
            part = getattr(node, field, None)
            if isinstance(part, list):
                yield from _walk(part, guarded, inner_local)
        for case in getattr(node, "cases", None) or []:
            yield from _walk(case.body, guarded, inner_local)


def marked_imports(path: Path) -> list[Marked]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for node, guarded, local in _walk(ast.parse("\n".join(lines)).body, False, False):
        if isinstance(node, ast.Import | ast.ImportFrom) and (marker := marker_of(lines, node)):
            found.append(Marked(path, node.lineno, *marker, ast.unparse(node), guarded, local))
    return found


def all_marked(kind: str) -> list[Marked]:
    return [
        m
        for folder in (*SUBPACKAGES, "llmft")
        for p in package_files(folder)
        for m in marked_imports(p)
        if m.kind == kind
    ]


# --- static checks -----------------------------------------------------------------------------


def test_every_optional_import_is_guarded():
    """``# optional:`` says a missing package is survivable: only an ``except ImportError`` around it makes
    that true (issue 38: llmft/trainer/loss.py's fast-path import had none)."""
    offenders = [f"{m.where}: {m.statement}" for m in all_marked("optional") if not m.guarded]
    assert not offenders, (
        "an `# optional:` import sits inside `try: ... except ImportError:` with a fallback; "
        "if the package is always there, import it plainly (at module level, or `# heavy:` if heavy):\n"
        + "\n".join(offenders)
    )


def test_every_heavy_marker_names_heavy_packages():
    offenders = []
    for m in all_marked("heavy"):
        for name in m.names:
            top = name.split(".")[0]
            if not PACKAGE.match(name):
                offenders.append(f"{m.where}: `# heavy: {m.text}`: {name!r} is not a package name (list packages)")
            elif not m.function_local:
                offenders.append(f"{m.where}: `# heavy:` on a module-level import defers nothing: drop the marker")
            elif top not in HEAVY and top not in GPU_ONLY:
                why = "measured light (see this test's docstring)" if top in LIGHT else "not in HEAVY"
                offenders.append(
                    f"{m.where}: `# heavy: {m.text}`: {top} is {why}: drop it from the marker "
                    "(import at module level when nothing heavy is left)"
                )
    assert not offenders, "\n".join(sorted(set(offenders)))


# --- measured ----------------------------------------------------------------------------------

_PROBE = r"""
import importlib, json, os, sys

module, package, statements, heavy = json.loads(sys.stdin.read())
importlib.import_module(module)
base = set(sys.modules)


class Requested(BaseException):  # not an ImportError: no `except ImportError` of the code under test catches it
    pass


class Watch:
    # First on sys.meta_path: an import that would load a module of the package stops there. Only real
    # imports count (importlib's _find_and_load for that name on the stack), not importlib.util.find_spec.
    def __init__(self, package):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == self.package or fullname == self.package:
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_name == "_find_and_load_unlocked" and frame.f_locals.get("name") == fullname:
                    raise Requested(fullname)
                frame = frame.f_back
        return None


def run(source, package_watched):
    if package_watched:
        sys.meta_path.insert(0, Watch(package_watched))
    try:
        exec(compile(source, module, "exec"), {"__name__": module, "__package__": package})
    except Requested:
        return True
    if package_watched:
        return False
    return sorted({m.split(".")[0] for m in set(sys.modules) - base} & set(heavy))


def in_child(source, package_watched):
    # A fork of the interpreter that imported the module: each statement starts from that state alone.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = {"result": run(source, package_watched)}
        except BaseException as exc:
            out = {"error": type(exc).__name__ + ": " + str(exc)}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": "the child process died"}


results = []
for source, names in statements:
    loads = {name: in_child(source, name) for name in names}
    errors = [got["error"] for got in loads.values() if "error" in got]
    result = {"error": errors[0]} if errors else {"loads": {n: got["result"] for n, got in loads.items()}}
    if not errors and not all(result["loads"].values()):
        result["heavy"] = in_child(source, None).get("result", [])
    results.append(result)
print("PROBE " + json.dumps(results))
"""


def measure(module: str, is_package: bool, statements: list[tuple[str, list[str]]], cwd: Path = REPO) -> list[dict]:
    """For each (import statement, package names): whether running the statement, in a fork of one
    interpreter that imported ``module``, starts loading a module of each package not loaded yet
    ({"loads": {name: bool}}; with "heavy": the HEAVY packages it does load when one is False), or
    {"error": ...} when it raised."""
    package = module if is_package else module.rpartition(".")[0]
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=json.dumps([module, package, statements, sorted(HEAVY)]),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert result.returncode == 0 and lines, f"importing {module}: {result.stderr[-3000:]}"
    return json.loads(lines[-1][len("PROBE ") :])


def verdicts(marks: list[Marked], results: list[dict]) -> Iterator[str]:
    """One line per false marker: what it names that the import does not load, and the fix."""
    for m, got in zip(marks, results, strict=True):
        if "error" in got:
            yield f"{m.where}: `{m.statement}` raised {got['error']}"
            continue
        wrong = [name for name, loads in got["loads"].items() if not loads]
        if wrong:
            heavy = got["heavy"]
            fix = f"mark it `# heavy: {', '.join(heavy)}`" if heavy else "import it at module level"
            yield (
                f"{m.where}: `{m.statement}` is marked `# heavy: {m.text}` but loads no module of "
                f"{', '.join(wrong)} that its module has not loaded (it loads {', '.join(heavy) or 'nothing heavy'}): "
                + fix
            )


def probe(path: Path, marks: list[Marked]) -> list[str]:
    statements = [(m.statement, [n for n in m.names if PACKAGE.match(n)]) for m in marks]
    return list(verdicts(marks, measure(module_name(path), path.name == "__init__.py", statements)))


@pytest.mark.slow  # one interpreter per module that holds markers, one fork per import statement and package
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe forks one child per import statement")
def test_every_heavy_marker_defers_what_it_names():
    by_file: dict[Path, list[Marked]] = {}
    for m in all_marked("heavy"):
        if m.function_local:
            by_file.setdefault(m.path, []).append(m)
    workers = max(1, min(4, (os.cpu_count() or 2) // 2))
    with ThreadPoolExecutor(workers) as pool:
        found = pool.map(lambda item: probe(*item), sorted(by_file.items()))
    offenders = [line for lines in found for line in lines]
    assert not offenders, "a `# heavy:` marker names what the import newly loads, and only heavy packages:\n" + (
        "\n".join(offenders)
    )


def test_the_marker_reader_sees_markers_guards_and_function_bodies(tmp_path):
    source = (
        "import os  # heavy: torch\n"
        "def f():\n    # heavy: torch, numpy\n    import torch\n"
        "    import yaml\n"
        "    try:\n        # optional: flash_attn\n        import flash_attn\n"
        "    except (ValueError, ModuleNotFoundError):\n        pass\n"
        "    try:\n        import liger_kernel  # optional: liger_kernel\n    except ValueError:\n        pass\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    found = [(m.line, m.kind, m.names, m.guarded, m.function_local) for m in marked_imports(path)]
    assert found == [
        (1, "heavy", ["torch"], False, False),
        (4, "heavy", ["torch", "numpy"], False, True),
        (8, "optional", ["flash_attn"], True, True),
        (12, "optional", ["liger_kernel"], False, True),
    ]


@pytest.mark.slow  # one interpreter and a fork per statement
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe forks one child per import statement")
def test_the_probe_tells_a_deferred_load_from_one_already_done(tmp_path):
    """Standard-library modules stand in for packages: ``wave`` is not loaded by the module, ``colorsys``
    is; asking importlib.util.find_spec about a package is no load; an import of a missing package inside
    ``try`` still counts as loading it (GPU-only packages on this machine)."""
    (tmp_path / "holder.py").write_text("import colorsys\n", encoding="utf-8")
    statements = [
        ("import wave", ["wave"]),
        ("import colorsys", ["colorsys"]),
        ("import importlib.util\nimportlib.util.find_spec('wave')", ["wave"]),
        ("try:\n    import not_installed_anywhere\nexcept ImportError:\n    pass", ["not_installed_anywhere"]),
    ]
    got = measure("holder", False, statements, cwd=tmp_path)
    assert [g["loads"] for g in got] == [
        {"wave": True},
        {"colorsys": False},
        {"wave": False},
        {"not_installed_anywhere": True},
    ]
    assert got[1]["heavy"] == [] and "heavy" not in got[0]
