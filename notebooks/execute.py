"""Execute the notebooks top to bottom, the way CI does, and keep the executed copies.

    python notebooks/execute.py --in-place            # all four, default settings: the committed notebooks
    python notebooks/execute.py --small 01 04         # the CI settings, two notebooks
    python notebooks/execute.py --work-dir /tmp/nb    # outputs elsewhere

Each notebook runs in a fresh kernel on *this* Python (the .venv interpreter, whatever
Jupyter kernels are installed), with the working directory set to notebooks/ and the
``LLMFT_NB_*`` parameters in its environment. Executed copies, with their outputs and
figures, go to ``<work dir>/executed/``; the figures also go to ``<work dir>/figures/``.
``--in-place`` writes the executed notebook over the one in notebooks/ (what is committed: a reader on
GitHub sees the outputs and figures), with the SHA-256 of its code cells in its metadata
(``llmft.code_sha256``): tests/docs/test_notebooks.py fails when a cell changed after the outputs were made.
tests/docs/test_notebooks.py calls :func:`execute_notebook` with the small settings.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

NOTEBOOKS_DIR = Path(__file__).resolve().parent
ORDER = ("01_quickstart.ipynb", "02_on_a_cluster.ipynb", "03_sweeps.ipynb", "04_results.ipynb")
"""Run order: 03 sweeps over 01's tokenized data, 04 compares 01's run with 03's trials."""
SMALL = {"LLMFT_NB_STEPS": "6", "LLMFT_NB_TRIALS": "2", "LLMFT_NB_TRIAL_STEPS": "2"}
"""The settings CI uses: notebook 01 as `make demo` (6 steps: the adapter learns the facts and beats its base on
the held-out questions), two trials of two steps."""
KERNEL_NAME = "llmft-current-python"


def code_sha256(nb) -> str:
    """SHA-256 of the notebook's code cells, in order: what its committed outputs were made from."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode() + b"\0")
    return digest.hexdigest()


def relative_paths(nb, root: Path) -> None:
    """Outputs name files relative to the checkout ``root`` (``runs/notebooks/...``), not by this machine's
    absolute path: the committed notebooks show no one's home folder."""
    prefix = f"{root}/"
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = out["text"].replace(prefix, "")
            for kind in ("text/plain", "text/html", "text/markdown"):
                if kind in out.get("data", {}):
                    out["data"][kind] = out["data"][kind].replace(prefix, "")


def _kernel_spec_dir(root: Path) -> Path:
    """A kernelspec that starts ipykernel on this very interpreter (not whatever `python3` means)."""
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "kfp-llm-finetune (current Python)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return spec_dir.parent


def execute_notebook(name: str, *, env: dict[str, str], timeout_s: int = 900,
                     executed_dir: Path | None = None):
    """Run notebook ``name`` (a file in notebooks/) with ``env`` added; return the executed notebook.

    Raises ``nbclient.exceptions.CellExecutionError`` naming the failing cell.
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel process inherits this environment
    try:
        with tempfile.TemporaryDirectory(prefix="llmft-kernels-") as tmp:
            specs = KernelSpecManager(kernel_dirs=[str(_kernel_spec_dir(Path(tmp)))])
            manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
            client = NotebookClient(nb, km=manager, timeout=timeout_s, kernel_name=KERNEL_NAME,
                                    resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
            try:
                client.execute()
            finally:
                if executed_dir is not None:
                    executed_dir.mkdir(parents=True, exist_ok=True)
                    nbformat.write(nb, executed_dir / name)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="numbers or names (default: all, in order)")
    parser.add_argument("--small", action="store_true", help="CI settings (few steps, two trials)")
    parser.add_argument("--work-dir", help="LLMFT_NB_WORK_DIR (default <repo>/runs/notebooks)")
    parser.add_argument("--in-place", action="store_true", help="write each executed notebook over its source")
    args = parser.parse_args(argv)
    chosen = [n for n in ORDER if not args.notebooks or any(n.startswith(a) or n == a for a in args.notebooks)]
    env = dict(SMALL) if args.small else {}
    work = Path(args.work_dir or NOTEBOOKS_DIR.parent / "runs" / "notebooks").resolve()
    env["LLMFT_NB_WORK_DIR"] = str(work)
    for name in chosen:
        start = time.perf_counter()
        nb = execute_notebook(name, env=env, executed_dir=work / "executed")
        target = work / "executed" / name
        if args.in_place:
            import nbformat

            committed = nbformat.read(NOTEBOOKS_DIR / name, as_version=4).metadata
            nb.metadata["kernelspec"] = committed.get("kernelspec", nb.metadata.get("kernelspec"))  # not ours
            nb.metadata["llmft"] = {"code_sha256": code_sha256(nb)}
            relative_paths(nb, NOTEBOOKS_DIR.parent)
            target = NOTEBOOKS_DIR / name
            nbformat.write(nb, target)
        print(f"{name:<24} ok in {time.perf_counter() - start:5.1f} s -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
