"""What installing the distribution puts into site-packages: one import root, ``llmft``.

The files live under ``llmft/`` (llmft/trainer/, llmft/components/, ...): the path on disk is the
import path, so Python, setuptools, mypy and every structure tool read the same tree, and a wheel
never adds generic names such as ``trainer`` (a PyPI distribution of that name exists). The top-level
trainer/, components/, pipelines/, katib/, benchmarks/ are real folders of what a user takes from the
repository, with no Python file: no module is importable under a second name from the checkout, and the
checkout holds no symlink. setup.cfg finds the packages (``packages = find:``): these tests hold that
and the found list to the folders on disk,
build a wheel of a clean copy of the checkout and read it, and look for commands and snippets in the
docs, notebooks, scripts and Dockerfiles that still name a bare folder (``python -m trainer``).
The Python modules' own imports are read by tests/core/test_imports.py.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llmft import SUBPACKAGES

REPO = Path(__file__).resolve().parents[2]
BARE = "|".join(SUBPACKAGES)
BENCHMARK_CODE = (".py", ".sh")
"""What llmft/benchmarks/ may hold: the benchmarks' modules and the device plans that run them."""


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg", encoding="utf-8")
    return parser


def _packages() -> list[str]:
    """What setuptools installs: setup.cfg's ``packages = find:`` with its include list, run here."""
    from setuptools import find_packages

    assert _setup_cfg()["options"]["packages"].strip() == "find:", "setup.cfg finds the packages under llmft/"
    raw = _setup_cfg()["options.packages.find"]["include"]
    return find_packages(str(REPO), include=[line.strip() for line in raw.splitlines() if line.strip()])


def _source_dirs() -> dict[str, Path]:
    """Every folder of the import root on disk -> its import name (llmft/trainer/data -> llmft.trainer.data)."""
    found = {}
    for directory, _, _ in os.walk(REPO / "llmft"):
        parts = Path(directory).relative_to(REPO).parts
        if "__pycache__" in parts or any(part.startswith(".") for part in parts):
            continue
        found[".".join(parts)] = Path(directory)
    return found


def _git(*args: str) -> list[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()


def checkout_files(links: bool = False) -> list[str]:
    """The files a fresh clone has (git's view: tracked, and untracked not ignored), else a walk;
    with ``links``, the symlinks too (the checkout commits none: test_git_stores_no_link)."""
    try:
        listed = _git("ls-files", "--cached", "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "dist", "runs", "mlruns", "__pycache__"}
        listed = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if (p.is_file() or p.is_symlink()) and not skip.intersection(p.relative_to(REPO).parts)
        ]
    return sorted(f for f in listed if (REPO / f).is_file() or (links and (REPO / f).is_symlink()))


def test_the_files_live_under_the_import_root_and_the_top_level_folders_hold_no_python():
    assert "package_dir" not in _setup_cfg()["options"], "llmft/ is a plain package tree: no package_dir mapping"
    for name in SUBPACKAGES:
        folder = REPO / "llmft" / name
        assert folder.is_dir() and not folder.is_symlink(), f"llmft/{name}/ must hold the files (path = import path)"
        assert (folder / "__init__.py").is_file(), f"llmft/{name}/ is imported as llmft.{name} but is not a package"
        top = REPO / name
        assert not top.is_symlink(), f"{name} (top level) must not be a link into llmft/: a second import name"
        python = [str(p.relative_to(REPO)) for p in top.rglob("*.py")] if top.is_dir() else []
        assert not python, f"Python files at the top level would be importable as {name}.*: {python}"


FIND_MODULES = """
import importlib.util, sys
def found(name):  # a module file; a folder of data files is an empty namespace package (origin None)
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # its parent is not a package, or not found
        return False
    return spec is not None and spec.origin is not None
print([name for name in sys.argv[1:] if found(name)])
"""


@pytest.mark.slow  # one Python process (about 1 s)
def test_no_module_of_the_package_is_importable_under_a_second_name_from_the_checkout():
    """From the checkout's root (the current directory first on sys.path, as `python -c` and `python -m`
    have it), ``trainer.config`` and every other ``llmft.<folder>.*`` module without its ``llmft.`` is
    not found, and ``python -m trainer`` does not run."""
    bare = sorted(
        ".".join(p.relative_to(REPO / "llmft").with_suffix("").parts).removesuffix(".__init__")
        for name in SUBPACKAGES
        for p in (REPO / "llmft" / name).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    assert "trainer.config" in bare and "katib" in bare
    found = subprocess.run(
        [sys.executable, "-c", FIND_MODULES, *bare], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert found == "[]", f"importable under a second name from the checkout: {found[:500]}"
    run = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode != 0 and "llmft" not in run.stdout


def test_git_stores_no_link():
    try:
        staged = _git("ls-files", "-s")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    links = [line.split("\t")[1] for line in staged if line.startswith("120000 ")]
    assert not links, f"symlinks in the checkout (a second name for a module, a grep finding files twice): {links}"


def test_benchmark_results_are_a_top_level_folder_of_data_outside_the_package():
    """What the benchmarks measured (results, GPU logs, notes) is data: it lives in the checkout's real
    top-level benchmarks/ folder, where `llmft bench` writes from the checkout's root, holds no Python (nothing
    imports from it), and llmft/benchmarks/ holds only the benchmarks' code."""
    from llmft.benchmarks import RESULTS_DIR

    folder = REPO / "benchmarks"
    assert folder.is_dir() and not folder.is_symlink(), "benchmarks/ must be a real folder, not a link into llmft/"
    assert RESULTS_DIR == Path("benchmarks/results"), "the benchmarks write to benchmarks/results (relative)"
    files = checkout_files(links=True)
    results = [f for f in files if f.startswith("benchmarks/results/")]
    assert "benchmarks/README.md" in files and "benchmarks/results/README.md" in results
    assert any(f.startswith("benchmarks/results/gpu-logs/") for f in results), "the GPU logs sit under results/"
    assert len([f for f in results if f.endswith(".json")]) >= 10, "the committed results are in benchmarks/results/"
    data = [f for f in files if f.startswith("llmft/benchmarks/") and not f.endswith(BENCHMARK_CODE)]
    assert not data, f"llmft/benchmarks/ holds the code only; results and logs go to benchmarks/: {data[:10]}"


def test_the_package_list_is_the_folders_on_disk():
    on_disk = _source_dirs()
    packages = {name for name, d in on_disk.items() if (d / "__init__.py").is_file()}
    listed = _packages()
    assert set(listed) == packages, (
        f"setup.cfg's find: differs from the folders holding an __init__.py: "
        f"missing {sorted(packages - set(listed))}, not on disk {sorted(set(listed) - packages)}"
    )
    stray = [str(d.relative_to(REPO)) for name, d in on_disk.items() if name not in packages and any(d.glob("*.py"))]
    assert not stray, f"Python modules in folders without __init__.py would not be installed: {stray}"


@pytest.mark.slow  # builds a wheel with pip (about 2 s)
def test_the_wheel_holds_only_llmft(tmp_path):
    source = tmp_path / "src"
    for name in checkout_files(links=True):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    entries = zipfile.ZipFile(wheel).infolist()
    names = {entry.filename for entry in entries}
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"llmft"}, f"the wheel installs {sorted(roots)} into site-packages; only llmft may be there"
    links = [e.filename for e in entries if stat.S_ISLNK(e.external_attr >> 16)]
    assert not links, f"the wheel must hold the files, not the links: {links}"
    modules = {
        "/".join(name.split(".")) + "/" + path.name
        for name, directory in _source_dirs().items()
        if (directory / "__init__.py").is_file()
        for path in directory.glob("*.py")
    }
    assert modules - names == set(), f"modules missing from the wheel: {sorted(modules - names)[:10]}"
    assert not [n for n in names if "/configs/" in n], "the trainer configs are the checkout's trainer/configs/"
    assert "llmft/demo/sample_data/velmora_three_facts.jsonl" in names, "the demo's data ships (make demo's dataset)"
    assert "llmft/demo/lm_eval_tasks/velmora_mc.jsonl" in names, "the shipped lm-eval task's data (the evaluate step)"
    bench_data = [n for n in names if (n.startswith("llmft/benchmarks/") and not n.endswith(".py")) or "results/" in n]
    assert not bench_data, f"benchmark results or logs in the wheel: {bench_data[:10]}"
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["llmft"]


# A Python statement or command naming a bare folder: `from trainer.x import y`, `import components`,
# `python -m trainer`, `torchrun ... -m benchmarks.gpu.x`, ["-m", "trainer"].
IMPORT_LINE = re.compile(
    rf"""(?m)(?:^|[;'"`(]|&&|\|\|)\s*(?:from\s+(?:{BARE})(?:\.\w+)*\s+import\b|import\s+(?:{BARE})(?:\.\w+)*\s*(?:$|[;,'"`)\\]|as\b))"""
)
RUN_MODULE = re.compile(rf"""-m\s+(?:{BARE})(?:\.\w+)*(?:\s|$|['"`])|["']-m["']\s*,\s*["'](?:{BARE})(?:\.\w+)*["']""")
# Logs of past runs keep the commands they ran; the tests of the scan hold examples.
SKIPPED = ("benchmarks/results/", "tests/core/test_packaging.py")


def bare_names(path: str, text: str) -> list[str]:
    """``file:line: match`` for each statement or command in ``text`` that names a bare folder.
    Python files are read for commands only (tests/core/test_imports.py reads their imports)."""
    patterns = (RUN_MODULE,) if path.endswith(".py") else (IMPORT_LINE, RUN_MODULE)
    return [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group(0).split())}"
        for pattern in patterns
        for m in pattern.finditer(text)
    ]


def test_no_command_or_snippet_names_a_bare_folder():
    offenders = []
    for name in checkout_files():
        if name.startswith(SKIPPED):
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        offenders += bare_names(name, text)
    assert not offenders, "write llmft.<folder> (python -m llmft.trainer, from llmft.components ...):\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize(
    "text",
    [
        "python -m trainer config.yaml",
        "torchrun --nproc-per-node 2 -m trainer x=1",
        "$(python -c 'from components.images import IMAGE_TAG')",
        '"source": ["import pipelines\\n"]',
        "import katib as k",
        '["python", "-m", "trainer", "cfg.yaml"]',
        "python -m\nbenchmarks.gpu.trainer_entry",
    ],
)
def test_the_scan_finds_bare_names(text):
    assert bare_names("doc.md", text)


@pytest.mark.parametrize(
    "text",
    [
        "python -m llmft.trainer config.yaml",
        "from llmft.components.images import IMAGE_TAG",
        "The trainer imports nothing from components at module level.",
        "an attention implementation must come from trainer.fastpath",
        "python -m torch.distributed.run -m llmft.trainer",
    ],
)
def test_the_scan_leaves_other_text_alone(text):
    assert not bare_names("doc.md", text)


def test_kfp_kubernetes_is_required_where_set_security_context_exists():
    """The pipelines call kfp.kubernetes.set_security_context, first released in kfp-kubernetes 2.16.0
    (kubeflow/pipelines 2.16.0 kubernetes_platform/python/kfp/kubernetes/__init__.py 34, 54; absent at
    2.15.0), and KFP's backend applies it from 2.16.0 (backend/src/v2/driver/k8s.go 724-760): an
    install resolving 2.15 would fail to compile with AttributeError."""
    import kfp.kubernetes
    from packaging.requirements import Requirement

    extras = _setup_cfg()["options.extras_require"]
    pins = [Requirement(line) for value in extras.values() for line in value.split("\n") if line.strip()]
    pins = [r for r in pins if r.name == "kfp-kubernetes"]
    assert pins, "setup.cfg names kfp-kubernetes in an extra"
    for requirement in pins:
        assert not requirement.specifier.contains("2.15.0") and requirement.specifier.contains("2.16.0"), requirement
    assert callable(kfp.kubernetes.set_security_context)
