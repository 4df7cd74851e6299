"""`auto` resolves as documented (llmft/trainer/fastpath/resolve.py): everything that applies on CUDA,
nothing on CPU, per-piece reasons, explicit values win, `true` where a piece cannot apply fails."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llmft.trainer.config_load import load_config
from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath.resolve import (
    FastPath,
    ModelInfo,
    describe,
    model_info_from_config,
    resolve_fast_path,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
QWEN = ModelInfo()


def _cfg(*overrides):
    return load_config(None, ["model.name_or_path=m", "data=d", *overrides])


def _state(fast) -> dict:
    pieces = ("fused_loss", "fused_lora", "grouped_lora", "compile")
    return {"attention": fast.attention, **{p: getattr(fast, p).on for p in pieces}}


def test_cuda_lora_defaults_switch_every_piece_on():
    fast = resolve_fast_path(_cfg(), CUDA, QWEN)
    assert _state(fast) == dict(
        attention="llmft_varlen", fused_loss=True, fused_lora=True, grouped_lora=True, compile=True
    )
    assert fast.fused_lora.why == "auto" and fast.attention_why == "auto"


def test_cpu_defaults_keep_the_plain_path():
    """auto never changes a CPU run: sdpa, plain loss, PEFT's LoRA, no compile (as before the fast path)."""
    fast = resolve_fast_path(_cfg(), CPU, QWEN)
    assert _state(fast) == dict(attention="sdpa", fused_loss=False, fused_lora=False, grouped_lora=False, compile=False)
    assert {fast.fused_loss.why, fast.fused_lora.why, fast.grouped_lora.why, fast.compile.why} == {"cpu"}


def test_lora_dropout_no_longer_turns_the_fast_path_off():
    assert _cfg().lora.dropout == 0.05
    assert resolve_fast_path(_cfg("lora.dropout=0.1"), CUDA, QWEN).fused_lora.on


@pytest.mark.parametrize(
    "overrides, expected, reasons",
    [
        (
            ["method=qlora"],
            dict(attention="llmft_varlen", fused_loss=True, fused_lora=True, grouped_lora=True, compile=True),
            {"fused_lora": "auto", "grouped_lora": "auto"},  # 4-bit bases: llmft/trainer/fastpath/qlora.py
        ),
        (
            ["distributed.backend=deepspeed", "distributed.zero_stage=3"],
            dict(attention="llmft_varlen", fused_loss=True, fused_lora=False, grouped_lora=False, compile=False),
            {"fused_lora": "DeepSpeed ZeRO-3 partitions the base weights: not applicable"},
        ),
        (
            ["distributed.backend=deepspeed", "distributed.zero_stage=2"],
            dict(attention="llmft_varlen", fused_loss=True, fused_lora=True, grouped_lora=True, compile=True),
            {},
        ),
        (
            ["method=full"],
            dict(attention="llmft_varlen", fused_loss=True, fused_lora=False, grouped_lora=False, compile=True),
            {"fused_lora": "method full: no LoRA layers"},
        ),
        (
            ["lora.use_dora=true"],
            dict(attention="llmft_varlen", fused_loss=True, fused_lora=False, grouped_lora=False, compile=True),
            {"fused_lora": "DoRA: not applicable"},
        ),
        (
            ["lora.target_modules=[q_proj,v_proj,lm_head]"],
            dict(attention="llmft_varlen", fused_loss=False, fused_lora=True, grouped_lora=True, compile=True),
            {"fused_loss": "lm_head carries a LoRA adapter: not applicable"},
        ),
    ],
    ids=["qlora", "zero3", "zero2", "full", "dora", "lm_head-adapter"],
)
def test_each_piece_that_applies_is_on_and_the_rest_say_why(overrides, expected, reasons):
    fast = resolve_fast_path(_cfg(*overrides), CUDA, QWEN)
    assert _state(fast) == expected
    for piece, why in reasons.items():
        assert getattr(fast, piece).why == why


def test_attention_falls_back_to_sdpa_where_varlen_cannot_run():
    sliding = ModelInfo(sliding_window=True)
    fast = resolve_fast_path(_cfg(), CUDA, sliding)
    assert fast.attention == "sdpa" and fast.attention_why == "sliding-window attention layers"
    assert resolve_fast_path(_cfg(), CUDA, ModelInfo(attention_dropout=0.1)).attention == "sdpa"
    assert resolve_fast_path(_cfg(), CUDA, ModelInfo(attention_interface=False)).attention == "sdpa"


def test_explicit_values_win():
    fast = resolve_fast_path(
        _cfg("kernels.compile=false", "kernels.fused_loss=false", "model.attn_implementation=sdpa"), CUDA, QWEN
    )
    assert not fast.compile.on and fast.compile.why == "set false" and not fast.fused_loss.on
    assert fast.attention == "sdpa" and fast.fused_lora.on
    on_cpu = resolve_fast_path(_cfg("kernels.fused_loss=true", "kernels.fused_lora=true"), CPU, QWEN)
    assert on_cpu.fused_loss.on and on_cpu.fused_lora.why == "set true"
    assert on_cpu.grouped_lora.on and on_cpu.grouped_lora.why == "auto"  # follows fused_lora
    ungrouped = resolve_fast_path(_cfg("kernels.fused_lora=true", "kernels.grouped_lora=false"), CPU, QWEN)
    assert ungrouped.fused_lora.on and not ungrouped.grouped_lora.on


@pytest.mark.parametrize(
    "overrides, info, message",
    [
        (["method=full", "kernels.fused_lora=true"], QWEN, "kernels.fused_lora=true: method full: no LoRA layers"),
        (["method=qlora", "lora.use_dora=true", "kernels.fused_lora=true"], QWEN, "fused_lora=true: DoRA"),
        (
            ["kernels.fused_lora=false", "kernels.grouped_lora=true"],
            QWEN,
            "grouped_lora=true: needs kernels.fused_lora",
        ),
        (["lora.target_modules=[lm_head]", "kernels.fused_loss=true"], QWEN, "lm_head carries a LoRA adapter"),
        (["model.attn_implementation=llmft_varlen"], ModelInfo(sliding_window=True), "sliding-window"),
        (["kernels.compile=true"], ModelInfo(decoder_layers=False), "no *DecoderLayer modules"),
    ],
)
def test_true_where_a_piece_cannot_apply_is_one_config_error(overrides, info, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")) as err:
        resolve_fast_path(_cfg(*overrides), CUDA, info)
    assert "\n" not in str(err.value) and "auto or" in str(err.value)


def test_model_info_from_transformers_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert model_info_from_config(Qwen2Config()) == ModelInfo()
    assert model_info_from_config(LlamaConfig()) == ModelInfo()
    assert model_info_from_config(Qwen2Config(use_sliding_window=True, max_window_layers=0)).sliding_window
    assert model_info_from_config(MistralConfig(sliding_window=4096)).sliding_window
    assert not model_info_from_config(MistralConfig(sliding_window=None)).sliding_window


def test_report_is_a_plain_dict_with_every_piece_and_why():
    from llmft.trainer.sizing.memory import MemoryPlan

    fast = resolve_fast_path(_cfg(), CUDA, QWEN)
    applied = {"fused_lora": 196, "lora_kept": {}, "grouped_lora": 56, "compiled_layers": 28}
    memory = MemoryPlan(
        micro_sequences=8,
        checkpointed_layers=0,
        layers=28,
        micro_why="auto: the step's 8 sequence(s) per rank in one forward fit",
        checkpointing_why="auto: off, the micro batch fits without it",
        estimate_gib=41.0,
        budget_gib=71.2,
        free_gib=78.5,
        parts_gib={"activations": 33.0},
    )
    decision = fast.applied(applied, memory)
    assert isinstance(decision, FastPath) and decision.fused_lora.count == 196 and decision.compile.count == 28
    report = decision.as_dict()
    assert json.loads(json.dumps(report)) == report
    # the keys metrics.jsonl and training_manifest.json have always carried (llmft/benchmarks/ read them)
    assert report["fused_lora"] == {"on": True, "why": "auto", "modules": 196, "kept": {}}
    assert report["grouped_lora"] == {"on": True, "why": "auto", "groups": 56, "ungrouped": {}}
    assert report["gradient_checkpointing"] == {"on": False, "why": memory.checkpointing_why, "layers": 0}
    assert report["micro_batch"] == {"sequences": 8, "why": memory.micro_why}
    assert report["memory"] == {
        "estimate_gib": 41.0,
        "budget_gib": 71.2,
        "free_gib": 78.5,
        "parts_gib": {"activations": 33.0},
    }
    for piece in ("attention", "fused_loss", "fused_lora", "grouped_lora", "compile", "gradient_checkpointing"):
        assert set(report[piece]) >= {"on", "why"}, piece
    assert report["fused_lora"]["modules"] == 196 and report["compile"]["layers"] == 28
    line = describe(decision)
    assert line.startswith("fast path: on: attention llmft_varlen, fused_loss, fused_lora (196 modules), ")
    assert "off: gradient_checkpointing (auto: off, the micro batch fits without it)" in line
    assert "micro batch: 8 sequence(s)" in line and "est. 41.0 of 71.2 GiB" in line
    assert "=" not in line  # Katib's stdout collector reads every name=value pair as a metric


def test_report_turns_fused_lora_off_when_no_module_could_take_it():
    fast = resolve_fast_path(_cfg(), CUDA, QWEN)
    kept = {"model.layers.0.self_attn.q_proj": "base layer is Linear4bit, not nn.Linear"}
    decision = fast.applied({"fused_lora": 0, "lora_kept": kept, "grouped_lora": 0})
    assert not decision.fused_lora.on and decision.fused_lora.left_out == kept
    report = decision.as_dict()
    assert set(report) == {"attention", "fused_loss", "fused_lora", "grouped_lora", "compile"}  # no memory plan
    assert report["fused_lora"] == {
        "on": False,
        "why": "no LoRA linear could take it (base layer is Linear4bit, not nn.Linear)",
        "modules": 0,
        "kept": kept,
    }
    assert not report["grouped_lora"]["on"]
    assert "moe {'layers': 2}" in describe(dataclasses.replace(decision, moe={"layers": 2}))
