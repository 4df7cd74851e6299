"""`llmft export`: the streaming merge equals PEFT's, the merged model's logits equal base + adapter,
a shard-limited merge holds one input file at a time, and the written directories are complete
(tokenizer with the run's chat template, manifest, modes) and refuse to replace what is not ours.

Tolerances (float32 unless said):
* a merged tensor vs PEFT's ``merge_and_unload``: each element of ``B @ A`` is a rank-r dot product,
  so its rounding error is at most ``r * eps32 * (|B| @ |A|)``; scaling, the add to W (and DoRA's
  factor) add one rounding each: bound ``(r + 3) * eps32 * (|W| + s * |B| @ |A|) * max(1, |factor|)``.
* logits of the merged model vs PEFT's forward: the two differ only in summation order, each
  linear layer's error is at most ``eps32 * fan_in`` relative; summed over the layers on the path
  (4 x (q/k/v + o + gate/up + down fan-ins) + lm_head) and scaled by the largest logit.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps
REPO = Path(__file__).resolve().parents[2]

VARIANTS = {
    "lora": {"target_modules": "all-linear"},
    "dora": {"target_modules": "all-linear", "use_dora": True},
    "rslora-patterns-bias": {
        "target_modules": ["q_proj", "k_proj", "v_proj"],
        "use_rslora": True,
        "rank_pattern": {"k_proj": 2},
        "alpha_pattern": {"v_proj": 3.0},
        "lora_bias": True,
    },
}


def make_adapter(base_dir: Path, output: Path, seed: int = 0, **peft_kwargs) -> Path:
    """A PEFT adapter on the tiny model with non-trivial B (and DoRA magnitudes, biases)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = {"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM", **peft_kwargs}
    peft_model = get_peft_model(model, LoraConfig(**config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
            elif "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.1 * torch.randn_like(param))
    peft_model.save_pretrained(output)
    return output


def peft_model(base_dir, adapter_dir, dtype=torch.float32):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def logits_tolerance(config, logits: torch.Tensor) -> float:
    h, i = config.hidden_size, config.intermediate_size
    path = config.num_hidden_layers * (h + h + h + i) + h
    return EPS32 * path * max(1.0, logits.abs().max().item())


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def merged_state(directory: Path, dtype=torch.float32) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).state_dict()


def file_mode_ok(directory: Path) -> list[str]:
    mask = os.umask(0)
    os.umask(mask)
    want = 0o666 & ~mask
    return [p.name for p in directory.rglob("*") if p.is_file() and stat.S_IMODE(p.stat().st_mode) != want]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streaming_merge_equals_peft_merge_and_logits(variant, tiny_model_dir, tmp_path):
    from llmft.trainer.export import export_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", **VARIANTS[variant])
    manifest = export_adapter(adapter, tmp_path / "merged", merge=True, dtype="fp32")
    reference = peft_model(tiny_model_dir, adapter)
    x = tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected_logits = reference(x).logits
    bounds = _merge_bounds(reference)
    adapted = sum(1 for n, _ in reference.named_modules() if n.endswith("lora_A"))
    ours = merged_state(tmp_path / "merged")
    theirs = reference.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        bound = bounds.get(name, torch.zeros_like(tensor))
        assert ((ours[name] - tensor).abs() <= bound).all(), name
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = merged(x).logits
    assert (logits - expected_logits).abs().max().item() <= logits_tolerance(merged.config, expected_logits)
    assert manifest["merged_modules"] == adapted > 0


def _merge_bounds(peft) -> dict:
    """Per-tensor elementwise error bounds of a float32 merge (module docstring)."""
    bounds = {}
    for name, module in peft.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
        scale = module.scaling["default"]
        w = module.get_base_layer().weight.detach()
        spread = (w.abs() + scale * (b.abs() @ a.abs())) * (a.shape[0] + 3) * EPS32
        mags = getattr(module, "lora_magnitude_vector", {})
        if "default" in mags:
            norm = torch.linalg.norm(w + scale * (b @ a), dim=1)
            spread = spread * (mags["default"].weight.detach().abs() / norm).clamp(min=1.0).view(-1, 1)
        key = name.removeprefix("base_model.model.")
        bounds[f"{key}.weight"] = spread
        if module.lora_B["default"].bias is not None:
            bounds[f"{key}.bias"] = 2 * EPS32 * (module.get_base_layer().bias.abs() + 1.0)
    return bounds


def test_bf16_merge_rounds_once_and_stays_near_peft(tiny_model_dir, tmp_path):
    """--dtype bf16: each tensor is the float32 merge rounded once; PEFT, merging into a bf16-loaded
    base, rounds W first and W' again, so the two differ by at most eps_bf16/2 |W| + eps_bf16 |W'|."""
    from llmft.trainer.export import export_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", target_modules="all-linear")
    export_adapter(adapter, tmp_path / "fp32", merge=True, dtype="fp32")
    export_adapter(adapter, tmp_path / "bf16", merge=True, dtype="bf16")
    exact, ours = merged_state(tmp_path / "fp32"), merged_state(tmp_path / "bf16", torch.bfloat16)
    theirs = peft_model(tiny_model_dir, adapter, torch.bfloat16).merge_and_unload().state_dict()
    base = merged_state(tiny_model_dir)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, exact[name].to(torch.bfloat16)), name
        bound = 0.5 * EPS_BF16 * base[name].abs() + EPS_BF16 * exact[name].abs()
        assert ((tensor.float() - theirs[name].float()).abs() <= bound).all(), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_shard_limited_merge_opens_one_shard_at_a_time(tiny_model_dir, tmp_path, monkeypatch):
    """A base in several shards merged into several small output shards: every input file is opened
    once and never beside another, each output shard stays within the limit (or holds one larger
    tensor), and the result equals the unlimited merge tensor by tensor."""
    from transformers import AutoModelForCausalLM

    from llmft.trainer import merge
    from llmft.trainer.export import export_adapter

    sharded = tmp_path / "sharded-base"
    shutil.copytree(tiny_model_dir, sharded, ignore=shutil.ignore_patterns("model.safetensors", ".llmft-owner.json"))
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="300KB")
    inputs = merge.weight_files(sharded)
    assert len(inputs) >= 4
    adapter = make_adapter(sharded, tmp_path / "adapter", target_modules="all-linear", use_dora=True)
    export_adapter(adapter, tmp_path / "whole", merge=True, dtype="fp32")

    opened, live, peak = [], [0], [0]
    real_open = merge.safe_open

    class Counting:
        def __init__(self, path, framework):
            self.inner = real_open(path, framework=framework)
            opened.append(Path(path).name)

        def __enter__(self):
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            live[0] -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(merge, "safe_open", Counting)
    limit = 200_000
    manifest = export_adapter(adapter, tmp_path / "limited", merge=True, dtype="fp32", max_shard_size=limit)
    assert peak[0] == 1 and opened == inputs
    largest = max(t.numel() * t.element_size() for t in merged_state(tmp_path / "whole").values())
    assert manifest["largest_tensor_bytes"] == largest
    sizes = [(tmp_path / "limited" / name).stat().st_size for name in manifest["shards"]]
    assert all(size <= max(limit, largest) + 4096 for size in sizes)  # + the JSON header
    assert len(manifest["shards"]) >= 4
    index = json.loads((tmp_path / "limited" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == manifest["shards"]
    assert index["metadata"]["total_size"] == manifest["bytes"]
    whole, limited = merged_state(tmp_path / "whole"), merged_state(tmp_path / "limited")
    assert all(torch.equal(whole[k], limited[k]) for k in whole)


def test_lora_on_tied_embeddings_is_refused(tiny_model_dir, tmp_path):
    from llmft.trainer.errors import ConfigError
    from llmft.trainer.export import export_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        export_adapter(adapter, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()


# ----------------------------------------------------------------------------- a trained run, end to end


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_dir, tokenized_dir) -> Path:
    """`llmft train` (LoRA, 4 steps, checkpoints at 2 and 4) on the tiny model: the run directory."""
    run = tmp_path_factory.mktemp("export-run") / "run"
    overrides = {
        "model.name_or_path": tiny_model_dir,
        "data": tokenized_dir,
        "output_dir": run,
        "lora.r": 4,
        "lora.alpha": 8,
        "lora.dropout": 0.0,
        "optim.lr": 5e-3,
        "batch.global_sequences": 4,
        "batch.micro_sequences": 2,
        "eval.max_sequences": 8,
        "observe.progress_bar": "false",
        "max_steps": 4,
        "save_every": 2,
        "seed": 3,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("MLFLOW_", "LANGFUSE_", "LLMFT_", "PET_"))}
    cmd = [sys.executable, "-m", "llmft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def cli(*argv: str) -> tuple[int, str, str]:
    """`llmft ...` in this process (the product entry point), with its stdout and stderr."""
    import contextlib
    import io

    from llmft.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_export_merged_from_final(trained_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmft.trainer.io import is_complete, sha256_file

    final = trained_run / "final"
    code, out, err = cli(
        "export", "--adapter", str(final), "--output", str(tmp_path / "m"), "--merge", "--dtype", "fp32"
    )
    assert code == 0, err
    assert "without --enable-lora" in out
    merged = tmp_path / "m"
    assert is_complete(merged) and file_mode_ok(merged) == []
    manifest = json.loads((merged / "export_manifest.json").read_text())
    training = json.loads((final / "training_manifest.json").read_text())
    assert manifest["format"] == "merged"
    assert manifest["base_model"]["name_or_path"] == str(tiny_model_dir)
    assert manifest["base_model"]["revision"] is None
    assert manifest["adapter"]["sha256"] == sha256_file(final / "adapter_model.safetensors")
    assert manifest["dataset"]["cache_key"] == training["dataset"]["cache_key"]
    assert (merged / "training_manifest.json").read_text() == (final / "training_manifest.json").read_text()
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in config
    assert AutoTokenizer.from_pretrained(merged).chat_template == AutoTokenizer.from_pretrained(final).chat_template
    assert json.loads((merged / "tokenizer_config.json").read_text())["chat_template"]  # older serving stacks
    assert (merged / "generation_config.json").is_file()

    reference = peft_model(tiny_model_dir, final)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        expected, got = reference(x).logits, model(x).logits
    assert (got - expected).abs().max().item() <= logits_tolerance(model.config, expected)
    assert (got - expected).abs().max().item() < (expected - merged_base_logits(tiny_model_dir, x)).abs().max().item()


def merged_base_logits(base_dir, x):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()(x).logits


@pytest.mark.slow
def test_export_from_promoted_checkpoint(trained_run, tmp_path):
    """A promoted adapter (copied from checkpoints/step-N by the promote step) carries no tokenizer
    or manifest: both come from the run's final/, through promotion.json."""
    from llmft.components.lib.evaluation.promote import promote

    checkpoint = trained_run / "checkpoints" / "step-4"
    evaluation = {
        "base": {"perplexity": 1000.0},
        "checkpoints": [{"name": "step-4", "path": str(checkpoint), "step": 4, "perplexity": 10.0, "eval_loss": 2.3}],
    }
    promote(evaluation, tmp_path / "promoted", margin=0.0)
    code, _, err = cli("export", "--adapter", str(tmp_path / "promoted"), "--output", str(tmp_path / "bundle"))
    assert code == 0, err
    bundle = tmp_path / "bundle"
    names = {p.name for p in bundle.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer_config.json",
        "export_manifest.json",
    } <= names
    assert {"training_manifest.json", "generation_config.json", "chat_template.jinja"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng", "trainer_state.json", "train_config.json"}
    manifest = json.loads((bundle / "export_manifest.json").read_text())
    assert manifest["format"] == "adapter" and str(trained_run / "final") in manifest["tokenizer_source"]
    training = json.loads((trained_run / "final" / "training_manifest.json").read_text())
    assert manifest["dataset"]["cache_key"] == training["dataset"]["cache_key"]
    code, _, err = cli("export", "--adapter", str(bundle), "--output", str(tmp_path / "merged"), "--merge")
    assert code == 0, err
    assert (tmp_path / "merged" / "chat_template.jinja").read_text() == (bundle / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_export_refuses_what_is_not_ours(trained_run, tmp_path):
    target = tmp_path / "somebodys"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    code, out, err = cli("export", "--adapter", str(trained_run / "final"), "--output", str(target), "--merge")
    assert code == 1 and err.count("\n") == 1 and "--force" in err
    assert (target / "notes.txt").read_text() == "keep me"
    code, _, err = cli("export", "--adapter", str(trained_run / "final"), "--output", str(target), "--force")
    assert code == 0, err
    assert not (target / "notes.txt").exists()
    code, _, err = cli("export", "--adapter", str(tmp_path), "--output", str(tmp_path / "x"))
    assert code == 1 and "adapter_config.json" in err and err.count("\n") == 1
