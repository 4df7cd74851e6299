"""The GPU benchmark's data plan, checked on CPU before any device time is spent."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
import torch

from llmft.benchmarks import train_bench
from llmft.benchmarks.gpu import common
from llmft.benchmarks.gpu.arm_project import write_dataset
from llmft.trainer.data.loader import PackedLoader


def test_project_arm_trains_each_step_on_the_benchmarks_samples(tmp_path):
    per_gpu, pack, gpus, steps = 64, 8, 2, 3
    samples = common.make_samples(per_gpu * gpus * steps, "short", vocab=1000)
    data = write_dataset(samples, pack, tmp_path / "data")
    ranks = [
        PackedLoader(
            data,
            "train",
            global_sequences=gpus * per_gpu // pack,
            micro_sequences=per_gpu // pack,
            rank=r,
            world_size=gpus,
            seed=42,
        )
        for r in range(gpus)
    ]
    for step in range(1, steps + 1):
        batches = [loader.batch(step) for loader in ranks]
        got = sorted(
            tuple(doc)
            for b in batches
            for m in b.micro_batches
            for doc in np.split(m.input_ids, np.cumsum(m.doc_lengths)[:-1])
        )
        lo = (step - 1) * per_gpu * gpus
        want = sorted(tuple(ids) for ids in samples.input_ids[lo : lo + per_gpu * gpus])
        assert got == want
        tokens = [sum(m.num_tokens for m in b.micro_batches) for b in batches]
        assert abs(tokens[0] - tokens[1]) / sum(tokens) < 0.05  # dealt by token count
        assert all(len(b.micro_batches) == 1 for b in batches)


def test_results_file_is_named_date_device(tmp_path):
    args = Namespace(out=str(tmp_path), merge_from="", profile="short", samples_per_step=64)
    arm = {
        "job": "project:qwen2.5-1.5b:lora",
        "label": "",
        "arm": "project",
        "model": "qwen2.5-1.5b",
        "method": "lora",
        "tokens_per_s": 1.0,
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11",
    }
    train_bench._write_outputs(args, {"matmul_tflops": 780.0, "device": "NVIDIA H100 80GB HBM3"}, [arm])
    (result,) = tmp_path.glob("*.json")
    assert result.name.endswith("-h100.json")
    payload = json.loads(result.read_text())
    assert {"device", "date", "versions", "matmul_tflops", "arms"} <= set(payload)
    assert payload["arms"][0]["tokens_per_s"] == 1.0 and result.with_suffix(".md").is_file()


def test_trainer_logged_mfu_is_time_weighted_like_the_benchmarks(tmp_path, monkeypatch):
    from llmft.benchmarks.gpu import arm_project
    from llmft.trainer import flops

    monkeypatch.setattr(common, "device_info", lambda: {"device": "NVIDIA H100 80GB HBM3"})
    steps, per_step = 8, 4
    samples = common.make_samples(steps * per_step, "short", vocab=1000)
    shape = flops.shape_from_config(common.hf_config("qwen2.5-0.5b"))
    peak = flops.peak_flops("NVIDIA H100 80GB HBM3")
    now, lines = 0.0, []
    for step in range(1, steps + 1):
        lengths = samples.lengths[(step - 1) * per_step : step * per_step]
        dt = 2.0 if step == 6 else 0.1  # one stalled step
        now += dt
        lines.append(
            json.dumps(
                {
                    "event": "train",
                    "step": step,
                    "time": now,
                    "loss": 1.0,
                    "tokens_per_s": int(lengths.sum()) / dt,
                    "mfu": flops.step_flops(shape, "lora", lengths) / dt / peak,
                }
            )
        )
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    args = Namespace(samples_per_step=per_step, nproc=1, warmup=2, method="lora")
    result = arm_project.summarize_metrics(tmp_path / "m.jsonl", samples, args, shape)
    assert abs(result["logged_vs_bench_tokens_per_s"]) < 1e-9
    assert abs(result["logged_vs_bench_mfu"]) < 1e-9  # a plain mean of per-step MFU would be ~40% off
    assert result["step_s_p90"] > result["step_s_p50"] == pytest.approx(0.1)


def test_peer_variant_builds_the_flex_block_mask_uncompiled(monkeypatch):
    from transformers import masking_utils

    from llmft.benchmarks.gpu.arm_hf import build_block_masks_eagerly

    seen = []
    monkeypatch.setattr(masking_utils, "create_block_mask", lambda *a, **k: seen.append(k) or "mask")
    build_block_masks_eagerly()
    assert masking_utils.create_block_mask(mask_mod=None, B=1, _compile=True) == "mask"
    assert seen == [{"mask_mod": None, "B": 1, "_compile": False}]
    args = Namespace(profile="short", samples_per_step=64, naive_steps=6, steps=12, warmup=4, extra="")
    command = train_bench._job_command("peer-eagermask:qwen2.5-1.5b:lora", args, "/tmp/x.json")
    assert command[command.index("--arm") + 1] == "peer" and "--block-mask" in command
    assert "--block-mask" not in train_bench._job_command("peer:qwen2.5-1.5b:lora", args, "/tmp/x.json")


def test_profiler_gpu_busy_time_is_the_union_of_kernel_intervals():
    """Overlapping kernels count once; CPU events and gaps do not count (the gap is GPU idle time)."""
    from types import SimpleNamespace as NS

    from llmft.benchmarks.gpu.trainer_entry import gpu_busy_seconds

    def event(kind, start_us, end_us):
        return NS(device_type=NS(name=kind), time_range=NS(start=start_us, end=end_us))

    events = [
        event("CUDA", 0, 100),
        event("CUDA", 50, 150),
        event("CPU", 0, 10_000),
        event("CUDA", 1_000, 1_200),
        event("CUDA", 1_200, 1_300),
        event("CUDA", 5, 5),
    ]
    assert gpu_busy_seconds(NS(events=lambda: events)) == pytest.approx(450e-6)
    assert gpu_busy_seconds(NS(events=lambda: [])) == 0.0


def test_product_arm_is_llmft_train_with_a_shipped_config_and_only_model_data_steps_output(tmp_path):
    """The product row runs exactly what a user runs; --extra overrides never reach it."""
    import sys
    from pathlib import Path

    from llmft.benchmarks.gpu import arm_product
    from llmft.cli import build_group_parser
    from llmft.trainer.config_load import load_config

    repo = Path(__file__).resolve().parents[2]
    args = Namespace(profile="short", samples_per_step=64, naive_steps=6, steps=30, warmup=4, extra="--micro 8")
    job = train_bench._job_command("project-product:qwen2.5-1.5b:lora", args, tmp_path / "x.json")
    assert job[1:3] == ["-m", "llmft.benchmarks.gpu.arm_product"] and "--micro" not in job
    assert job[job.index("--model") + 1] == "qwen2.5-1.5b" and job[job.index("--steps") + 1] == "30"
    shipped = {p.resolve() for p in (repo / "trainer" / "configs").glob("*.yaml")}
    speed_keys = ("kernels.", "batch.micro_sequences", "model.attn_implementation", "model.gradient_checkpointing")
    for (model, method), (relative, _max_length) in arm_product.PRODUCT_CONFIGS.items():
        config, _ = arm_product.product_config(model, method)
        assert config.resolve() in shipped, relative
        cmd = arm_product.product_command(relative, tmp_path / "m", tmp_path / "d", tmp_path / "o", 30)
        assert cmd[:6] == [sys.executable, "-m", "llmft", "train", "--config", relative]
        overrides = cmd[6:]
        assert [o.split("=", 1)[0] for o in overrides] == list(arm_product.PRODUCT_KEYS)
        assert not any(o.startswith(speed_keys) for o in overrides)
        parsed = build_group_parser("train").parse_args(cmd[4:])  # what `llmft train` itself parses
        assert parsed.config == relative and parsed.overrides == overrides and parsed.nproc is None
        cfg = load_config(str(config), overrides)
        assert (cfg.method, cfg.max_steps, cfg.data) == (method, 30, str(tmp_path / "d"))
        assert cfg.kernels.fused_loss == "auto" and cfg.batch.micro_sequences == "auto"  # the fast path by default


def test_product_dataset_is_packed_like_llmft_data_tokenize(tmp_path):
    """Every sample that fits once (longer ones dropped, tokenize's default), in sequences of at most
    max_length filled by best-fit packing; the trainer's loader reads it and the arm counts each step's
    tokens from it."""
    from llmft.benchmarks.gpu import arm_product
    from llmft.trainer.config_load import load_config
    from llmft.trainer.data.shards import open_split

    samples = arm_product.samples_for(steps=3, global_sequences=4, max_length=1024, profile="short", vocab=500)
    data = arm_product.write_product_dataset(samples, 1024, tmp_path / "data")
    train = open_split(data, "train")
    lengths = train.sequence_lengths(np.arange(len(train)))
    fitting = samples.lengths <= 1024
    assert 0 < (~fitting).sum() and lengths.max() <= 1024 and lengths.sum() == samples.lengths[fitting].sum()
    assert lengths.sum() / (1024 * len(train)) > 0.95  # best-fit fills the sequences
    stored = sorted(
        tuple(np.asarray(train.input_ids[int(a) : int(b)]))
        for a, b in zip(train.doc_offsets[:-1], train.doc_offsets[1:], strict=True)
    )
    assert stored == sorted(tuple(ids) for ids, fits in zip(samples.input_ids, fitting, strict=True) if fits)
    cfg = load_config(None, ["model.name_or_path=m", f"data={data}", "batch.global_sequences=4", "seed=7"])
    docs = arm_product.step_documents(data, cfg, 3)
    assert sorted(docs) == [1, 2, 3] and all(0 < d.sum() <= 4 * 1024 for d in docs.values())


def test_product_arm_takes_only_nproc_from_extra_as_llmft_train_nproc(tmp_path):
    """A multi-GPU product row: the launcher's --nproc reaches `llmft train`; no other --extra word does."""
    from llmft.benchmarks.gpu import arm_product
    from llmft.cli import build_group_parser

    args = Namespace(
        profile="short", samples_per_step=64, naive_steps=6, steps=12, warmup=10, extra="--micro 8 --nproc=2"
    )
    job = train_bench._job_command("project-product:qwen3-30b-a3b:qlora", args, tmp_path / "x.json")
    assert job[job.index("--nproc") + 1] == "2" and "--micro" not in job
    relative, _ = arm_product.PRODUCT_CONFIGS[("qwen3-30b-a3b", "qlora")]
    cmd = arm_product.product_command(relative, tmp_path / "m", tmp_path / "d", tmp_path / "o", 12, nproc=2)
    parsed = build_group_parser("train").parse_args(cmd[4:])
    assert parsed.nproc == "2" and parsed.config == relative
    assert [o.split("=", 1)[0] for o in parsed.overrides] == list(arm_product.PRODUCT_KEYS)


def test_benchmark_mfu_is_the_trainers_one_formula(tmp_path, monkeypatch):
    """Issue 26: every arm's MFU is llmft/trainer/flops.py mfu(), not a formula of its own."""
    from llmft.benchmarks.gpu import arm_product
    from llmft.trainer import flops

    calls = []
    monkeypatch.setattr(flops, "mfu", lambda work, seconds, peak: calls.append((work, seconds, peak)) or 0.123)
    shape = flops.shape_from_config(common.hf_config("qwen2.5-0.5b"))
    docs = {s: np.array([100 * s, 50]) for s in range(1, 13)}
    records = [{"event": "train", "step": s, "time": float(s), "loss": 1.0} for s in (10, 12)]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert arm_product.summarize(tmp_path / "m.jsonl", docs, shape, "lora", warmup=10, peak=2e15)["mfu"] == 0.123
    assert calls[-1][1:] == (2.0, 2e15)
    timer = common.StepTimer()
    timer.times, timer.tokens, timer.supervised = [1.0, 0.5, 0.5], [10, 10, 10], [5, 5, 5]
    assert common.summarize(timer, 1, [1e12, 1e12, 1e12], 1e15)["mfu"] == 0.123
    assert calls[-1] == (2e12, 1.0, 1e15)


def test_product_throughput_comes_from_record_times_and_the_loaders_tokens(tmp_path):
    from llmft.benchmarks.gpu import arm_product
    from llmft.trainer import flops

    shape = flops.shape_from_config(common.hf_config("qwen2.5-0.5b"))
    docs = {s: np.array([100 * s, 50]) for s in range(1, 31)}
    records = [{"event": "fast_path", "fast_path": {"compile": {"on": True, "why": "auto"}}}]
    now = 5.0
    for step in (10, 20, 30):
        now += 2.0 if step > 10 else 30.0  # the first window holds compilation
        records.append({"event": "train", "step": step, "time": now, "loss": 1.0, "peak_mem_gib": 3.0})
    records.append({"event": "final", "tokens_per_s": 1.01 * sum(d.sum() for s, d in docs.items() if s > 10) / 4.0})
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    result = arm_product.summarize(tmp_path / "m.jsonl", docs, shape, "lora", warmup=4, peak=989e12)
    tokens = sum(int(docs[s].sum()) for s in range(11, 31))
    assert result["steps_timed"] == 20 and result["tokens_per_s"] == pytest.approx(tokens / 4.0)
    assert result["logged_vs_bench_tokens_per_s"] == pytest.approx(0.01)
    assert result["step_s_p50"] == pytest.approx(0.2) and result["fast_path"]["compile"]["on"]
    too_short = arm_product.summarize(tmp_path / "m.jsonl", docs, shape, "lora", warmup=25, peak=None)
    assert "too few train records" in too_short["error"]


@pytest.mark.slow
def test_an_arm_cut_by_its_timeout_takes_its_trainer_with_it(tmp_path, monkeypatch):
    """The arm starts the trainer as a child; a timeout must end both, or the trainer keeps the GPU
    memory under the next arm (seen on an H200: 103 GiB held by an orphaned trainer)."""
    import os
    import sys
    import time

    pid_file = tmp_path / "trainer.pid"
    arm = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    monkeypatch.setattr(train_bench, "_job_command", lambda job, args, json_out: [sys.executable, "-c", arm])
    monkeypatch.setattr(train_bench, "MIN_ARM_TIMEOUT_S", 5.0)
    args = Namespace(label="", arm_timeout_s=5.0)
    started = time.monotonic()
    result = train_bench._run_job("project:tiny:lora", args, tmp_path, remaining=3.0)
    assert result["returncode"] == "timeout" and time.monotonic() - started < 60
    assert pid_file.is_file(), "the arm started its trainer before the timeout"
    trainer = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            os.kill(trainer, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{trainer}/stat").read().split()[2] == "Z":
            return
        time.sleep(0.1)
    pytest.fail(f"the arm's child process {trainer} outlived the arm's timeout")


def test_benchmark_trainer_writes_no_checkpoint_or_final_when_asked(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from llmft.benchmarks.gpu import trainer_entry
    from llmft.trainer.train import Trainer

    for name in ("_save", "_write_final"):  # restored after the test
        monkeypatch.setattr(Trainer, name, getattr(Trainer, name))
    trainer_entry.skip_saves()
    run = SimpleNamespace(cfg=SimpleNamespace(output_dir=str(tmp_path / "run")))
    assert Trainer._save(run, 3, 1.0, False) is None
    final = Trainer._write_final(run)
    assert final.parent == tmp_path / "run" and not final.exists()
    assert not (tmp_path / "run").exists()  # nothing written at all


def test_an_arm_removes_only_its_own_run_folder(tmp_path):
    runs = tmp_path / "runs"
    own = runs / "product-qwen2.5-1.5b-full-1"
    (own / "checkpoints" / "step-30").mkdir(parents=True)
    (own / "metrics.jsonl").write_text("{}")
    elsewhere = tmp_path / "models" / "llama-3-8b"
    elsewhere.mkdir(parents=True)
    linked = runs / "linked"
    linked.symlink_to(elsewhere)
    common.remove_run_dir(own)
    common.remove_run_dir(elsewhere)  # not under a runs/ folder
    common.remove_run_dir(linked)  # a link: what it points to is not this program's
    assert not own.exists()
    assert elsewhere.is_dir() and linked.is_symlink()


def test_full_fine_tuning_product_rows_write_no_checkpoint_and_run_the_same_trainer_arguments(tmp_path):
    """Issue 37: a full fine-tuning product row (the 8B ZeRO-3 config: a checkpoint over 100 GB) runs the
    trainer with exactly the arguments `llmft train` passes it, through the wrapper that skips saves."""
    import sys

    from llmft.benchmarks.gpu import arm_product
    from llmft.commands.train import torchrun_command

    relative, _ = arm_product.PRODUCT_CONFIGS[("llama-3-8b", "full")]
    user = arm_product.product_command(relative, tmp_path / "m", tmp_path / "d", tmp_path / "o", 30, nproc=2)
    bench = arm_product.product_command(
        relative, tmp_path / "m", tmp_path / "d", tmp_path / "o", 30, nproc=2, saves=False
    )
    trainer_args = user[user.index("--config") :]
    assert bench[bench.index("--config") :] == trainer_args
    launcher = torchrun_command("2", trainer_args, env={})  # what `llmft train --nproc 2` starts
    assert bench[: bench.index("-m", 3)] == launcher[: launcher.index("-m", 3)]
    assert bench[bench.index("-m", 3) + 1] == "llmft.benchmarks.gpu.trainer_entry"
    one = arm_product.product_command(relative, tmp_path / "m", tmp_path / "d", tmp_path / "o", 30, saves=False)
    assert one[:3] == [sys.executable, "-m", "llmft.benchmarks.gpu.trainer_entry"]


def test_each_row_names_its_kernel_path_and_device():
    """Issue 37 item 3: one kernel-path line per row, from the run's fast_path record."""
    fast = {
        "attention": {"on": True, "value": "llmft_varlen", "why": "auto"},
        "fused_loss": {"on": True, "why": "auto"},
        "fused_lora": {"on": True, "why": "auto", "modules": 196, "kept": {}},
        "grouped_lora": {"on": True, "why": "auto", "groups": 56, "ungrouped": {}},
        "compile": {"on": False, "why": "DeepSpeed ZeRO-3 gathers weights in module hooks"},
        "gradient_checkpointing": {"on": True, "why": "auto", "layers": 32},
        "micro_batch": {"sequences": 4, "why": "auto"},
    }
    line = common.kernel_path(fast, 0.05)
    assert "attention llmft_varlen" in line and "fused_lora 196 modules" in line and "grouped_lora 56 groups" in line
    assert "no compile (DeepSpeed ZeRO-3" in line and "gradient_checkpointing 32 layers" in line
    assert "micro 4 seq" in line and "dropout 0.05 in-kernel" in line
    peft = common.kernel_path({**fast, "fused_lora": {"on": False, "why": "set false"}}, 0.05)
    assert "PEFT nn.Dropout" in peft
    assert common.kernel_path(None) == "no fast_path record"
    arm = {"arm": "project-product", "model": "llama-3-8b", "method": "full", "label": "z", "tokens_per_s": 1.0}
    arm.update(device="NVIDIA H100 80GB HBM3", kernel_path=line, load_peak_gib=56.4)
    table = train_bench.markdown_table(
        {"device": "d", "date": "x", "versions": {}, "profile": "short", "arms": [arm], "matmul_tflops": None}
    )
    assert "| NVIDIA H100 80GB HBM3 |" in table
    assert f"- project-product llama-3-8b full z: {line}; load peak 56.4 GiB" in table


def test_fp8_benchmark_checkpoint_loads_as_the_seeds_fp8_base(tmp_path):
    """The 30B benchmark checkpoint's writer (FP8, shard per layer, experts one by one) on a tiny Qwen3-MoE:
    transformers loads every tensor of it (none missing, none unexpected), the routers, norms, embeddings and
    lm_head as written in bf16, the attention and experts within FP8's rounding of a normal(0, std) init."""
    from moe_model import tiny_moe_config
    from transformers import AutoModelForCausalLM

    from llmft.benchmarks.gpu.fp8_checkpoint import write_fp8_model_dir
    from llmft.trainer.fp8 import load_base

    config = tiny_moe_config(hidden_size=256, moe_intermediate_size=128, head_dim=128, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=512)  # fmt: skip
    path = write_fp8_model_dir("tiny", tmp_path, device="cpu", config=config)
    assert (path / "model.safetensors.index.json").is_file() and not (tmp_path / "tiny.partial").exists()
    model, base = load_base(str(path), None, "lora", {"dtype": torch.float32})
    assert base.format == "FP8 (fine-grained, block [128, 128])"
    _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    layer = model.model.layers[1]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(256))
    experts = layer.mlp.experts.gate_up_proj
    assert experts.shape == (4, 256, 256) and 0.015 < experts.std().item() < 0.025
    assert layer.mlp.gate.weight.dtype == torch.float32 and 0.015 < layer.mlp.gate.weight.std().item() < 0.025
    assert write_fp8_model_dir("tiny", tmp_path, device="cpu", config=config) == path  # written once
