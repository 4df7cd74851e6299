"""Tools that read imports see the package arrows of docs/architecture.md (issue 26 item 1, issue 38 item 1).

Two readers, each from the checkout's root: grimp (the graph behind import-linter) builds the import
graph of ``llmft``; and a plain ``ast`` walk of the files on disk (``os.walk`` from the root, no link
followed, a file's module name is its path: what any tool that knows nothing of this project reads).
Both take module-level and function-local imports alike. The package-level arrows each finds must be
exactly the list in docs/architecture.md between the ``package-arrows`` markers: an import that adds
an arrow (or the last one that removes one) fails here until the document says so.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from llmft import SUBPACKAGES

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("llmft.cli", "llmft.commands", *(f"llmft.{name}" for name in SUBPACKAGES))


def documented_arrows(text: str) -> set[tuple[str, str]]:
    """The ``importer -> imported, imported`` lines between the package-arrows markers."""
    block = re.search(r"<!-- package-arrows: begin -->(.*?)<!-- package-arrows: end -->", text, re.S)
    assert block, f"{DOC}: the package-arrows markers are missing"
    arrows = set()
    for line in block.group(1).splitlines():
        if "->" not in line:
            continue
        importer, imported = (part.strip() for part in line.split("->"))
        arrows |= {(importer, name.strip()) for name in imported.split(",")}
    return arrows


def tool_arrows() -> set[tuple[str, str]]:
    """Every (importer, imported) pair of our packages that grimp's graph holds."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("llmft")
    return {
        (a, b)
        for a in PACKAGES
        for b in PACKAGES
        if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True)
    }


def test_the_tool_sees_every_module_of_the_package():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("llmft")
    on_disk = {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for name in SUBPACKAGES
        for path in (REPO / "llmft" / name).rglob("*.py")
    }
    assert on_disk <= graph.modules, sorted(on_disk - graph.modules)[:5]


def test_the_tool_draws_the_documented_arrows():
    documented = documented_arrows(DOC.read_text(encoding="utf-8"))
    drawn = tool_arrows()
    assert drawn == documented, (
        f"not in docs/architecture.md: {sorted(drawn - documented)}; "
        f"documented but not drawn: {sorted(documented - drawn)}"
    )


SKIPPED_DIRS = {"tests", "build", "runs", "__pycache__"}  # tests, and what a run or a build leaves


def files_on_disk(root: Path = REPO) -> dict[str, Path]:
    """module name -> file, for every ``.py`` file a walk from ``root`` finds: no link followed, hidden
    folders (venvs, caches) and tests skipped; the name is the path (``a/b/c.py`` -> ``a.b.c``)."""
    found = {}
    for directory, dirs, files in os.walk(root):  # followlinks=False: a link is never entered (none are committed)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory, name)
                found[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imported_names(path: Path) -> set[str]:
    """Every absolute module name an import statement of the file names, with ``from a import b`` as both
    ``a`` and ``a.b`` (the reader cannot tell a module from a name without looking)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def package_of(module: str) -> str | None:
    """The documented package a module belongs to (llmft.trainer.data.io -> llmft.trainer), if any."""
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)


def walked_arrows(root: Path = REPO) -> set[tuple[str, str]]:
    """The package arrows of the files on disk: an import counts when it names a file the walk found."""
    files = files_on_disk(root)
    arrows = set()
    for module, path in files.items():
        importer = package_of(module)
        for name in imported_names(path) & files.keys():
            imported = package_of(name)
            if importer and imported and importer != imported:
                arrows.add((importer, imported))
    return arrows


def test_a_plain_walk_of_the_files_finds_every_package_under_its_import_name():
    modules = files_on_disk()
    for package in PACKAGES:
        assert any(package_of(m) == package for m in modules), f"the walk found no module of {package}"
    bare = sorted(m for m in modules if m.split(".")[0] in SUBPACKAGES)
    assert not bare, f"files on disk whose path is no import path (a second copy, or a link followed): {bare[:5]}"


def test_a_plain_walk_of_the_files_draws_the_documented_arrows():
    documented = documented_arrows(DOC.read_text(encoding="utf-8"))
    drawn = walked_arrows()
    assert drawn == documented, (
        f"not in docs/architecture.md: {sorted(drawn - documented)}; "
        f"documented but not drawn: {sorted(documented - drawn)}"
    )


def test_the_walk_takes_a_link_for_what_it_is(tmp_path):
    """The walk's rule, on a toy tree: a file's module name is its path, and a linked folder is not entered
    (had the old layout been walked, ``trainer/x.py`` importing ``llmft.trainer.y`` drew no arrow)."""
    (tmp_path / "llmft" / "trainer").mkdir(parents=True)
    (tmp_path / "llmft" / "components").mkdir()
    (tmp_path / "llmft" / "trainer" / "y.py").write_text("")
    (tmp_path / "llmft" / "components" / "c.py").write_text("from llmft.trainer import y\n")
    (tmp_path / "trainer").symlink_to("llmft/trainer")
    assert set(files_on_disk(tmp_path)) == {"llmft.trainer.y", "llmft.components.c"}
    assert walked_arrows(tmp_path) == {("llmft.components", "llmft.trainer")}


def test_the_arrow_reader_reads_a_block():
    text = "x\n<!-- package-arrows: begin -->\n```\na -> b, c\nd -> e\n```\n<!-- package-arrows: end -->\n"
    assert documented_arrows(text) == {("a", "b"), ("a", "c"), ("d", "e")}
