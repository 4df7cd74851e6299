"""Shared set-up of the notebooks: where outputs go, their parameters, saving figures.

Every notebook starts with ``from nb_setup import ...``. Parameters come from
environment variables so that CI (tests/docs/test_notebooks.py) can run the same
notebooks small and fast; a person running them in Jupyter gets the defaults.

    LLMFT_NB_WORK_DIR   where runs, the MLflow store and figures go (default <repo>/runs/notebooks)
    LLMFT_NB_STEPS      optimizer steps of the local pipeline run (notebook 01)
    LLMFT_NB_TRIALS     trials of the local sweep (notebook 03)
    LLMFT_NB_TRIAL_STEPS  optimizer steps of each sweep trial (notebook 03)
    LLMFT_NB_REUSE      1 = reuse the last successful local pipeline run instead of running again
    LLMFT_KFP_HOST      a KFP endpoint: notebook 02 talks to it; unset = cluster cells only explain
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path


def _repo_root() -> Path:
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "setup.cfg").is_file() and (folder / "trainer").is_dir():
            return folder
    raise RuntimeError(f"run the notebooks from inside the kfp-llm-finetune checkout (cwd {here})")


REPO = _repo_root()
if str(REPO) not in sys.path:  # the package is installed editable; this only helps a bare checkout
    sys.path.insert(0, str(REPO))

os.chdir(REPO)  # run from the checkout, as make demo does: the converted real model is its .cache/real-model

from llmft.trainer.quiet import quiet_known_noise  # noqa: E402 - after the path above

quiet_known_noise()  # a notebook is an entry point too: the libraries' known noise stays out of its outputs
os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the saved outputs (tqdm >= 4.66 reads it)
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm.auto without ipywidgets: bars are off anyway

WORK = Path(os.environ.get("LLMFT_NB_WORK_DIR") or REPO / "runs" / "notebooks").resolve()
"""Everything the notebooks write; notebooks 01, 03 and 04 share it."""
PIPELINE_WORK = WORK / "pipeline"
"""The local pipeline run of notebook 01: data/ (the 'volume'), kfp/, mlflow.db, run-local.log."""
FIGURES = WORK / "figures"
"""Every figure is also saved here as PNG."""
MLFLOW_URI = f"sqlite:///{PIPELINE_WORK / 'mlflow.db'}"
"""The MLflow store the local pipeline run (and the local sweep) log to."""
from llmft.pipelines.defaults import DEMO_DEFAULTS  # noqa: E402 - after the path above

MLFLOW_EXPERIMENT = DEMO_DEFAULTS["mlflow_experiment"]
"""The experiment notebook 01's run (``make demo``'s arguments, llmft/pipelines/defaults.py DEMO_DEFAULTS) logs to;
the sweep of notebook 03 logs there too, so notebook 04 compares them."""


def shown(path) -> str:
    """``path`` as the notebooks print it: relative to the checkout when inside it (the committed outputs then
    name no one's home folder), else as it is."""
    resolved = Path(os.path.abspath(path))  # links kept: .venv/bin/python stays in the checkout
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def param(name: str, default):
    """``LLMFT_NB_<NAME>`` from the environment, typed like ``default``."""
    raw = os.environ.get(f"LLMFT_NB_{name}")
    if raw is None or raw == "":
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes")
    return type(default)(raw)


def save_figure(fig, name: str) -> Path:
    """Save ``fig`` as ``FIGURES/<name>.png`` and return the path (the notebook shows it too)."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"saved {shown(path)}")
    return path


def cpu_matmul_tflops(size: int = 1024, repeats: int = 8) -> float:
    """Measured fp32 matmul TFLOP/s of this CPU: the 'peak' MFU is relative to when no GPU is present."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12
