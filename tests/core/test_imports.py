"""The import rules of docs/architecture.md ("Imports"), enforced.

- Imports flow one way: (the CLI) -> pipelines -> components -> katib -> trainer. components never
  import pipelines; katib imports neither components nor pipelines; the trainer imports none of
  components, pipelines, katib or benchmarks; none of them imports the CLI (at any level, lazily
  included).
- The trainer is what the GPU image runs: none of its modules imports kfp (kfp.kubernetes
  included), the Kubeflow SDKs (kubeflow.training, kubeflow.katib, the Trainer and Katib API
  models), mlflow, langfuse or kserve at module level. Read statically (every statement that
  runs at import time, ``if TYPE_CHECKING:`` blocks excepted) and for real (each module
  imported in a fresh interpreter, sys.modules read after each).
- Nothing imports the bare folder names (``import trainer``): only ``llmft.trainer`` and its
  siblings exist once installed (llmft/<folder> links; tests/core/test_packaging.py).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from llmft import SUBPACKAGES

REPO = Path(__file__).resolve().parents[2]

# Top-level module names the trainer must not load at import time.
ORCHESTRATION = (
    "kfp",
    "kubeflow",
    "kubeflow_katib_api",
    "kubeflow_trainer_api",
    "mlflow",
    "langfuse",
    "kserve",
    "katib",
)

# package -> the packages of ours it must never import (the CLI, llmft.cli and llmft.commands, is the top)
CLI = ("llmft.cli", "llmft.commands")
NEVER = {
    "llmft.trainer": ("llmft.components", "llmft.pipelines", "llmft.katib", "llmft.benchmarks", "llmft.demo", *CLI),
    "llmft.components": ("llmft.pipelines", "llmft.benchmarks", *CLI),
    "llmft.katib": ("llmft.components", "llmft.pipelines", "llmft.benchmarks", "llmft.demo", *CLI),
    "llmft.demo": ("llmft.components", "llmft.pipelines", "llmft.katib", "llmft.benchmarks", *CLI),
    "llmft.pipelines": ("llmft.benchmarks", *CLI),
}


def module_name(path: Path) -> str:
    """The import name of a source file of the package (llmft/trainer/io.py -> llmft.trainer.io)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in SUBPACKAGES:
        parts.insert(0, "llmft")
    return ".".join(parts)


def package_files(folder: str) -> list[Path]:
    """The source files of ``llmft.<folder>`` (llmft/<folder>/), or with ``llmft``, those of the CLI
    (llmft/*.py, llmft/commands/): the files on disk, no link followed."""
    if folder == "llmft":
        skip = {REPO / "llmft" / name for name in SUBPACKAGES}
        found = (p for p in (REPO / "llmft").rglob("*.py") if not skip.intersection(p.parents))
    else:
        found = (REPO / "llmft" / folder).rglob("*.py")
    return sorted(p for p in found if "__pycache__" not in p.parts)


def python_files() -> list[Path]:
    """Every Python file of the checkout (git's view when there is one: tracked and not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        return sorted(REPO / p for p in listed if (REPO / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        folders = ("llmft", "tests", "tools")
        return sorted(p for f in folders for p in (REPO / f).rglob("*.py") if "__pycache__" not in p.parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported: the module body and the blocks in it
    (if/try/with/for/while and class bodies), not function bodies, not ``if TYPE_CHECKING:``."""
    for node in body:
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time_statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _import_time_statements(getattr(node, field, None) or [])
        for handler in getattr(node, "handlers", None) or []:
            yield from _import_time_statements(handler.body)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute module names an Import/ImportFrom statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = package[: len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        return [target] + [f"{target}.{alias.name}" for alias in node.names if alias.name != "*"]
    return []


def imports(path: Path, *, import_time_only: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, or only those that run at import time."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module, is_package = module_name(path), path.name == "__init__.py"
    nodes = _import_time_statements(tree.body) if import_time_only else ast.walk(tree)
    return [(node.lineno, name) for node in nodes for name in _imported(node, module, is_package)]


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def test_the_trainer_imports_no_orchestration_package_at_module_level():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: imports {name} at module level"
        for path in package_files("trainer")
        for line, name in imports(path, import_time_only=True)
        if _under(name, ORCHESTRATION)
    ]
    assert not offenders, (
        "the GPU image's trainer must not need these (import them inside the function):\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize("package", sorted(NEVER))
def test_imports_flow_one_way(package):
    folder = package.split(".")[1]
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {package} imports {name}"
        for path in package_files(folder)
        for line, name in imports(path, import_time_only=False)
        if _under(name, NEVER[package])
    ]
    assert not offenders, "imports flow pipelines -> components -> trainer, katib:\n" + "\n".join(offenders)


def test_nothing_imports_the_bare_folder_names():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: import {name} (write llmft.{name})"
        for path in python_files()
        for line, name in imports(path, import_time_only=False)
        if _under(name, SUBPACKAGES)
    ]
    assert not offenders, "\n".join(offenders)


_PROBE = """
import importlib, json, sys
roots = set(json.loads(sys.argv[1]))
loaded = {}
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
    found = sorted(m for m in sys.modules if m.split(".")[0] in roots)
    if found:
        loaded[name] = found
        break
print(json.dumps(loaded))
"""


def loaded_in_a_fresh_interpreter(roots: Sequence[str], modules: Sequence[str]) -> dict[str, list[str]]:
    """{the first of ``modules`` whose import loaded a package under ``roots``: those loaded}, in a new Python."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(roots)), json.dumps(list(modules))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter imports every trainer module (torch, transformers): about 5 s
def test_importing_every_trainer_module_loads_no_orchestration_package():
    modules = [module_name(p) for p in package_files("trainer")]
    loaded = loaded_in_a_fresh_interpreter(ORCHESTRATION, modules)
    for name, found in loaded.items():
        pytest.fail(f"importing {name} loaded {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}")


def test_the_static_reader_sees_what_it_must():
    """The AST reader itself: module-level and class-level imports count, function bodies and
    TYPE_CHECKING blocks do not, relative imports resolve."""
    source = (
        "from typing import TYPE_CHECKING\nimport mlflow\nif TYPE_CHECKING:\n    import kfp\nelse:\n    import kserve\n"
        "try:\n    import langfuse\nexcept ImportError:\n    import kubeflow.training\n"
        "class A:\n    import katib\n"
        "def f():\n    import kubeflow_katib_api\n"
        "from . import io\nfrom ..components import plan\n"
    )
    path = REPO / "llmft" / "trainer" / "data" / "_probe_not_a_module.py"
    tree = ast.parse(source)
    names = [name for node in _import_time_statements(tree.body) for name in _imported(node, module_name(path), False)]
    assert "mlflow" in names and "kserve" in names and "langfuse" in names and "kubeflow.training" in names
    assert "katib" in names, "class bodies run at import time"
    assert "kfp" not in names and "kubeflow_katib_api" not in names
    assert "llmft.trainer.data.io" in names and "llmft.trainer.components.plan" in names


# --- no import cycles --------------------------------------------------------------------------


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the llmft.* modules it imports anywhere in its file (module level, function-local,
    TYPE_CHECKING). ``from pkg import mod`` is an arrow to ``pkg.mod``, not to the package."""
    files = {module_name(p): p for folder in (*SUBPACKAGES, "llmft") for p in package_files(folder)}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = [t for t in _imported(node, name, is_package) if t in files]
            submodules = [t for t in targets[1:] if isinstance(node, ast.ImportFrom)]
            graph[name].update(t for t in (submodules or targets) if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_cycles():
    """No two modules of the package import one another, directly or through others, at any level
    (function-local and TYPE_CHECKING imports included: a deferred import hides a cycle, it does not break it)."""
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (a function-local import hides one; move the shared part down):\n" + "\n".join(
        " <-> ".join(sorted(c)) + "\n    " + "\n    ".join(f"{m} -> {sorted(graph[m] & c)}" for m in sorted(c))
        for c in found
    )


# What a run needs to be correct, on the fast path or not: none of it may need trainer.fastpath to import.
CORRECTNESS = ("loss.py", "flops.py", "moe_model.py", "moe_aux.py", "fp8_format.py", "model_dir.py")


@pytest.mark.parametrize("name", CORRECTNESS)
def test_correctness_does_not_import_the_fast_path_at_module_level(name):
    """The loss and the packed batch's document boundaries, the FLOP count and MFU, an MoE model's LoRA
    targets, frozen routers and load-balancing loss live outside llmft/trainer/fastpath (issue 26: they imported
    it at module level, so the ImportError guards around it could never fire)."""
    path = REPO / "llmft" / "trainer" / name
    found = [f"line {line}: {imported}" for line, imported in imports(path, import_time_only=True)]
    assert not [f for f in found if "llmft.trainer.fastpath" in f], found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["e", "e2"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_contracts_are_the_bottom_of_components_lib():
    """llmft/components/lib/contracts/ (the plan's schema, volume paths, pod parts, metric definitions) imports no
    other module of components, not even inside a function: every concern may import it, it imports none back
    (issue 48.1; pyproject.toml's layers contract holds the folders above it)."""
    folder = REPO / "llmft" / "components" / "lib" / "contracts"
    siblings = [
        f"{path.name} line {line}: {name}"
        for path in sorted(folder.glob("*.py"))
        for line, name in imports(path, import_time_only=False)
        if _under(name, ("llmft.components",)) and not _under(name, ("llmft.components.lib.contracts",))
    ]
    assert len(list(folder.glob("*.py"))) >= 5
    assert not siblings, siblings


# --- the plan step builds no Katib object, so it loads no Katib SDK (issue 48.1) ---------------------------

PLAN_STEP = ("llmft.components.lib.plan.step", "llmft.components.lib.plan.build", "llmft.components.lib.plan.checks")
"""The plan step's body and what it reads (the pipeline image runs it first, on every run, sweep or not)."""
KATIB_SDK = ("kubeflow_katib_api", "pydantic")
"""Katib's typed API models (pydantic): about 400 modules and 0.7 s, loaded only where an Experiment is built or
parsed (llmft/katib/experiment.py, search_space.py, status.py: ``# heavy:`` imports inside those functions)."""


def import_time_chains(start: str) -> dict[str, list[str]]:
    """{external top-level package: the chain of our modules whose module-level imports load it} for everything
    ``import start`` runs, read from the files (TYPE_CHECKING blocks and function bodies do not run)."""
    files = {module_name(p): p for folder in (*SUBPACKAGES, "llmft") for p in package_files(folder)}
    chains: dict[str, list[str]] = {start: [start]}
    found: dict[str, list[str]] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        path = files[module]
        for _, name in imports(path, import_time_only=True):
            if not _under(name, ("llmft",)):
                found.setdefault(name.split(".")[0], [*chains[module], name])
                continue
            parts = name.split(".")
            for ours in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # a module runs its packages
                if ours in files and ours not in chains:
                    chains[ours] = [*chains[module], ours]
                    todo.append(ours)
    return found


@pytest.mark.parametrize("module", PLAN_STEP)
def test_the_plan_step_loads_no_katib_sdk(module):
    """``import llmft.components.lib.plan.build`` loaded kubeflow_katib_api and pydantic (703 modules, 1.07 s,
    where 311 and 0.30 s without them) through llmft/katib's module-level imports of Katib's API models."""
    chains = import_time_chains(module)
    loaded = {name: " -> ".join(chains[name]) for name in KATIB_SDK if name in chains}
    assert not loaded, "import the Katib models inside the function that builds one (`# heavy:`):\n" + "\n".join(
        loaded.values()
    )


def test_the_import_chain_reader_follows_module_level_imports_only():
    """The reader itself: katib_sweep's builder still loads the SDK where it builds (a function-local import is not
    followed), and a module that imports the SDK at module level is found with its chain."""
    assert "kubeflow_katib_api" not in import_time_chains("llmft.katib.experiment")
    assert "yaml" in import_time_chains("llmft.katib.experiment")
    chain = import_time_chains("llmft.commands.sweep")["yaml"]
    assert chain[0] == "llmft.commands.sweep" and chain[-1] == "yaml", chain


@pytest.mark.slow  # a fresh interpreter imports the plan step (about 0.5 s)
def test_importing_the_plan_step_loads_no_katib_sdk_for_real():
    """The same, measured: what a fresh interpreter holds after importing the plan step (third-party imports
    included, which the file reader above does not follow)."""
    assert loaded_in_a_fresh_interpreter(KATIB_SDK, PLAN_STEP) == {}


def _is_component_body(node: ast.AST) -> bool:
    """A KFP component function (``@dsl.component``): KFP ships its source alone, so it imports inside."""
    return isinstance(node, ast.FunctionDef) and any("component" in ast.unparse(d) for d in node.decorator_list)


MARKERS = ("# heavy:", "# optional:")


def _deferred_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, source line) of each unmarked import inside a function body of the file (KFP component
    bodies excepted)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    components = {id(n) for c in ast.walk(tree) if _is_component_body(c) for n in ast.walk(c)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom) and id(inner) not in components:
                    around = lines[inner.end_lineno - 1] + lines[inner.lineno - 2]
                    if not any(marker in around for marker in MARKERS):
                        yield inner.lineno, lines[inner.lineno - 1].strip()


@pytest.mark.parametrize("folder", [*SUBPACKAGES, "llmft"])
def test_a_function_defers_an_import_only_for_a_heavy_or_optional_dependency(folder):
    """A function-local import hides nothing: it defers a heavy package (torch, kfp, kubernetes, mlflow,
    ... or a module of ours that imports one at import time) and says so with ``# heavy: <package>``,
    or it is an optional one inside ``try: ... except ImportError`` marked ``# optional: <module>``;
    everything else is imported at module level, where the cycle check and a reader see it. KFP
    component bodies (``@dsl.component``) import inside by KFP's rule and are exempt."""
    offenders = sorted(
        {
            f"{path.relative_to(REPO)}:{line}: {text}"
            for path in package_files(folder)
            for line, text in _deferred_imports(path)
        }
    )
    assert not offenders, "import at module level, or mark the deferral `# heavy: <package>`:\n" + "\n".join(offenders)


def test_the_deferral_reader_sees_unmarked_imports_only():
    source = (
        "import os\n"
        "def f():\n    import json\n    import torch  # heavy: torch\n"
        "    try:\n        # optional: llmft.trainer.fastpath\n        import llmft.trainer.fastpath  # noqa: F401\n"
        "    except ImportError:\n        pass\n"
        "@dsl.component(base_image='x')\ndef body():\n    import json\n"
    )
    path = REPO / "build" / "_deferral_probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source, encoding="utf-8")
    try:
        assert list(_deferred_imports(path)) == [(3, "import json")]
    finally:
        path.unlink()
