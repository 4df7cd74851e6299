"""The README's paths, run as written (issue 49 item 3): "your own data and model, locally" end to end on a CSV with
other column names, and "on a Kubeflow cluster, in six steps" as far as this machine can go: the images' Dockerfiles
and deploy/ exist (make image-check and tests/docs/test_deploy_manifests.py prove them), the Secret is the one
deploy/secrets templates, the compile command writes the pipeline, and the submit command reaches a loopback fake
of the KFP API through the real kfp.Client. Path 1 (make demo) is tests/real/test_real_pipeline.py's profile."""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kfp_api_fake import FakeKfpApi

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"


def readme_commands(path: str) -> list[str]:
    """The shell lines of the README block ``<!-- readme-path: path -->``, continuations joined, comments dropped."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- readme-path: {path} -->\n```bash\n(.*?)```\n<!-- /readme-path -->", text, re.S)
    assert match, f"README.md has no readme-path block {path!r}"
    joined = match.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def llmft_argv(line: str, replacements: dict[str, str]) -> list[str]:
    for old, new in replacements.items():
        line = line.replace(old, new)
    words = shlex.split(line)
    env_free = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    assert env_free[0] == "llmft", line
    return env_free[1:]


def run_llmft(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "llmft"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KF_PIPELINES", "MLFLOW_"))}
    environ.update(HOME=str(cwd), **(env or {}))
    return subprocess.run([*command, *argv], cwd=cwd, capture_output=True, text=True, timeout=1500, env=environ)


def write_question_answer_csv(path: Path, rows: int = 48) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["question", "answer"])
        for i in range(rows):
            writer.writerow([f"What is {i} plus {i}?", f"{i} plus {i} is {2 * i}."])


def test_the_readme_paths_are_marked_and_name_real_commands():
    """Fast: the blocks exist, and every llmft line names a command the CLI has (a renamed one goes red here)."""
    own, cluster = readme_commands("own-data"), readme_commands("cluster")
    assert [c.split()[1:3] for c in own] == [["data", "prepare"], ["pipeline", "run-local"]]
    llmft_lines = [llmft_argv(c, {}) for c in cluster if " llmft " in f" {c} "]
    assert [argv[:2] for argv in llmft_lines] == [["pipeline", "compile"], ["pipeline", "submit"]]
    dockerfiles = re.findall(r"-f (docker/Dockerfile\.\w+)", " ".join(cluster))
    assert dockerfiles and all((REPO_ROOT / f).is_file() for f in dockerfiles)
    assert "kubectl apply -k deploy/" in cluster and (REPO_ROOT / "deploy" / "kustomization.yaml").is_file()


def test_the_readme_secret_is_the_one_deploy_templates():
    line = next(c for c in readme_commands("cluster") if "create secret generic" in c)
    name, key = re.search(r"create secret generic (\S+) --from-literal=(\w+)=", line).groups()
    template = yaml.safe_load((REPO_ROOT / "deploy" / "secrets" / f"{name}.yaml").read_text())
    assert template["metadata"]["name"] == name and key in template["stringData"]


@pytest.mark.slow
def test_your_own_data_and_model_locally_as_the_readme_writes_it(tmp_path, tiny_model_dir):
    """The two commands of path 2 on a question/answer CSV: the data check, then the whole pipeline on the user's
    model (the tiny one stands for it: the real one would take minutes) with 2 steps instead of the README's 12."""
    write_question_answer_csv(tmp_path / "my-data.csv")
    prepare, run_local = readme_commands("own-data")
    swap = {
        "$PWD/my-model": str(tiny_model_dir),
        "$PWD": str(tmp_path),
        "finetune_max_steps=12": "finetune_max_steps=2",
    }
    checked = run_llmft(llmft_argv(prepare, swap), tmp_path)
    assert checked.returncode == 0, checked.stderr
    first = (tmp_path / "runs" / "my-data-check" / "train.jsonl").read_text().splitlines()[0]
    assert "What is" in first and "plus" in first  # the question column became the prompt
    ran = run_llmft([*llmft_argv(run_local, swap), "--work-dir", str(tmp_path / "work")], tmp_path)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "SUCCEEDED" in ran.stdout and "Velmora" not in ran.stdout  # none of the demo's facts


@pytest.mark.slow
def test_the_cluster_path_compiles_and_submits_as_the_readme_writes_it(tmp_path):
    cluster = readme_commands("cluster")
    compile_line = next(c for c in cluster if "pipeline compile" in c)
    images = dict(re.findall(r"(LLMFT_\w+_IMAGE)=(\S+)", compile_line))
    env = {k: v.replace("$REG", "registry.example.com/ml") for k, v in images.items()}
    compiled = run_llmft(llmft_argv(compile_line, {}), tmp_path, env)
    assert compiled.returncode == 0, compiled.stderr
    spec = (tmp_path / "build" / "llm_finetune_pipeline.yaml").read_text()
    assert (
        "registry.example.com/ml/llmft-trainer:0.1.0" in spec and "registry.example.com/ml/llmft-pipeline:0.1.0" in spec
    )
    (tmp_path / "token").write_text("a-token\n")
    submit_line = next(c for c in cluster if "pipeline submit" in c)
    with FakeKfpApi(["RUNNING", "SUCCEEDED"]) as api:
        argv = llmft_argv(submit_line, {"https://kubeflow.example.com/pipeline": api.url})
        submitted = run_llmft([*argv, "--poll-interval", "0.05"], tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    assert f"{api.url}/#/runs/details/" in submitted.stdout and "SUCCEEDED" in submitted.stdout
