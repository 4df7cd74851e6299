"""The layout that lets one pytest run any set of test folders, in any number of pytest-xdist workers
(`make test-clock-ahead` runs tests/k8s, tests/katib and tests/pipeline in one pytest; CONTRIBUTING.md)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from xdist_groups import xdist_group_of

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


def _item(nodeid: str, module: str, **fixtures: tuple[str, str]) -> SimpleNamespace:
    """A collected test as xdist_group_of reads it: fixtures as name=(scope, module that defines it)."""
    defs = {
        name: [SimpleNamespace(scope=scope, func=SimpleNamespace(__module__=where))]
        for name, (scope, where) in fixtures.items()
    }
    return SimpleNamespace(
        nodeid=nodeid, module=SimpleNamespace(__name__=module), _fixtureinfo=SimpleNamespace(name2fixturedefs=defs)
    )


def test_tests_sharing_a_costly_session_fixture_share_a_worker():
    run = _item(
        "tests/pipeline/test_pipeline_local_run.py::test_a",
        "test_pipeline_local_run",
        local_run=("session", "conftest"),
    )
    real = _item(
        "tests/real/test_real_pipeline.py::test_b", "test_real_pipeline", real_model_dir=("session", "conftest")
    )
    assert xdist_group_of(run) == "local_run" and xdist_group_of(real) == "real_model_dir"


def test_a_modules_own_module_fixture_keeps_its_tests_together():
    server = _item(
        "tests/serving/test_kserve_openai.py::test_c[x]", "test_kserve_openai", servers=("module", "test_kserve_openai")
    )
    assert xdist_group_of(server) == "tests/serving/test_kserve_openai.py"
    # a module's own fixture that shares a costly fixture's name binds to its module, not to the shared group
    namesake = _item(
        "tests/k8s/test_servability.py::test_d", "test_servability", trained_adapter=("module", "test_servability")
    )
    assert xdist_group_of(namesake) == "tests/k8s/test_servability.py"


def test_cheap_or_per_test_fixtures_leave_a_test_free():
    thread = _item(
        "tests/trainer/test_x.py::test_e",
        "test_x",
        _one_torch_thread=("module", "conftest"),
        tmp_path=("function", "_pytest.tmpdir"),
    )
    tiny = _item("tests/data/test_y.py::test_f", "test_y", tiny_model_dir=("session", "conftest"))
    assert xdist_group_of(thread) is None and xdist_group_of(tiny) is None
