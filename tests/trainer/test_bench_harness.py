"""The GPU benchmark's data plan, checked on CPU before any device time is spent."""
from __future__ import annotations

import json
from argparse import Namespace

import numpy as np

from benchmarks import train_bench
from benchmarks.gpu import common
from benchmarks.gpu.arm_project import write_dataset
from trainer.data.loader import PackedLoader


def test_project_arm_trains_each_step_on_the_benchmarks_samples(tmp_path):
    per_gpu, pack, gpus, steps = 64, 8, 2, 3
    samples = common.make_samples(per_gpu * gpus * steps, "short", vocab=1000)
    data = write_dataset(samples, pack, tmp_path / "data")
    ranks = [PackedLoader(data, "train", global_sequences=gpus * per_gpu // pack, micro_sequences=per_gpu // pack,
                          rank=r, world_size=gpus, seed=42) for r in range(gpus)]
    for step in range(1, steps + 1):
        batches = [loader.batch(step) for loader in ranks]
        got = sorted(tuple(doc) for b in batches for m in b.micro_batches
                     for doc in np.split(m.input_ids, np.cumsum(m.doc_lengths)[:-1]))
        lo = (step - 1) * per_gpu * gpus
        want = sorted(tuple(ids) for ids in samples.input_ids[lo : lo + per_gpu * gpus])
        assert got == want
        tokens = [sum(m.num_tokens for m in b.micro_batches) for b in batches]
        assert abs(tokens[0] - tokens[1]) / sum(tokens) < 0.05  # dealt by token count
        assert all(len(b.micro_batches) == 1 for b in batches)


def test_results_file_is_named_date_device(tmp_path):
    args = Namespace(out=str(tmp_path), merge_from="", profile="short", samples_per_step=64)
    arm = {"job": "project:qwen2.5-1.5b:lora", "label": "", "arm": "project", "model": "qwen2.5-1.5b",
           "method": "lora", "tokens_per_s": 1.0, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11"}
    train_bench._write_outputs(args, {"matmul_tflops": 780.0, "device": "NVIDIA H100 80GB HBM3"}, [arm])
    (result,) = tmp_path.glob("*.json")
    assert result.name.endswith("-h100.json")
    payload = json.loads(result.read_text())
    assert {"device", "date", "versions", "matmul_tflops", "arms"} <= set(payload)
    assert payload["arms"][0]["tokens_per_s"] == 1.0 and result.with_suffix(".md").is_file()
