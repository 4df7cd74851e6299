"""What issue 45's bad-input probe found, as a new user meets it: a missing extra, a credential in --host, an
override blamed on `<defaults>`, a key written twice, a format the plan let through, a non-JSON file a checkpoint
or a tokenized folder holds. Each is one line naming what to fix (docs/failure-modes.md has a row per test)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmft.trainer.checkpoint_check import checkpoint_problem
from llmft.trainer.config_load import load_config
from llmft.trainer.errors import ConfigError, DataError

REQUIRED = ["model.name_or_path=m", "data=d"]


@pytest.mark.parametrize(
    "override, where, also",
    [
        ("l\u043era.r=4", "override `l\u043era.r=...`: unknown key `l\u043era`", "U+043E CYRILLIC SMALL LETTER O"),
        ("lora.r.x=4", "override `lora.r.x=...`: `lora.r` must be int", "got {'x': 4}"),
        ("k0.x=1", "override `k0.x=...`: unknown key `k0`", "known keys in top level"),
    ],
)
def test_an_override_error_names_the_override_not_the_defaults(override, where, also):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*REQUIRED, override])
    message = str(caught.value)
    assert message.startswith(where) and also in message and "<defaults>" not in message


@pytest.mark.parametrize("override", ["optim.lr=1e-4\nx: 5", "lora.r=[1\n,2", "lo\nra.r=4"])
def test_a_newline_in_an_override_is_shown_escaped_on_one_line(override):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*REQUIRED, override])
    message = str(caught.value)
    assert "\n" not in message and override.replace("\n", "\\n").split("=")[0] in message


def test_a_key_written_twice_in_the_config_is_refused(tmp_path):
    """YAML keeps the last of two equal keys without a word: `r: 8` then `r: 16` trained at 16."""
    config = tmp_path / "c.yaml"
    config.write_text("model: {name_or_path: m}\ndata: d\nlora:\n  r: 8\n  alpha: 16\n  r: 16\n")
    with pytest.raises(ConfigError, match=r"c.yaml, line 6: `lora.r` is written twice \(first on line 4\)"):
        load_config(str(config))
    config.write_text("model: {name_or_path: m}\ndata: d\nlora: {r: 8}\nlora: {alpha: 4}\n")
    with pytest.raises(ConfigError, match=r"line 4: `lora` is written twice \(first on line 3\)"):
        load_config(str(config))


def _checkpoint(path: Path) -> Path:
    """A committed LoRA checkpoint whose every file reads as whole (what checkpoint_problem passes)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "r"}))
    (path / "train_config.json").write_text("{}")
    (path / "scheduler.json").write_text("{}")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file({"a": np.zeros(4, np.float32)}, str(path / "adapter_model.safetensors"))
    import zipfile

    with zipfile.ZipFile(path / "optimizer.pt", "w") as archive:
        archive.writestr("optimizer/data.pkl", b"x")
    return path


def test_the_resume_check_reads_every_json_file_adapter_config_among_them(tmp_path):
    checkpoint = _checkpoint(tmp_path / "step-2")
    assert checkpoint_problem(checkpoint) is None
    (checkpoint / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and problem.startswith(f"{checkpoint}/adapter_config.json: not valid JSON")


def test_a_tokenized_folder_whose_manifest_is_not_json_is_one_line(tmp_path):
    from llmft.trainer.data.shards import read_manifest

    (tmp_path / "manifest.json").write_bytes(b'{"format_version": 1, "splits": \x00\xff')
    with pytest.raises(DataError, match=rf"^{tmp_path}/manifest.json: not the JSON `llmft data tokenize` writes"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="not the JSON `llmft data tokenize` writes"):
        read_manifest(tmp_path)


def test_a_langfuse_source_without_the_sdk_is_this_installs_fault_not_the_servers(monkeypatch):
    """Without langfuse, `langfuse://` was exit 200 (retried as if the server were down); now the missing package."""
    from llmft.trainer import langfuse_sink
    from llmft.trainer.failures import describe_failure

    monkeypatch.setitem(sys.modules, "langfuse", None)
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-1")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-1")
    with pytest.raises(ModuleNotFoundError) as caught:
        langfuse_sink.dataset_rows("facts")
    code, message = describe_failure(caught.value)
    assert code == 1 and message.endswith("pip install 'kfp-llm-finetune[observe]'")


def _llmft_without(blocked: str, *argv: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`llmft ARGV` in a fresh interpreter in which the package ``blocked`` cannot be imported (as if absent)."""
    code = (
        "import sys\n"
        "class Absent:  # what Python finds for a package that is not installed: nothing, for it and its modules\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {blocked!r} or name.startswith({blocked!r} + '.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from llmft.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    """A prepared folder, a parquet file and a LoRA adapter: real inputs, so each command reaches its import."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_cli import _lora_adapter

    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("missing-extras")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared")
    rows = [{"instruction": "Name a colour.", "output": "Teal."}] * 4
    pq.write_table(pa.Table.from_pylist(rows), root / "rows.parquet")
    _lora_adapter(root / "adapter", lora_alpha=16, base_model_name_or_path=str(tiny_model_dir))
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "blocked, argv, extra",
    [
        ("kfp", ["pipeline", "compile", "--output", "p.yaml"], "pipeline"),
        ("kubeflow_katib_api", ["sweep", "create", "--dry-run", "data=/d"], "katib"),
        ("kubernetes", ["sweep", "create", "data=/d"], "pipeline"),
        ("kubernetes", ["sweep", "status", "exp"], "pipeline"),
        ("optuna", ["sweep", "run-local", "--trials", "1"], "katib"),
        ("transformers", ["data", "tokenize", "--input", "{root}/prepared", "--model", "{model}", "--output", "t"],
         "trainer"),
        ("peft", ["export", "--adapter", "{root}/adapter", "--output", "e"], "trainer"),
        ("pyarrow", ["data", "prepare", "--input", "{root}/rows.parquet", "--output", "pq"], "trainer"),
        ("langfuse", ["data", "prepare", "--input", "langfuse://facts", "--output", "lf"], "observe"),
        ("torch", ["train", "model.name_or_path={model}", "data=/d"], None),
    ],
)  # fmt: skip
def test_every_command_without_its_extra_is_one_line_naming_it(inputs, tiny_model_dir, tmp_path, blocked, argv, extra):
    """Was: "internal error ... This is a bug" (exit 3) from the command's own late import, or exit 200 for
    langfuse://; now exit 1 naming the package and the extra that brings it."""
    words = [w.format(root=inputs, model=tiny_model_dir) for w in argv]
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("LLMFT_")}}
    env.update(LANGFUSE_PUBLIC_KEY="pk-1", LANGFUSE_SECRET_KEY="sk-1", LANGFUSE_HOST="http://127.0.0.1:9")
    result = _llmft_without(blocked, *words, cwd=tmp_path, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert f"needs the Python package {blocked!r}, which is not installed here" in lines[-1], result.stderr
    fix = "install torch first" if extra is None else f"pip install 'kfp-llm-finetune[{extra}]'"
    assert fix in lines[-1] and "internal error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_sweep_dry_run_needs_no_kfp(tmp_path):
    """`llmft sweep create --dry-run` builds and checks the Experiment with the katib extra's packages only (the
    pipeline parameters' defaults come from their declarations, not from kfp's component): a platform engineer
    without kfp gets the Experiment, not an error."""
    result = _llmft_without("kfp", "sweep", "create", "--dry-run", "data=/d", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "kind: Experiment" in result.stdout and "passes Katib's admission rules" in result.stderr


@pytest.mark.slow
def test_submit_never_echoes_a_password_in_host(tmp_path):
    """`llmft pipeline submit --host http://bob:PASSWORD@host` against a port nothing answers on: the error names
    the host without the user information."""
    with socket.socket() as sock:  # a free loopback port, closed again: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = f"http://bob:PASSWORD@127.0.0.1:{port}"
    result = subprocess.run(
        [sys.executable, "-m", "llmft", "pipeline", "submit", "--host", host],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 200, result.stderr
    assert "PASSWORD" not in result.stderr + result.stdout
    assert f"--host http://***@127.0.0.1:{port}: the KFP API did not answer" in result.stderr
