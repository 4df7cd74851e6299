"""A base model whose weights are damaged (a copy cut short, a full disk): one line naming the file, before any
load; in train it was exit 3 `internal error: SafetensorError`, in `export --merge` "the adapter was trained on
another base" (its content hash differed) (issue 45's probe; docs/failure-modes.md)."""

from __future__ import annotations

import os
import shutil

import pytest
from trainer_helpers import train_in_process

from llmft.trainer.errors import DataError
from llmft.trainer.model_dir import check_model_dir, check_model_files


def _damaged_copy(model, target, cut: int = 100):
    shutil.copytree(model, target)
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - cut)
    return target


def test_a_truncated_weight_file_is_named(tiny_model_dir, tmp_path):
    check_model_files(tiny_model_dir)  # whole: nothing to say
    bad = _damaged_copy(tiny_model_dir, tmp_path / "base")
    with pytest.raises(DataError, match=rf"^model {bad}: {bad}/model.safetensors: truncated \(its tensors end"):
        check_model_files(bad)
    with pytest.raises(DataError, match="the model's weights are damaged. Fix: copy or download the model again"):
        check_model_dir(str(bad))  # the tokenize step's check, before any row is tokenized
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(DataError, match=r"model.safetensors: corrupt safetensors header"):
        check_model_files(bad)


def _adapter(model, target):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(target)
    return target


def test_the_evaluator_names_a_damaged_adapter_or_base_before_loading_anything(tiny_model_dir, tmp_path):
    """The evaluate step's loads (PerplexityEvaluator.applied: the base once, then each checkpoint's adapter) go
    through the same check as train and export: the damaged file named in one line, and nothing loaded."""
    from llmft.trainer.evaluate import PerplexityEvaluator

    adapter = _adapter(tiny_model_dir, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    os.truncate(weights, weights.stat().st_size - 10)
    evaluator = PerplexityEvaluator(device="cpu")
    with pytest.raises(DataError, match=rf"^adapter {adapter}: {weights}: truncated .*weights are damaged"):
        with evaluator.applied(str(tiny_model_dir), str(adapter)):
            pass
    assert evaluator._model is None  # refused before the base was loaded
    bad = _damaged_copy(tiny_model_dir, tmp_path / "base")
    with pytest.raises(DataError, match=rf"^model {bad}: {bad}/model.safetensors: truncated"):
        with evaluator.applied(str(bad)):
            pass
    (bad / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(DataError, match=rf"^model {bad}: {bad}/config.json: not JSON .*files are damaged"):
        check_model_files(bad)


def test_the_local_deploy_check_names_a_damaged_adapter_or_base_before_loading_anything(tiny_model_dir, tmp_path):
    """serving_deploy_mode=local (lib/serving/local_check.py) loads base + adapter, or the merged model: the same
    one-line check first, so a damaged file is named rather than failing deep in safetensors or peft."""
    from llmft.components.lib.serving.local_check import local_generation_check

    adapter = _adapter(tiny_model_dir, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    os.truncate(weights, weights.stat().st_size - 10)
    with pytest.raises(DataError, match=rf"^adapter {adapter}: {weights}: truncated .*weights are damaged"):
        local_generation_check(str(tiny_model_dir), str(adapter), ["hi"])
    bad = _damaged_copy(tiny_model_dir, tmp_path / "base")
    with pytest.raises(DataError, match=rf"^model {bad}: {bad}/model.safetensors: truncated"):
        local_generation_check(str(bad), str(adapter), ["hi"])
    with pytest.raises(DataError, match=rf"^model {bad}: {bad}/model.safetensors: truncated"):
        local_generation_check(str(tiny_model_dir), str(adapter), ["hi"], merged_path=str(bad))


@pytest.mark.slow
def test_training_on_a_truncated_base_is_one_line_exit_1(base_overrides, tiny_model_dir, tmp_path, capsys):
    bad = _damaged_copy(tiny_model_dir, tmp_path / "base")
    code, _ = train_in_process([*base_overrides("run"), f"model.name_or_path={bad}"])
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert err.splitlines()[-1].startswith(f"error: model {bad}: {bad}/model.safetensors: truncated")
    assert "internal error" not in err


@pytest.mark.slow
def test_export_merge_names_a_damaged_base_not_another_base(base_overrides, tiny_model_dir, tmp_path, capsys):
    from llmft.cli import main

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    code, _ = train_in_process([*base_overrides("run", max_steps=1), f"model.name_or_path={base}"])
    assert code == 0
    os.truncate(base / "model.safetensors", (base / "model.safetensors").stat().st_size - 100)
    capsys.readouterr()
    adapter, output = tmp_path / "run" / "final", tmp_path / "m"
    assert main(["export", "--adapter", str(adapter), "--output", str(output), "--merge"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"{base}/model.safetensors: truncated" in err
    assert "trained on another base" not in err and not (tmp_path / "m").exists()
