"""FP8 base checkpoints: the tiny FP8 checkpoint the project writes is the format transformers reads,
our block-wise dequantization equals transformers', LoRA trains on it on CPU end to end (evaluation
and export from the same base); QLoRA on one device loads it dequantized and stores its linears in 4 bits
(bitsandbytes' CPU backend here), and under ZeRO-3 (no device map) resolves to a dequantized bf16 copy.

FP8 e4m3 error bound used below: 3 mantissa bits, so a normal value rounds to within 2^-4 of
itself (relative); below the smallest normal (2^-6) the spacing is 2^-9, an absolute error of at
most 2^-10, both in units of the block's scale (weight_scale_inv); plus one float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, tiny_model_dir) -> Path:
    from llmft.trainer.fp8 import write_fp8_checkpoint

    return write_fp8_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("fp8") / "tiny-fp8", block=(32, 32))


def stored(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_writer_matches_transformers_quantizer(tiny_model_dir, fp8_dir):
    """Every quantized weight and scale is what transformers' own Fp8Quantize writes."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(32, 32))))
    dense, fp8 = stored(tiny_model_dir), stored(fp8_dir)
    quantized = [n for n in fp8 if n.endswith(".weight") and fp8[n].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 4 * 7  # q, k, v, o, gate, up, down of every layer
    for name in quantized:
        expected = quantizer.convert({name: dense[name]})
        assert torch.equal(fp8[name].view(torch.uint8), expected[name].view(torch.uint8)), name
        scale = name[: -len("weight")] + "weight_scale_inv"
        assert torch.equal(fp8[scale], expected[scale]), scale
    config = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [32, 32]


def test_dequantization_equals_transformers_and_stays_within_fp8_error(tiny_model_dir, fp8_dir):
    from transformers import AutoModelForCausalLM

    from llmft.trainer.fp8_format import dequantize

    model = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32)  # CPU: transformers dequantizes
    loaded = model.state_dict()
    dense, fp8 = stored(tiny_model_dir), stored(fp8_dir)
    for name, q in fp8.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        scale = fp8[name[: -len("weight")] + "weight_scale_inv"]
        ours = dequantize(q, scale, (32, 32))
        assert torch.equal(ours, loaded[name]), name
        spread = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        bound = 2.0**-4 * dense[name].abs() + 2.0**-10 * spread + EPS32 * dense[name].abs()
        assert ((ours - dense[name]).abs() <= bound).all(), name


def test_partial_edge_blocks_use_the_configured_block():
    """A weight whose sides are not multiples of the block (DeepSeek-V3's ceil grid): each scale
    covers its 32 x 32 block, the last ones partial."""
    from llmft.trainer.fp8_format import dequantize

    q = torch.randn(40, 72).clamp(-4, 4).to(torch.float8_e4m3fn)
    scale = torch.arange(1.0, 7.0).reshape(2, 3)
    expected = torch.empty(40, 72)
    for i in range(40):
        for j in range(72):
            expected[i, j] = q[i, j].float() * scale[i // 32, j // 32]
    assert torch.equal(dequantize(q, scale, (32, 32)), expected)
    assert torch.equal(dequantize(q, torch.tensor([2.0])), q.float() * 2.0)  # per-tensor
    per_row = torch.arange(1.0, 41.0).reshape(40, 1)
    assert torch.equal(dequantize(q, per_row), q.float() * per_row)  # per-channel (compressed-tensors)


def test_load_plan_dense_and_lora(tiny_model_dir, fp8_dir):
    from llmft.trainer.fp8 import load_plan

    kwargs = {"dtype": torch.float32, "revision": None}
    dense = load_plan(str(tiny_model_dir), None, "lora", kwargs)
    assert dense.path == str(tiny_model_dir) and dense.kwargs == kwargs and dense.base.format == "dense"
    lora = load_plan(str(fp8_dir), None, "lora", kwargs)
    config = lora.kwargs["quantization_config"]
    assert lora.path == str(fp8_dir) and config.dequantize is True and tuple(config.weight_block_size) == (32, 32)
    assert lora.base.as_dict() == {
        "format": "FP8 (fine-grained, block [32, 32])",
        "action": "dequantized to float32 on load",
    }


def test_qlora_on_one_device_loads_fp8_dequantized_then_4bit_with_no_copy(tmp_path, monkeypatch):
    """QLoRA with a device map (one GPU): the FP8 base is dequantized while loading and its linears are then
    stored in 4 bits: the layers transformers' own 4-bit loading converts (its replace_with_bnb_linear on the
    same model), each holding exactly bitsandbytes' quantization of the dequantized FP8 weight; the fused
    MoE experts stay for llmft/trainer/fastpath/moe.py; nothing is written under the cache."""
    bnb = pytest.importorskip("bitsandbytes")
    from moe_model import save_tiny_moe_dir
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from llmft.trainer.fp8 import load_base, write_fp8_checkpoint
    from llmft.trainer.fp8_format import dequantize

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    dense = save_tiny_moe_dir(tmp_path / "moe", hidden_size=64, moe_intermediate_size=32, intermediate_size=64)
    fp8 = write_fp8_checkpoint(dense, tmp_path / "moe-fp8", block=(16, 16))
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.uint8,
    )  # fmt: skip
    kwargs = {"dtype": torch.bfloat16, "quantization_config": config, "device_map": {"": "cpu"}}
    model, base = load_base(str(fp8), None, "qlora", kwargs)
    assert "4-bit" in base.action and "no copy" in base.action and base.dequantized_copy is None
    assert not (tmp_path / "cache").exists() and model.is_loaded_in_4bit
    converted = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shadow = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(fp8)))
    replace_with_bnb_linear(shadow, modules_to_not_convert=["lm_head"], quantization_config=config)
    assert converted == {n for n, m in shadow.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert "lm_head" not in converted and any(n.endswith("self_attn.q_proj") for n in converted)
    weights = stored(fp8)
    for name in converted:
        q, scale = weights[f"{name}.weight"], weights[f"{name}.weight_scale_inv"]
        expected, _ = bnb.functional.quantize_4bit(
            dequantize(q, scale, (16, 16), torch.bfloat16), quant_type="nf4", compress_statistics=True
        )
        assert torch.equal(model.get_submodule(name).weight.data, expected), name
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # moe.py quantizes these


def test_qlora_under_zero3_resolves_to_a_cached_bf16_copy(fp8_dir, tmp_path, monkeypatch):
    """QLoRA without a device map (DeepSpeed ZeRO-3 partitions while loading) keeps its 4-bit config but loads a
    dequantized bf16 copy (transformers refuses a BitsAndBytesConfig for an FP8 checkpoint); the copy is built
    once and reused."""
    from llmft.trainer.fp8 import load_base, load_plan
    from llmft.trainer.fp8_format import dequantize
    from llmft.trainer.io import COMPLETE_MARKER

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    four_bit = object()  # stands in for the BitsAndBytesConfig that llmft/trainer/model.py passes
    plan = load_plan(
        str(fp8_dir), "main", "qlora", {"dtype": torch.bfloat16, "revision": "main", "quantization_config": four_bit}
    )
    copy = Path(plan.path)
    assert copy.parent == tmp_path / "cache" / "dequantized" and (copy / COMPLETE_MARKER).is_file()
    assert plan.kwargs == {"dtype": torch.bfloat16, "quantization_config": four_bit}
    assert "4-bit" in plan.base.action and plan.base.dequantized_copy == str(copy)
    config = json.loads((copy / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    fp8, dense = stored(fp8_dir), stored(copy)
    assert not any(n.endswith("weight_scale_inv") for n in dense)
    for name, tensor in dense.items():
        assert tensor.dtype == torch.bfloat16
        if fp8[name].dtype == torch.float8_e4m3fn:
            scale = fp8[name[: -len("weight")] + "weight_scale_inv"]
            assert torch.equal(tensor, dequantize(fp8[name], scale, (32, 32), torch.bfloat16)), name
    built = (copy / COMPLETE_MARKER).stat().st_mtime_ns
    assert load_plan(str(fp8_dir), None, "qlora", {"dtype": torch.bfloat16}).path == str(copy)
    assert (copy / COMPLETE_MARKER).stat().st_mtime_ns == built
    model, base = load_base(str(fp8_dir), None, "qlora", {"dtype": torch.float32})  # CPU: no 4-bit step
    assert base.dequantized_copy == str(copy)
    from peft import LoraConfig, get_peft_model

    adapter = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert adapter.peft_config["default"].base_model_name_or_path == str(fp8_dir)  # the model named, not the copy


# ----------------------------------------------------------------------------- train, evaluate, export


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LANGFUSE_", "LLMFT_", "PET_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def train(overrides: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=600)


def run_overrides(fp8_dir, tokenized_dir, output) -> dict:
    return {
        "model.name_or_path": fp8_dir,
        "data": tokenized_dir,
        "output_dir": output,
        "lora.r": 4,
        "lora.alpha": 8,
        "lora.dropout": 0.0,
        "optim.lr": 5e-3,
        "batch.global_sequences": 4,
        "batch.micro_sequences": 2,
        "eval.max_sequences": 8,
        "observe.progress_bar": "false",
        "max_steps": 3,
        "seed": 3,
    }


@pytest.mark.slow
def test_lora_trains_evaluates_and_exports_on_an_fp8_base(fp8_dir, tokenized_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmft.trainer.evaluate import evaluate_perplexity
    from llmft.trainer.export import export_adapter

    result = train(run_overrides(fp8_dir, tokenized_dir, tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "base model: FP8 (fine-grained, block [32, 32]): dequantized to float32 on load" in result.stdout
    final = tmp_path / "run" / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(fp8_dir)

    manifest = json.loads((final / "training_manifest.json").read_text())
    assert manifest["base_format"] == {  # how the base was loaded, recorded with the run
        "format": "FP8 (fine-grained, block [32, 32])",
        "action": "dequantized to float32 on load",
    }
    trained = manifest["final_metrics"]
    evaluated = evaluate_perplexity(
        str(fp8_dir), str(tokenized_dir), adapter_path=str(final), max_sequences=8, device="cpu"
    )
    assert evaluated["tokens"] == trained["tokens"]
    # token-NLL sums over the same targets; summation order differs (eps32 x tokens, relative)
    assert abs(evaluated["eval_loss"] - trained["eval_loss"]) <= EPS32 * trained["tokens"] * trained["eval_loss"]

    export_adapter(final, tmp_path / "merged", merge=True, dtype="fp32")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    base = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(final)).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    x = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = reference(x).logits, merged(x).logits
    h, i = merged.config.hidden_size, merged.config.intermediate_size
    tolerance = EPS32 * (merged.config.num_hidden_layers * (3 * h + i) + h) * max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tolerance


@pytest.mark.slow
def test_evaluation_loads_an_fp8_base_as_the_trainer_does(fp8_dir, tokenized_dir, tmp_path, capsys):
    """llmft/trainer/evaluate.py (the pipeline's evaluate step) loads the base through fp8.load_base_model: the
    run log's `base model:` line, and the numbers of the dequantized dense copy of the same checkpoint. On a
    GPU this is what keeps transformers from loading FP8Linear layers, whose forward needs the `kernels`
    package (device auto: the same test runs there; llmft/benchmarks/gpu/session.sh plan fp8-eval)."""
    from llmft.trainer.evaluate import evaluate_perplexity
    from llmft.trainer.merge import BaseCheckpoint, rewrite_checkpoint

    fp8 = evaluate_perplexity(str(fp8_dir), str(tokenized_dir), max_sequences=8, dtype="float32")
    assert "base model: FP8 (fine-grained, block [32, 32]): dequantized to float32 on load" in capsys.readouterr().out
    dense = tmp_path / "dense"
    rewrite_checkpoint(BaseCheckpoint.open(str(fp8_dir)), dense, dtype=torch.float32, kind="test-dense")
    assert evaluate_perplexity(str(dense), str(tokenized_dir), max_sequences=8, dtype="float32") == fp8  # same weights
    assert "base model:" not in capsys.readouterr().out  # a dense base loads as stored, silently


@pytest.mark.slow
def test_qlora_on_an_fp8_base_fails_on_cpu_before_any_copy(fp8_dir, tokenized_dir, tmp_path):
    overrides = {**run_overrides(fp8_dir, tokenized_dir, tmp_path / "run"), "method": "qlora"}
    result = train(overrides, clean_env(LLMFT_CACHE=str(tmp_path / "cache")))
    assert result.returncode == 1
    assert "CUDA" in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "cache").exists()


def test_dev_tiny_model_fp8(tmp_path):
    from llmft.cli import main

    assert main(["dev", "tiny-model", "--fp8", "--output", str(tmp_path / "t")]) == 0
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert any(t.dtype == torch.float8_e4m3fn for t in stored(tmp_path / "t").values())


# ----------------------------------------------------------------------------- compressed-tensors


def write_compressed_fp8(source: Path, output: Path) -> Path:
    """The tiny model in compressed-tensors' float-quantized FP8 format (llm-compressor's FP8_DYNAMIC
    scheme: one bf16 scale per output channel, ``weight_scale``); the config comes from
    compressed-tensors' own QuantizationConfig."""
    import shutil

    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import save_file

    shutil.copytree(source, output, ignore=shutil.ignore_patterns("model.safetensors", ".llmft-owner.json"))
    tensors = {}
    for name, weight in stored(source).items():
        if name.endswith(".weight") and weight.ndim == 2 and "embed_tokens" not in name:
            scale = (weight.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)
            tensors[name] = (weight / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name[: -len("weight")] + "weight_scale"] = scale
        else:
            tensors[name] = weight.to(torch.bfloat16)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    groups = {"group_0": {"targets": ["Linear"], **PRESET_SCHEMES["FP8_DYNAMIC"]}}
    quant = QuantizationConfig(
        config_groups=groups, ignore=["lm_head"], format="float-quantized", quantization_status="compressed"
    ).model_dump()
    config = json.loads((output / "config.json").read_text())
    config.update(quantization_config={**quant, "quant_method": "compressed-tensors"}, dtype="bfloat16")
    (output / "config.json").write_text(json.dumps(config))
    return output


def test_compressed_tensors_fp8_base_loads_dequantized_and_merges(tiny_model_dir, tmp_path, monkeypatch):
    """compressed-tensors FP8 (the package is in the fp8 extra): LoRA loads it dequantized through
    transformers with the same values our reader computes, and the streaming merge over it equals
    PEFT's merge over that loaded base; QLoRA gets a dense bf16 copy."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmft.trainer.export import export_adapter
    from llmft.trainer.fp8 import load_base, load_base_model, load_plan
    from llmft.trainer.merge import BaseCheckpoint

    base = write_compressed_fp8(tiny_model_dir, tmp_path / "ct-fp8")
    model, loaded_as = load_base(str(base), None, "lora", {"dtype": torch.float32})
    assert loaded_as.format == "FP8 (compressed-tensors)"
    loaded = model.state_dict()
    ours = dict(BaseCheckpoint.open(str(base)).tensors(dequantize_fp8=True))
    assert set(ours) == set(loaded) - {"lm_head.weight"}
    assert all(torch.equal(ours[n].float(), loaded[n]) for n in ours)

    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    export_adapter(tmp_path / "adapter", tmp_path / "merged", merge=True, dtype="fp32")
    reference = PeftModel.from_pretrained(
        load_base_model(str(base), None, "lora", {"dtype": torch.float32}), str(tmp_path / "adapter")
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    for name, tensor in reference.merge_and_unload().state_dict().items():
        # float32 merge of the same dequantized weights: rounding of B @ A (rank 4) and of the add
        assert torch.allclose(merged[name], tensor, rtol=8 * EPS32, atol=8 * EPS32), name

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    copy = Path(load_plan(str(base), None, "qlora", {"dtype": torch.bfloat16}).path)
    assert "quantization_config" not in json.loads((copy / "config.json").read_text())
    assert all(t.dtype != torch.float8_e4m3fn for t in stored(copy).values())
