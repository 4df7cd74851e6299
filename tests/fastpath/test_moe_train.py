"""MoE through training: the load-balancing loss per document and per supervised token
(llmft/trainer/moe_aux.py) against transformers' own loss taken on each document alone, and a
tiny Qwen3-MoE trained end to end by the real trainer CLI with LoRA on attention and experts."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from moe_model import save_tiny_moe_dir, tiny_moe
from peft import LoraConfig, get_peft_model
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from llmft.trainer.data.shards import position_ids_for
from llmft.trainer.fastpath import moe
from llmft.trainer.loss import token_nll_sum
from llmft.trainer.moe_aux import find_router_aux, router_aux_metrics, with_router_aux_loss

pytestmark = pytest.mark.slow  # trains a tiny MoE model, in process and with `python -m llmft.trainer`

REPO = Path(__file__).resolve().parents[2]
COEF = 0.5
LENGTHS = [5, 9, 4]


@pytest.fixture()
def aux_model():
    from llmft.trainer.fastpath.attention import register

    register()
    model = tiny_moe(
        torch.float64, output_router_logits=True, router_aux_loss_coef=COEF, attn_implementation="llmft_varlen"
    )
    model.set_experts_implementation("eager")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(model, config)
    assert moe.apply_moe(peft_model)["router_aux_loss_coef"] == COEF
    return peft_model.train()


def _packed(lengths, tail: int = 0) -> dict:
    """One packed row of documents (optionally ``tail`` tokens after the last one), loader layout."""
    gen = torch.Generator().manual_seed(5)
    total = sum(lengths) + tail
    ids = torch.randint(0, 97, (1, total), generator=gen)
    targets = ids.roll(-1, dims=1)
    ends = np.cumsum(lengths)
    targets[0, ends - 1] = -100  # never across documents
    targets[0, [0, 1, 6]] = -100  # prompt tokens
    targets[0, sum(lengths) :] = -100
    positions = position_ids_for(np.array(lengths + ([tail] if tail else [])))
    return {
        "input_ids": ids,
        "position_ids": torch.from_numpy(positions).long()[None],
        "targets": targets,
        "cu_seqlens": torch.tensor([0, *ends], dtype=torch.int32),
        "max_seqlen": max(lengths),
    }


def _switch_aux(router_logits, experts: int = 4, top_k: int = 2) -> torch.Tensor:
    """Switch Transformer's balance loss over all rows given, in float64 (transformers' own function
    accumulates in float32, so it serves as the float32-level check of the definition below)."""
    probs = [torch.softmax(z.double(), dim=-1) for z in router_logits]
    rows = sum(p.shape[0] for p in probs)
    slots = sum(torch.nn.functional.one_hot(p.topk(top_k).indices, experts).sum((0, 1)) for p in probs)
    return experts * ((slots / rows) * (sum(p.sum(0) for p in probs) / rows)).sum()


def _per_document_reference(model, batch) -> tuple[torch.Tensor, float, list]:
    """sum_d w_d aux_d with aux_d from document d run alone; also each document's router logits."""
    cu = batch["cu_seqlens"].tolist()
    total, weight, logits = 0.0, 0.0, []
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        out = model(
            input_ids=batch["input_ids"][:, lo:hi],
            position_ids=torch.arange(hi - lo)[None],
            output_router_logits=True,
            use_cache=False,
        )
        w = float((batch["targets"][0, lo:hi] != -100).sum())
        total, weight = total + w * _switch_aux(out.router_logits), weight + w
        logits.append(out.router_logits)
    return total, weight, logits


def test_router_aux_loss_is_per_document_and_per_supervised_token(aux_model):
    plain = functools.partial(token_nll_sum, varlen=True)
    loss = with_router_aux_loss(plain)
    batch = _packed(LENGTHS)
    value = loss(aux_model, batch)
    term, weight = find_router_aux(aux_model).window.tolist()  # logged in float32
    reference, ref_weight, logits = _per_document_reference(aux_model, batch)
    assert weight == ref_weight == 18 - 3 - 3  # three doc ends, three prompt tokens
    assert term == pytest.approx(float(reference), rel=4 * torch.finfo(torch.float32).eps)
    for doc_logits in logits:  # the definition is transformers' (its float32 accumulation sets the tolerance)
        hf = load_balancing_loss_func(doc_logits, 4, 2)
        assert float(hf) == pytest.approx(float(_switch_aux(doc_logits)), rel=16 * torch.finfo(torch.float32).eps)
    # The returned value is the NLL sum alone (what the trainer logs); the gradient carries coef * term.
    torch.testing.assert_close(value, plain(aux_model, batch), rtol=0, atol=0)
    params = [p for p in aux_model.parameters() if p.requires_grad]
    with_aux = torch.autograd.grad(loss(aux_model, batch), params)
    without = torch.autograd.grad(plain(aux_model, batch), params)
    expected = torch.autograd.grad(COEF * _per_document_reference(aux_model, batch)[0], params)
    # transformers' router takes its softmax in float32 even in a float64 model, so gradients that pass
    # through it are float32-rounded: the tolerance is a few float32 ulps of the whole gradient.
    for got, base, want in zip(with_aux, without, expected, strict=True):
        tol = 16 * torch.finfo(torch.float32).eps * float(got.abs().max())
        torch.testing.assert_close(got - base, want, rtol=0, atol=tol)
    largest = max(float(g.abs().max()) for g in with_aux)
    assert max(float(w.abs().max()) for w in expected) > 100 * 16 * torch.finfo(torch.float32).eps * largest


def test_tokens_outside_every_document_do_not_count(aux_model):
    """A tail after the last document (as padding would be) routes but adds nothing."""
    loss = with_router_aux_loss(functools.partial(token_nll_sum, varlen=True))
    loss(aux_model, _packed(LENGTHS))
    clean = find_router_aux(aux_model).window.clone()
    find_router_aux(aux_model).window = None
    aux = find_router_aux(aux_model)
    padded = _packed(LENGTHS, tail=3)
    forward = {**padded, "cu_seqlens": torch.tensor([0, 5, 14, 18, 21], dtype=torch.int32)}
    aux.armed = True
    token_nll_sum(aux_model, forward, varlen=True)  # per-document attention: the tail cannot reach the docs
    aux.armed = False
    term, weight = aux.document_sum(padded)
    torch.testing.assert_close(torch.stack([term, weight]).detach().float(), clean, rtol=0, atol=0)


def test_eval_forwards_and_dense_models_are_untouched(aux_model, small_qwen2):
    loss = with_router_aux_loss(functools.partial(token_nll_sum, varlen=True))
    batch = _packed(LENGTHS)
    aux_model.eval()
    loss(aux_model, batch)
    assert find_router_aux(aux_model).window is None and router_aux_metrics(aux_model) == {}
    aux_model.train()
    loss(aux_model, batch)
    loss(aux_model, batch)
    term, weight = find_router_aux(aux_model).window.tolist()
    assert router_aux_metrics(aux_model) == {"router_aux_loss": pytest.approx(term / weight)}
    assert router_aux_metrics(aux_model) == {}  # reset at every log step
    assert moe.apply_moe(small_qwen2) is None and find_router_aux(small_qwen2) is None


# ----------------------------------------------------------------------------- the trainer CLI


@pytest.fixture(scope="module")
def moe_data(tmp_path_factory):
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("moe")
    model_dir = save_tiny_moe_dir(root / "tiny-moe", output_router_logits=True, router_aux_loss_coef=0.01)
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared", val_fraction=0.1)
    tokenize_dataset(root / "prepared", str(model_dir), root / "tokenized", max_length=128, pack=True, num_proc=1)
    return model_dir, root / "tokenized"


@pytest.mark.parametrize(
    "targets, expert_adapters",
    [("[all-linear]", False), ("[q_proj,k_proj,v_proj,o_proj,experts]", True)],
)
def test_trainer_cli_trains_a_moe_model(moe_data, tmp_path, targets, expert_adapters):
    from safetensors import safe_open

    model_dir, data_dir = moe_data
    out = tmp_path / "run"
    overrides = [
        f"model.name_or_path={model_dir}",
        f"data={data_dir}",
        f"output_dir={out}",
        f"lora.target_modules={targets}",
        "lora.r=4",
        "lora.alpha=8",
        "lora.dropout=0",
        "optim.lr=5e-3",
        "batch.global_sequences=4",
        "batch.micro_sequences=2",
        "eval.max_sequences=8",
        "observe.progress_bar=false",
        "max_steps=3",
        "eval_every=3",
        "log_every=1",
        "seed=3",
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmft.trainer", *overrides], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3]
    aux = [r["router_aux_loss"] for r in records if r["event"] == "train"]  # logged at every log step
    assert all(math.isfinite(a) and a > 0 for a in aux), aux
    assert [r["step"] for r in records if r["event"] == "eval"] == [3]
    fast_path = next(r["fast_path"] for r in records if r["event"] == "fast_path")
    assert fast_path["moe"]["routers_frozen"] == 2 and fast_path["moe"]["router_aux_loss_coef"] == 0.01
    assert fast_path["moe"]["lora_experts"] == (2 if expert_adapters else 0)
    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert not any(".mlp.gate." in k for k in keys), "the router must carry no adapter"
    assert any(".self_attn.q_proj.lora_A" in k for k in keys)
    assert any(".mlp.experts." in k for k in keys) == expert_adapters
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert bool(config.get("target_parameters")) == expert_adapters
