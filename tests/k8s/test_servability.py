"""vLLM servability of real PEFT adapters saved from the tiny model, and the local
generation check (base vs base + adapter) that proves an adapter changes the model."""

from __future__ import annotations

import json
import shutil

import pytest

from llmft.components.lib.serving.local_check import AdapterHasNoEffectError, local_generation_check
from llmft.components.lib.serving.servability import (
    AdapterNotServableError,
    check_vllm_servable,
    lora_module_names,
    require_vllm_servable,
    safetensors_keys,
)

PROMPTS = ["What is two plus two?", "Name three primary colors."]


def _save_adapter(base_dir, out_dir, *, nonzero_b: bool, **lora_kwargs):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=lora_kwargs.pop("r", 8),
        lora_alpha=16,
        target_modules=lora_kwargs.pop(
            "target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ),
        task_type="CAUSAL_LM",
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, config)
    if nonzero_b:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def trained_adapter(tiny_model_dir, tmp_path_factory):
    return _save_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "trained", nonzero_b=True)


@pytest.fixture(scope="module")
def zero_adapter(tiny_model_dir, tmp_path_factory):
    return _save_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "zero", nonzero_b=False)


@pytest.fixture
def adapter_copy(trained_adapter, tmp_path):
    """A scratch copy of the trained adapter that a test may edit."""
    return shutil.copytree(trained_adapter, tmp_path / "adapter")


def _edit_config(adapter_dir, **changes):
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_plain_lora_adapter_is_servable(trained_adapter):
    assert check_vllm_servable(trained_adapter, max_lora_rank=8) == []
    require_vllm_servable(trained_adapter)
    keys = safetensors_keys(trained_adapter / "adapter_model.safetensors")
    assert lora_module_names(keys) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 128}, "r=128 exceeds max_lora_rank=64"),
        ({"rank_pattern": {"q_proj": 96}}, "rank_pattern[q_proj]=96 exceeds"),
        ({"bias": "all"}, "bias='none'"),
        ({"peft_type": "IA3"}, "LoRA adapters only"),
        ({"target_modules": ["q_proj", "gate"]}, "['gate'] are not LoRA-servable"),
    ],
)
def test_config_problems_are_found_and_named(adapter_copy, changes, expected):
    _edit_config(adapter_copy, **changes)
    problems = check_vllm_servable(adapter_copy)
    assert len(problems) == 1 and expected in problems[0], problems
    assert "adapter_config.json" in problems[0]
    with pytest.raises(AdapterNotServableError, match="cannot be served by vLLM"):
        require_vllm_servable(adapter_copy)


def test_real_dora_adapter_is_refused(tiny_model_dir, tmp_path):
    adapter = _save_adapter(tiny_model_dir, tmp_path / "dora", nonzero_b=True, use_dora=True)
    problems = check_vllm_servable(adapter)
    assert any("adapter_config.json: use_dora=true" in p for p in problems), problems
    assert any("adapter_model.safetensors: holds DoRA magnitude vectors" in p for p in problems), problems
    assert not any("full (non-LoRA) weights" in p for p in problems), problems  # the magnitude is no full weight


def test_weights_on_unsupported_modules_are_refused(tiny_model_dir, tmp_path):
    adapter = _save_adapter(tiny_model_dir, tmp_path / "lm-head", nonzero_b=True, target_modules=["q_proj", "lm_head"])
    problems = check_vllm_servable(adapter)
    assert any("target_modules ['lm_head']" in p for p in problems), problems
    assert any("adapter_model.safetensors: LoRA weights on modules ['lm_head']" in p for p in problems), problems
    assert any("full (non-LoRA) weights for ['lm_head']" in p for p in problems), problems


def test_rank_limit_and_allowed_max_ranks(trained_adapter):
    assert any("exceeds max_lora_rank=1" in p for p in check_vllm_servable(trained_adapter, max_lora_rank=1))
    assert any("vLLM accepts only" in p for p in check_vllm_servable(trained_adapter, max_lora_rank=48))


def test_missing_or_pickled_files_are_refused(adapter_copy, tmp_path):
    (adapter_copy / "adapter_model.bin").write_bytes(b"pickle")
    assert any("pickled weights ['adapter_model.bin']" in p for p in check_vllm_servable(adapter_copy))
    (adapter_copy / "adapter_model.safetensors").unlink()
    assert any("adapter_model.safetensors: missing" in p for p in check_vllm_servable(adapter_copy))
    (adapter_copy / "adapter_config.json").unlink()
    assert any("adapter_config.json: missing" in p for p in check_vllm_servable(adapter_copy))
    assert check_vllm_servable(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'}: not a directory"]


@pytest.mark.slow
def test_local_generation_check_accepts_an_adapter_that_changes_the_model(tiny_model_dir, trained_adapter):
    samples = local_generation_check(str(tiny_model_dir), str(trained_adapter), PROMPTS, max_new_tokens=6)
    assert [s.prompt for s in samples] == PROMPTS
    for _prompt, base_text, adapter_text in samples:
        assert isinstance(base_text, str) and isinstance(adapter_text, str)
    assert any(s.base_text != s.adapter_text for s in samples), "B ~ N(0, 0.5) must change the greedy text"


@pytest.mark.slow
def test_local_generation_check_refuses_a_zero_adapter(tiny_model_dir, zero_adapter):
    with pytest.raises(AdapterHasNoEffectError, match="changes nothing.*largest logit difference"):
        local_generation_check(str(tiny_model_dir), str(zero_adapter), PROMPTS, max_new_tokens=4)


# ----------------------------------------------------------------------------- mixture of experts


def _save_moe_adapter(out_dir, **lora_kwargs):
    """A real PEFT adapter on a tiny random Qwen3-MoE (transformers 5.x fused experts), as the trainer saves it."""
    from moe_model import tiny_moe
    from peft import LoraConfig, get_peft_model

    model = tiny_moe(vocab_size=64)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, **lora_kwargs)).save_pretrained(out_dir)
    return out_dir


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_moe_attention_lora_is_servable(tmp_path):
    adapter = _save_moe_adapter(tmp_path / "attention", target_modules=ATTENTION)
    assert check_vllm_servable(adapter) == []


def test_moe_expert_lora_is_refused_unless_the_server_runs_the_mixed_format(tmp_path):
    both = ["experts.gate_up_proj", "experts.down_proj"]
    adapter = _save_moe_adapter(tmp_path / "experts", target_modules=ATTENTION, target_parameters=both)
    keys = safetensors_keys(adapter / "adapter_model.safetensors")
    assert any(".mlp.experts.base_layer.lora_A." in k for k in keys)  # PEFT's nested ParamWrapper layout
    assert lora_module_names(keys) == {*ATTENTION, "experts"}
    problems = check_vllm_servable(adapter)
    assert len(problems) == 1 and "vLLM 0.24.0" in problems[0] and "is_3d_lora_weight" in problems[0], problems
    with pytest.raises(AdapterNotServableError, match="fused MoE expert tensors"):
        require_vllm_servable(adapter)
    assert check_vllm_servable(adapter, moe_3d_lora_format=True) == []
    one = _save_moe_adapter(tmp_path / "down", target_modules=ATTENTION, target_parameters=["experts.down_proj"])
    assert any("without ['experts.gate_up_proj']" in p for p in check_vllm_servable(one, moe_3d_lora_format=True))


def test_moe_router_lora_is_refused(tmp_path):
    adapter = _save_moe_adapter(tmp_path / "router", target_modules=ATTENTION, target_parameters=["gate.weight"])
    problems = check_vllm_servable(adapter, moe_3d_lora_format=True)
    assert any("adapt the MoE router" in p for p in problems), problems
    assert any("LoRA weights on modules ['gate']" in p for p in problems), problems
