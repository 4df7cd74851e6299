"""A run's auto settings end to end on CPU: resolved once from config.json + the data manifest + the
free memory, applied by trainer.model.load_model, which returns the typed FastPath decision beside the model."""

from __future__ import annotations

import json

import pytest
import torch

from llmft.trainer.config_load import load_config
from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath import settings
from llmft.trainer.sizing.memory import GiB


@pytest.fixture()
def manifest_dir(tmp_path):
    def make(max_length: int):
        out = tmp_path / f"data-{max_length}"
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"cache_key": "k", "max_length": max_length}))
        return str(out)

    return make


def _cfg(model_dir, data="d", *overrides):
    return load_config(None, [f"model.name_or_path={model_dir}", f"data={data}", *overrides])


def test_cpu_settings_are_the_plain_path_and_resolved_once(tiny_model_dir):
    cfg = _cfg(tiny_model_dir)
    first = settings.run_settings(cfg, torch.device("cpu"), 1)
    assert first is settings.run_settings(cfg, torch.device("cpu"), 1)
    assert first.fast.attention == "sdpa" and not first.fast.fused_loss.on and not first.fast.compile.on
    assert (first.memory.micro_sequences, first.memory.checkpointed_layers) == (1, 0)
    info = type("Info", (), {"device": torch.device("cpu"), "world_size": 1})()
    assert settings.micro_sequences_for(_cfg(tiny_model_dir, "d", "batch.micro_sequences=3"), info) == 3


def test_cuda_plan_reads_the_manifest_and_the_free_memory(tiny_model_dir, manifest_dir, monkeypatch):
    """No GPU here: the device is only named; the free memory comes from the patched probe."""
    monkeypatch.setattr(settings, "free_memory_at_start", lambda device: 2 * GiB)
    short = settings.run_settings(_cfg(tiny_model_dir, manifest_dir(128)), torch.device("cuda", 0), 2)
    assert short.fast.attention == "llmft_varlen" and short.fast.fused_lora.on and short.fast.compile.on
    assert short.memory.micro_sequences == 4 and short.memory.checkpointed_layers == 0  # 8 sequences over 2 ranks
    long = settings.run_settings(
        _cfg(tiny_model_dir, manifest_dir(1 << 17), "batch.global_sequences=16"), torch.device("cuda", 0), 1
    )
    assert long.memory.micro_sequences == 1 and 0 < long.memory.checkpointed_layers <= 4
    assert long.memory.budget_gib == pytest.approx(2 * 0.92 - 1, abs=0.05)


def test_an_unreadable_model_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read its config.json") as err:
        settings.run_settings(_cfg(tmp_path / "missing"), torch.device("cpu"), 1)
    assert "\n" not in str(err.value)


def test_load_model_reports_what_it_switched_on(tiny_model_dir):
    from llmft.trainer.model import load_model

    _, decision = load_model(_cfg(tiny_model_dir, "d", "lora.r=4"), torch.device("cpu"))
    assert not decision.fused_loss.on and decision.fused_loss.why == "cpu"
    report = decision.as_dict()
    assert json.loads(json.dumps(report)) == report
    assert not any(report[p]["on"] for p in ("attention", "fused_loss", "fused_lora", "grouped_lora", "compile"))
    assert report["gradient_checkpointing"] == {"on": False, "why": "cpu: off", "layers": 0}
    fast, decision = load_model(
        _cfg(tiny_model_dir, "d", "lora.r=4", "kernels.fused_lora=true", "model.gradient_checkpointing=true"),
        torch.device("cpu"),
    )
    assert decision.memory is not None and decision.memory.checkpointed_layers == 4
    report = decision.as_dict()
    assert report["fused_lora"]["on"] and report["fused_lora"]["modules"] == 28 and report["fused_lora"]["kept"] == {}
    assert report["grouped_lora"]["groups"] == 8 and report["gradient_checkpointing"]["layers"] == 4
    layers = [m for m in fast.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert all(layer.gradient_checkpointing for layer in layers)


def test_explicit_fused_lora_that_no_module_can_take_fails(tiny_model_dir):
    from llmft.trainer.model import load_model

    with pytest.raises(ConfigError, match="kernels.fused_lora=true: method full"):
        load_model(_cfg(tiny_model_dir, "d", "method=full", "kernels.fused_lora=true"), torch.device("cpu"))


def test_checkpointing_some_layers_recomputes_only_those_and_keeps_the_gradients(small_qwen2, monkeypatch):
    import torch.utils.checkpoint as ckpt

    model = small_qwen2.double().train()
    input_ids = torch.randint(0, model.config.vocab_size, (1, 11))

    def grads():
        model.zero_grad(set_to_none=True)
        (model(input_ids=input_ids, use_cache=False).logits ** 2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads()
    calls = []
    original = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert settings.enable_checkpointing(model, 1) == 1
    flags = [m.gradient_checkpointing for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert flags == [True, False]
    recomputed = grads()
    assert len(calls) == 1  # the first layer only
    for name, grad in reference.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-12, atol=1e-12, msg=name)
