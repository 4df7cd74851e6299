"""The layout that lets one pytest run any set of test folders, in any number of pytest-xdist workers
(`make test-clock-ahead` runs tests/k8s, tests/katib and tests/pipeline in one pytest; CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from xdist_groups import cpu_threads_per_worker, xdist_group_of

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


@pytest.mark.parametrize(
    ("workers", "cores", "threads"),
    [(None, 2, None), ("1", 2, None), ("2", 2, 1), ("2", 16, 8), ("3", 16, 5), ("4", 2, 1)],
)
def test_each_xdist_worker_gets_an_even_share_of_the_cores_and_never_none(workers, cores, threads):
    environ = {} if workers is None else {"PYTEST_XDIST_WORKER_COUNT": workers}
    assert cpu_threads_per_worker(environ, cores=cores) == threads


_GROUPED_MODULE = """
import os
import pytest

@pytest.fixture(scope="module")
def shared():
    return os.environ["PYTEST_XDIST_WORKER"]

{tests}
"""


@pytest.mark.slow  # a pytest with two xdist workers in a subprocess
def test_a_group_runs_in_one_worker(tmp_path):
    """What make test relies on: the tests this suite groups (tests/xdist_groups.py) run in one pytest-xdist worker,
    so a costly module or session fixture is built once. pytest 9.2 with pytest-xdist 3.8.0 silently spread every
    group over all workers (pytest-dev/pytest-xdist#1386; setup.cfg pins pytest below 9.2): the notebooks and the
    real-model pipeline ran twice in CI."""
    record = "open({path!r} + '-{i}', 'w').write(os.environ['PYTEST_XDIST_WORKER'] + ' ' + shared)"
    tests = "\n".join(
        f"def test_{i}(shared):\n    " + record.format(path=str(tmp_path / "ran"), i=i) + "\n" for i in range(8)
    )
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "test_grouped.py").write_text(_GROUPED_MODULE.format(tests=tests))
    (folder / "test_free.py").write_text("".join(f"def test_free_{i}():\n    pass\n" for i in range(8)))
    # the suite's own root conftest (tests/conftest.py), loaded as a plugin: its hook marks the groups
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    command += ["-n", "2", "--dist", "loadgroup"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([*command, str(folder)], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ran = [(tmp_path / f"ran-{i}").read_text().split() for i in range(8)]
    workers = {worker for worker, _ in ran} | {built for _, built in ran}
    assert len(workers) == 1, f"the module's tests ran in workers {sorted(workers)}: the group was split"
