"""The layout that lets one pytest run any set of test folders, in any number of pytest-xdist workers
(`make test-clock-ahead` runs tests/k8s, tests/katib and tests/pipeline in one pytest; CONTRIBUTING.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.harness


def _imports_conftest(path: Path) -> list[int]:
    """Lines of ``path`` that import a module named ``conftest`` (``import conftest``, ``from conftest import``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "conftest" and not node.level:
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(alias.name == "conftest" for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_no_test_file_imports_a_conftest_by_its_bare_name():
    """Which folder's conftest ``from conftest import`` finds is the one pytest loaded last: run with another
    folder (``pytest tests/k8s tests/docs``), the tests of tests/k8s failed at collection. Helpers a test imports
    live in a module of their own name (tests/k8s/sim_plans.py)."""
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "conftest.py"
        for line in _imports_conftest(path)
    ]
    assert not found, f"import from the folder's helper module instead of conftest: {', '.join(found)}"


def test_the_reader_finds_both_spellings(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\nfrom conftest import X\ndef f():\n    import conftest\nfrom .conftest import Y\n")
    assert _imports_conftest(probe) == [2, 4]
