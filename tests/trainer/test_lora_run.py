"""A LoRA run in-process: learning, frozen weights, outputs, stdout contract, perplexity."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import numpy as np
import pytest
import torch
from trainer_helpers import KATIB_REGEX, adapter_tensors, events

from llmft.trainer.config_checks import validate
from llmft.trainer.config_load import load_config
from llmft.trainer.train import Trainer

pytestmark = pytest.mark.slow  # every test reads one tiny LoRA training run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, tokenized_dir):
    """6 steps, eval and checkpoint every 3; returns (cfg, output dir, captured stdout, param snapshots)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            f"data={tokenized_dir}",
            f"output_dir={out}",
            "lora.r=4",
            "lora.alpha=8",
            "lora.dropout=0.0",
            "optim.lr=5e-3",
            "schedule.warmup_steps=1",
            "batch.global_sequences=4",
            "batch.micro_sequences=2",
            "observe.progress_bar=false",
            "max_steps=6",
            "eval_every=3",
            "save_every=3",
            "log_every=1",
            "seed=3",
            "keep_last=1",
        ],
    )
    previous = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(cfg, validate(cfg))
    import contextlib
    import io

    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            trainer.build()
            model = trainer.engine.module
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            trainer.train()
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        trainer.close(0)
        assert signal.getsignal(signal.SIGTERM) == previous  # close() gives the handlers back
    return cfg, out, stdout.getvalue(), before, after, trainable


def test_loss_falls_and_only_adapter_weights_change(lora_run):
    cfg, out, _, before, after, trainable = lora_run
    losses = [e["loss"] for e in events(out, "train")]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.05, losses
    assert trainable and all("lora_" in n for n in trainable)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in trainable), f"{name}: changed={changed}, trainable={name in trainable}"


def test_outputs_manifest_checkpoints_and_tensorboard(lora_run, tiny_model_dir, tokenized_dir):
    cfg, out, _, _, after, _ = lora_run
    final = out / "final"
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_manifest.json",
        "COMPLETE",
    ):
        assert (final / name).is_file(), name
    assert "im_start" in (final / "chat_template.jinja").read_text()
    manifest = json.loads((final / "training_manifest.json").read_text())
    data_key = json.loads((tokenized_dir / "manifest.json").read_text())["cache_key"]
    assert manifest["dataset"]["cache_key"] == data_key
    assert manifest["base_model"]["name_or_path"] == str(tiny_model_dir)
    assert len(manifest["base_model"]["content_hash"]) == 64
    assert manifest["config"]["lora"]["r"] == 4 and manifest["steps"] == 6
    assert manifest["tokens_seen"] > 0 and manifest["wall_time_s"] > 0
    assert manifest["best"]["step"] in (3, 6) and manifest["final_metrics"]["eval_loss"] > 0
    # keep_last=1 plus the best: step-6 always, step-3 only if it was the best
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    expected = {"step-6"} | ({"step-3"} if manifest["best"]["step"] == 3 else set())
    assert set(kept) == expected
    umask = os.umask(0)
    os.umask(umask)
    for weights in (final / "adapter_model.safetensors", out / "checkpoints/step-6/adapter_model.safetensors"):
        assert weights.stat().st_mode & 0o777 == 0o666 & ~umask, weights  # safetensors writes 0600
    final_adapter = adapter_tensors(final)
    assert torch.equal(
        final_adapter[next(iter(final_adapter))], adapter_tensors(out / "checkpoints/step-6")[next(iter(final_adapter))]
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("eval/eval_loss")] == [3, 6]


def test_stdout_has_katib_lines_and_summary(lora_run):
    _, out, stdout, _, _, _ = lora_run
    eval_events = events(out, "eval")
    lines = stdout.splitlines()
    loss_lines = [line for line in lines if re.match(r"\S+Z eval_loss=", line)]  # <RFC 3339 time> name=value
    ppl_lines = [line for line in lines if re.match(r"\S+Z perplexity=", line)]
    assert len(loss_lines) == len(ppl_lines) == len(eval_events) == 2
    for line, event in zip(loss_lines, eval_events, strict=True):
        ((name, value, *_),) = re.findall(KATIB_REGEX, line)
        # printed with 6 decimals (llmft/trainer/evaluate.py): off by at most half the last digit, 5e-7
        assert name == "eval_loss" and float(value) == pytest.approx(event["eval_loss"], abs=5e-7 + 1e-12)
    for line in ppl_lines:
        ((name, value, *_),) = re.findall(KATIB_REGEX, line)
        assert name == "perplexity" and float(value) > 1
    for line in lines:  # every name=value pair anywhere on stdout has a numeric value
        for name, value, *_ in re.findall(KATIB_REGEX, line):
            assert value not in ("", "+", "-"), f"non-numeric {name}= in {line!r}"
    assert "llmft train: summary" in stdout and "final eval loss" in stdout


def test_summary_tells_steady_state_speed_and_fast_path(lora_run):
    """tokens/s and MFU of the steady state (after the first two steps, without eval and checkpoint
    time), model load and warm-up on their own lines; the same numbers in training_manifest.json and
    metrics.jsonl's final event. The resolved fast path is recorded in both."""
    _, out, stdout, _, _, _ = lora_run
    speed = json.loads((out / "final" / "training_manifest.json").read_text())["speed"]
    (final,) = events(out, "final")
    for key, value in speed.items():
        if isinstance(value, float):
            assert final[key] == pytest.approx(value, rel=1e-12), key
    seen = {e["step"]: e["tokens_seen"] for e in events(out, "train")}
    assert speed["warmup_steps"] == 2 and speed["steady_steps"] == 4 and speed["steady_state"] is True
    assert speed["tokens_per_s"] == pytest.approx((seen[6] - seen[2]) / speed["steady_s"], rel=1e-12)
    assert speed["load_s"] > 0 and speed["warmup_s"] > 0 and speed["eval_and_save_s"] > 0
    manifest = json.loads((out / "final" / "training_manifest.json").read_text())
    assert f"{speed['tokens_per_s']:,.0f} (steady state: 4 steps" in stdout
    assert "model load" in stdout and "warm-up" in stdout and "MFU" in stdout
    (fast_path,) = events(out, "fast_path")
    assert fast_path["step"] == 0 and fast_path["fast_path"] == manifest["fast_path"]


def test_perplexity_matches_independent_reference_loop(lora_run, tiny_model_dir, tokenized_dir):
    """exp(mean token NLL), computed document by document without packing, equals what the
    trainer reported and what evaluate_perplexity returns."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmft.trainer.data.shards import open_split
    from llmft.trainer.evaluate import evaluate_perplexity

    _, out, _, _, _, _ = lora_run
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, out / "final").eval()
    val = open_split(tokenized_dir, "val")
    total, count = 0.0, 0
    with torch.no_grad():
        for d in range(len(val.doc_offsets) - 1):
            a, b = int(val.doc_offsets[d]), int(val.doc_offsets[d + 1])
            ids = torch.from_numpy(np.asarray(val.input_ids[a:b], dtype=np.int64))[None]
            labels = torch.from_numpy(np.asarray(val.labels[a:b], dtype=np.int64))
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
            target = labels[1:]
            mask = target != -100
            total += -logp[mask.nonzero()[:, 0], target[mask]].sum().item()
            count += int(mask.sum())
    reference = total / count
    reported = events(out, "eval")[-1]
    assert reported["tokens"] == count
    # the same fp32 forward, packed vs one document at a time: its rounding (tests/float_bounds.py);
    # exp() turns an absolute loss error e into a relative perplexity error e (loss ~7: rel x 7)
    from float_bounds import decoder_reduction_length, rounding_bound

    rel = rounding_bound(decoder_reduction_length(model.config, int(val.input_ids.shape[0])))
    assert reported["eval_loss"] == pytest.approx(reference, rel=rel)
    assert reported["perplexity"] == pytest.approx(math.exp(reference), rel=rel * reference)
    direct = evaluate_perplexity(str(tiny_model_dir), str(tokenized_dir), adapter_path=str(out / "final"))
    assert direct["eval_loss"] == pytest.approx(reference, rel=rel) and direct["tokens"] == count
    base = evaluate_perplexity(str(tiny_model_dir), str(tokenized_dir))
    assert base["eval_loss"] > reference  # training helped on held-out data


def test_fast_path_kernels_train_the_same_run_on_cpu(base_overrides):
    """kernels.fused_loss + fused_lora (+ grouped q/k/v, gate/up by default) through the whole trainer:
    same per-step losses and the same adapter as the plain path (CUDA-only pieces are not on this path)."""
    from trainer_helpers import train_in_process

    plain = base_overrides("plain")
    fast = base_overrides("fast", kernels__fused_loss="true", kernels__fused_lora="true")
    assert train_in_process(plain)[0] == 0
    code, stdout = train_in_process(fast)
    assert code == 0, stdout
    assert "fast path: on: fused_loss, fused_lora (28 modules), grouped_lora (8 groups); off:" in stdout  # 4 x 2
    out_plain, out_fast = (o.split("=", 1)[1] for o in (plain[2], fast[2]))
    loss_plain = [e["loss"] for e in events(out_plain, "train")]
    loss_fast = [e["loss"] for e in events(out_fast, "train")]
    assert len(loss_fast) == 4
    # Tolerances from the arithmetic (tests/float_bounds.py): fp32 rounding over the reductions of one
    # step (the model's inner dimensions + the step's tokens); the adapters through Adam, whose per-element
    # normalization lets a gradient that cancels to within rounding move either way (isolated elements).
    from float_bounds import assert_adam_runs_agree, decoder_reduction_length, rounding_bound
    from transformers import AutoConfig

    steps = events(out_plain, "train")
    n = decoder_reduction_length(AutoConfig.from_pretrained(plain[0].split("=", 1)[1]), steps[0]["tokens_seen"])
    np.testing.assert_allclose(loss_fast, loss_plain, rtol=rounding_bound(n))
    a, b = (adapter_tensors(f"{o}/final") for o in (out_plain, out_fast))
    assert_adam_runs_agree(b, a, [e["lr"] for e in steps], n)  # a wrong block moves every element by ~lr


def test_one_base_load_scores_the_base_and_every_adapter_exactly_as_separate_loads(
    lora_run, tiny_model_dir, tokenized_dir, tmp_path, base_loads
):
    """The evaluate step's evaluator reads the base once; each adapter is applied, scored and removed,
    so the base scored after two adapters is the base scored first, and every score equals a fresh
    load's to the bit (the same float32 operations on the same weights)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmft.trainer.evaluate import PerplexityEvaluator, evaluate_perplexity

    _, out, _, _, _, _ = lora_run
    doubled = shutil.copytree(out / "final", tmp_path / "doubled")
    tensors = load_file(doubled / "adapter_model.safetensors")
    save_file({k: v * 2 if "lora_B" in k else v for k, v in tensors.items()}, doubled / "adapter_model.safetensors")
    model, data = str(tiny_model_dir), str(tokenized_dir)
    evaluator = PerplexityEvaluator(dtype="float32")
    reused = [
        evaluator(model, data),
        evaluator(model, data, adapter_path=str(out / "final")),
        evaluator(model, data, adapter_path=str(doubled)),
        evaluator(model, data),
    ]
    assert base_loads == [model]
    fresh = [
        evaluate_perplexity(model, data, dtype="float32", adapter_path=adapter)
        for adapter in (None, str(out / "final"), str(doubled), None)
    ]
    assert reused == fresh
    assert len({r["eval_loss"] for r in reused}) == 3  # base, adapter, the other adapter: three models


def test_an_adapter_that_fails_to_load_leaves_no_half_wrapped_base_behind(
    lora_run, tiny_model_dir, tokenized_dir, tmp_path, base_loads
):
    """PEFT injects LoRA layers into the base before it reads the weights; when the weights do not fit
    the evaluator forgets that base, so the next score reads a clean one. The adapter is whole as a file
    (the damaged-file check before any load passes it; that check has its own tests in
    tests/trainer/test_damaged_base.py): only its tensors' shapes are wrong, so the failure comes from
    PEFT's load, after the injection."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from llmft.trainer.evaluate import PerplexityEvaluator
    from llmft.trainer.model_dir import check_model_files

    _, out, _, _, _, _ = lora_run
    broken = shutil.copytree(out / "final", tmp_path / "broken")
    weights = broken / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({name: torch.zeros(t.shape[0] + 1, *t.shape[1:]) for name, t in tensors.items()}, str(weights))
    check_model_files(broken, what="adapter")  # whole as a file: the load itself must fail
    model, data = str(tiny_model_dir), str(tokenized_dir)
    evaluator = PerplexityEvaluator(dtype="float32")
    base = evaluator(model, data)
    with pytest.raises(RuntimeError, match="size mismatch"):
        evaluator(model, data, adapter_path=str(broken))
    assert evaluator(model, data) == base and base_loads == [model, model]
