"""Issue 29 item 6: the plan step estimates what the run writes on the data volume (checkpoints with
their AdamW moments times keep_last + 2, final/, the promoted copy, a merged model) and refuses, in one
line, a run the mounted volume cannot hold, before any GPU time (llmft/components/lib/plan/volume_space.py).
Before the fix nothing was checked: the run trained until its first checkpoint hit the full disk."""

from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple

import pytest
from plan_helpers import make_plan

from llmft.components.lib.plan import volume_space
from llmft.trainer.errors import ConfigError

QWEN_7B = {  # Qwen/Qwen2.5-7B-Instruct config.json (the pipeline's default model)
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
Usage = namedtuple("Usage", "total used free")


def test_the_estimate_counts_adapter_weights_and_moments_per_kept_checkpoint():
    r, h, i, kv, layers = 16, 3584, 18944, 4 * 128, 28
    per_layer = r * ((h + h) + (h + kv) + (h + kv) + (h + h) + (h + i) + (h + i) + (i + h))  # q k v o gate up down
    adapter = layers * per_layer
    got = volume_space.estimate(QWEN_7B, method="lora", lora_rank=r, targets=("all-linear",), keep_last=2, merged=False)
    assert got.checkpoint == 12 * adapter and got.weights == 4 * adapter and got.checkpoints_at_once == 4
    assert got.total == 4 * 12 * adapter + 2 * 4 * adapter
    full = volume_space.estimate(QWEN_7B, method="full", lora_rank=r, targets=(), keep_last=1, merged=False)
    assert 7.0e9 < full.weights / 4 < 7.7e9  # the 7.6B parameters of Qwen2.5-7B


def test_the_adapter_weights_estimate_matches_what_peft_writes(tiny_model_dir, tmp_path):
    """The estimate's adapter size against a real adapter_model.safetensors (float32, LoRA r=4 all-linear)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(tmp_path / "a")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    got = volume_space.estimate(config, method="lora", lora_rank=4, targets=("all-linear",), keep_last=2, merged=False)
    written = (tmp_path / "a" / "adapter_model.safetensors").stat().st_size
    assert got.weights <= written < got.weights + 64 * 1024  # the file adds only its JSON header


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "data"
    (root / "models" / "qwen7b").mkdir(parents=True)
    (root / "models" / "qwen7b" / "config.json").write_text(json.dumps(QWEN_7B))
    return root


def test_the_plan_refuses_a_run_the_volume_cannot_hold(volume, monkeypatch):
    monkeypatch.setattr(volume_space.shutil, "disk_usage", lambda _p: Usage(10 * 2**30, 9 * 2**30, 1 * 2**30))
    with pytest.raises(ConfigError) as info:
        make_plan(volume_path=str(volume), base_model=str(volume / "models" / "qwen7b"))
    message = str(info.value)
    assert "\n" not in message and f"{1 * 2**30} bytes (1.0 GiB) free of 10.0 GiB" in message, message
    assert "4 checkpoints" in message and "keep_last=1" in message and "volume_pvc_name" in message


def test_the_plan_reports_the_estimate_when_the_run_fits(volume, capsys):
    make_plan(volume_path=str(volume), base_model=str(volume / "models" / "qwen7b"))
    out = capsys.readouterr().out
    assert "volume: this run writes about" in out and "free of" in out, out
    shutil.rmtree(volume / "models")  # a hub id not in the local cache: skipped, and said so
    make_plan(volume_path=str(volume), base_model="org/not-cached-model")
    assert "volume space not checked: config.json of org/not-cached-model" in capsys.readouterr().out


def test_a_hub_id_is_estimated_from_the_volumes_hub_cache_without_huggingface_hub(volume, capsys, monkeypatch):
    """Issue 33 item 2: the plan step (pipeline image: neither torch nor huggingface_hub) reads a hub id's
    config.json from the volume's hub cache (<data_root>/hf-cache/hub, where the data steps download); it
    looked in this process's default cache through huggingface_hub, so in its image it never estimated."""
    repo = volume / "hf-cache" / "hub" / "models--Qwen--Qwen2.5-7B-Instruct"
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "config.json").write_text(json.dumps(QWEN_7B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as in the pipeline image
    make_plan(volume_path=str(volume), base_model="Qwen/Qwen2.5-7B-Instruct")
    assert "volume: this run writes about" in capsys.readouterr().out
    assert volume_space.cached_hub_file(str(repo.parent), "Qwen/Qwen2.5-7B-Instruct", "config.json", "a" * 40)
    assert volume_space.cached_hub_file(str(repo.parent), "Qwen/Qwen2.5-7B-Instruct", "config.json", "v2") is None
    make_plan(volume_path=str(volume), base_model="Qwen/Qwen2.5-7B-Instruct", finetune_overrides="model.revision=v2")
    assert "volume space not checked: config.json of Qwen/Qwen2.5-7B-Instruct" in capsys.readouterr().out
