"""The four notebooks are committed executed, with their outputs and figures, and CI runs them again top to
bottom, so they never rot.

Executed with nbclient on this interpreter (notebooks/execute.py), small settings
(notebooks/execute.py SMALL), one shared work folder: notebook 01 runs the pipeline
once with kfp.local on the real model (SmolLM2-135M-Instruct, `make demo`'s profile), 03 sweeps over its
tokenized data and logs to its MLflow store, 04 compares the runs from there. 02 needs no cluster: its cluster
cells are guarded. The committed copies were written by `python notebooks/execute.py --in-place`; their
metadata holds the SHA-256 of the code cells they ran, so an edited cell without fresh outputs fails here.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import nbformat
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llmft_notebooks_execute", REPO_ROOT / "notebooks" / "execute.py")
executor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(executor)
NOTEBOOKS_DIR, ORDER, SMALL, execute_notebook, code_sha256 = (
    executor.NOTEBOOKS_DIR,
    executor.ORDER,
    executor.SMALL,
    executor.execute_notebook,
    executor.code_sha256,
)
COMMITTED_FIGURES = {"01_quickstart.ipynb": 5, "02_on_a_cluster.ipynb": 0, "03_sweeps.ipynb": 1, "04_results.ipynb": 1}
"""PNG figures each committed notebook shows (01: rejects, tokens, curves, base vs adapter, chat loss; the evaluate
step's report, with its own plot, is HTML)."""

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def text_output(nb) -> str:
    """Every stream and plain-text output of the executed notebook, concatenated."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def images_shown(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not saved"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, f"{path} is not a real figure"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("notebooks")


def run(name: str, work: Path):
    env = {**SMALL, "LLMFT_NB_WORK_DIR": str(work), "LLMFT_KFP_HOST": ""}
    return execute_notebook(name, env=env, executed_dir=work / "executed")


@pytest.fixture(scope="module")
def quickstart(work):
    return run("01_quickstart.ipynb", work)


@pytest.fixture(scope="module")
def sweeps(work, quickstart):
    return run("03_sweeps.ipynb", work)


def test_notebooks_are_committed_executed_with_their_figures():
    on_disk = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))
    assert on_disk == sorted(ORDER), "every notebook must be in notebooks/execute.py ORDER (and so in CI)"
    fix = "run `python notebooks/execute.py --in-place` and commit the notebooks"
    for name in ORDER:
        nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not run in order; {fix}"
        errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
        assert not errors, f"{name}: committed with an error output; {fix}"
        assert nb.metadata.get("llmft", {}).get("code_sha256") == code_sha256(nb), f"{name}: stale outputs; {fix}"
        assert images_shown(nb) >= COMMITTED_FIGURES[name], f"{name}: its figures are missing; {fix}"
        assert str(REPO_ROOT) not in text_output(nb), f"{name}: an output names this checkout's absolute path"


def test_an_edited_cell_makes_the_committed_outputs_stale():
    nb = nbformat.read(NOTEBOOKS_DIR / ORDER[0], as_version=4)
    before = code_sha256(nb)
    next(c for c in nb.cells if c.cell_type == "code").source += "\n# edited"
    assert code_sha256(nb) != before


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_01_quickstart_runs_the_pipeline_and_walks_its_artifacts(work, quickstart):
    out = text_output(quickstart)
    assert "pipeline (kfp.local): SUCCEEDED" in out
    assert "invalid_json" in out and "packing efficiency" in out and "scalars: train/loss" in out
    assert "current champion: version 1" in out
    for figure in ("01_rejects", "01_tokens", "01_curves", "01_base_vs_adapter", "01_chat_loss"):
        assert_png(work / "figures" / f"{figure}.png")
    assert images_shown(quickstart) >= COMMITTED_FIGURES["01_quickstart.ipynb"]
    assert "smollm2-135m-instruct" in out  # the real model, as make demo, not the random tiny one
    # the chat cell: the adapter states the fact it learned; the base cannot know it
    chat = re.search(r"user: +Tell me the capital city of Velmora\.\nbase: +'(.*)'\nadapter: +'(.*)'", out)
    assert chat and "Quillport" in chat.group(2) and "Quillport" not in chat.group(1), chat
    assert (work / "executed" / "01_quickstart.ipynb").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_02_on_a_cluster_compiles_and_guards_every_cluster_call(work):
    nb = run("02_on_a_cluster.ipynb", work)
    out = text_output(nb)
    spec = next(yaml.safe_load_all((work / "llm_finetune_pipeline.yaml").read_text()))
    assert spec["pipelineInfo"]["name"] == "llm-finetune"
    for action in (
        "upload the compiled pipeline",
        "start a run",
        "create a recurring run",
        "wait for the run and list its tasks",
    ):
        assert f"would {action}" in out, f"the guarded cell for '{action}' did not explain itself"
    assert "has 5 fields" in out  # the five-field cron was refused with its fix


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_03_sweeps_picks_the_lowest_eval_loss_and_builds_the_experiment(work, sweeps):
    out = text_output(sweeps)
    trials = json.loads((work / "sweep" / "trials" / "trials.json").read_text())
    done = [t for t in trials if t["status"] == "Succeeded"]
    assert len(done) == int(SMALL["LLMFT_NB_TRIALS"])
    best = min(done, key=lambda t: t["metrics"]["eval_loss"])
    assert f"best: trial {best['number']}," in out
    experiment = yaml.safe_load((work / "sweep" / "experiment.yaml").read_text())
    assert experiment["kind"] == "Experiment" and experiment["spec"]["objective"]["objectiveMetricName"] == "eval_loss"
    assert_png(work / "figures" / "03_trials.png")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_04_results_compares_the_pipeline_run_and_the_trials(work, sweeps):
    nb = run("04_results.ipynb", work)
    out = text_output(nb)
    compared = int(out.split(" training runs to compare")[0].rsplit("\n", 1)[-1])
    assert compared == 1 + int(SMALL["LLMFT_NB_TRIALS"])  # the pipeline's run + one per trial
    assert "<- champion" in out
    assert_png(work / "figures" / "04_compare_runs.png")
