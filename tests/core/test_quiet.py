"""A quiet first run: the libraries' known noise (DeepSpeed's CPU-accelerator warning, MLflow's database INFO lines,
transformers' is_gradient_checkpointing FutureWarning through peft) is kept off the screen by every entry point, and
nothing else is. Each case runs the real library in a fresh interpreter, with and without the filters (the control:
the noise is real)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from llmft.trainer import quiet
from llmft.trainer.quiet import quiet_known_noise

QUIET = "from llmft.trainer.quiet import quiet_known_noise; quiet_known_noise()\n"


def _python(code: str, cwd) -> str:
    run = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr


@pytest.mark.slow
def test_deepspeeds_cpu_accelerator_warning_is_dropped(tmp_path):
    noise = "Setting accelerator to CPU"
    assert noise in _python("import deepspeed.accelerator; deepspeed.accelerator.get_accelerator()", tmp_path)
    assert noise not in _python(
        QUIET + "import deepspeed.accelerator; deepspeed.accelerator.get_accelerator()", tmp_path
    )


@pytest.mark.slow
def test_mlflows_database_lines_are_not_shown(tmp_path):
    code = (
        "from mlflow import MlflowClient\n"
        f"MlflowClient(tracking_uri='sqlite:///{tmp_path}/{{name}}.db').search_experiments()\n"
    )
    assert "Creating initial MLflow database tables" in _python(code.format(name="a"), tmp_path)
    assert "MLflow database" not in _python(QUIET + code.format(name="b"), tmp_path)


@pytest.mark.slow
def test_peft_wrapping_a_model_warns_no_futurewarning(tmp_path):
    code = (
        "import transformers, peft\n"
        "config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "model = transformers.Qwen2ForCausalLM(config)\n"
        "peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=['q_proj']))\n"
    )
    assert "is_gradient_checkpointing` is deprecated" in _python(code, tmp_path)
    assert "FutureWarning" not in _python(QUIET + code, tmp_path)


def test_only_the_named_messages_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will go.", FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
    deepspeed = logging.getLogger("DeepSpeed")
    dropped = logging.LogRecord("DeepSpeed", logging.WARNING, "x", 1, quiet.DROPPED_LOG_MESSAGES[0][1], None, None)
    kept = logging.LogRecord("DeepSpeed", logging.WARNING, "x", 1, "ZeRO stage 3 partition failed", None, None)
    assert not deepspeed.filter(dropped) and deepspeed.filter(kept)
    assert logging.getLogger("mlflow.store.db.utils").getEffectiveLevel() == logging.WARNING
    quiet_known_noise()
    assert len(deepspeed.filters) == len({f.message for f in deepspeed.filters})  # idempotent


@pytest.mark.parametrize("entry", ["cli", pytest.param("trainer", marks=pytest.mark.slow)])  # trainer: imports torch
def test_every_entry_point_installs_the_filters(entry, monkeypatch):
    calls = []
    if entry == "cli":
        from llmft import cli as module
    else:
        from llmft.trainer import __main__ as module
    monkeypatch.setattr(module, "quiet_known_noise", lambda: calls.append(entry))
    with pytest.raises(SystemExit):
        module.main(["--help"]) if entry == "trainer" else module.main(["--version"])
    assert calls == [entry]
