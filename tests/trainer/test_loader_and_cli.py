"""Batches that do not depend on the number of ranks; CLI entry points and clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from trainer_helpers import train_in_process

from llmft.trainer.data.loader import PackedLoader, balanced_shares, shift_targets
from llmft.trainer.data.shards import IGNORE_INDEX, open_split


def _sequences_of(loader: PackedLoader, step: int) -> list[tuple]:
    batch = loader.batch(step)
    return [tuple(m.input_ids.tolist()) for m in batch.micro_batches]


@pytest.mark.parametrize("world", [2, 4])
def test_rank_shares_union_to_the_single_process_batch(tokenized_dir, world):
    single = PackedLoader(tokenized_dir, "train", global_sequences=8, micro_sequences=8, rank=0, world_size=1, seed=1)
    ranks = [
        PackedLoader(tokenized_dir, "train", global_sequences=8, micro_sequences=1, rank=r, world_size=world, seed=1)
        for r in range(world)
    ]
    single_by_sequence = [
        PackedLoader(tokenized_dir, "train", global_sequences=8, micro_sequences=1, rank=0, world_size=1, seed=1)
    ]
    for step in (1, 2, single.steps_per_epoch + 1):  # also the first step of epoch 2 (a new permutation)
        whole = single.batch(step)
        parts = [loader.batch(step) for loader in ranks]
        shares = sorted(tuple(m.input_ids.tolist()) for p in parts for m in p.micro_batches)
        singles = [loader.batch(step) for loader in single_by_sequence]
        assert shares == sorted(tuple(m.input_ids.tolist()) for m in singles[0].micro_batches)
        joined = np.concatenate([m.input_ids for m in singles[0].micro_batches])
        assert np.array_equal(joined, whole.micro_batches[0].input_ids)  # one rank keeps the block order
        targets = sum(int((m.targets != IGNORE_INDEX).sum()) for p in parts for m in p.micro_batches)
        assert all(p.global_targets == whole.global_targets == targets for p in parts)
        assert all(p.global_tokens == whole.global_tokens for p in parts)
        assert len(parts[0].micro_batches) == 8 // world
    assert single.batch(1).epoch == 0 and single.batch(single.steps_per_epoch + 1).epoch == 1
    assert _sequences_of(single, 1) != _sequences_of(single, single.steps_per_epoch + 1)


def test_rank_shares_balance_tokens_with_equal_counts():
    lengths = [1000, 950, 900, 880, 100, 110, 120, 130]  # contiguous halves: 3730 vs 460 tokens
    shares = balanced_shares(lengths, 2)
    assert [len(s) for s in shares] == [4, 4]
    assert sorted(np.concatenate(shares).tolist()) == list(range(8))
    totals = [sum(lengths[i] for i in share) for share in shares]
    assert abs(totals[0] - totals[1]) <= 100 < abs(sum(lengths[:4]) - sum(lengths[4:]))
    assert all(list(share) == sorted(share) for share in shares)  # block order kept inside a share
    assert [s.tolist() for s in balanced_shares(lengths, 1)] == [list(range(8))]
    assert [s.tolist() for s in balanced_shares(lengths, 4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_token_totals_are_balanced_on_real_batches(tokenized_dir):
    ranks = [
        PackedLoader(tokenized_dir, "train", global_sequences=8, micro_sequences=4, rank=r, world_size=2, seed=3)
        for r in range(2)
    ]
    for step in (1, 2, 3):
        indices = ranks[0].global_indices(step)[1]
        lengths = ranks[0].split.sequence_lengths(indices).tolist()
        tokens = [sum(m.num_tokens for m in loader.batch(step).micro_batches) for loader in ranks]
        assert sum(tokens) == sum(lengths)
        assert abs(tokens[0] - tokens[1]) <= max(lengths)


def test_targets_never_cross_a_document_boundary(tokenized_dir):
    loader = PackedLoader(tokenized_dir, "train", global_sequences=4, micro_sequences=2, rank=0, world_size=1, seed=0)
    micro = loader.batch(1).micro_batches[0]
    assert (micro.position_ids == 0).sum() == len(micro.doc_lengths) > 2  # several packed documents
    starts = np.flatnonzero(micro.position_ids == 0)
    assert np.all(micro.targets[starts[1:] - 1] == IGNORE_INDEX)  # last token of a doc predicts nothing
    assert micro.targets[-1] == IGNORE_INDEX
    split = open_split(tokenized_dir, "train")
    assert np.any(split.labels != IGNORE_INDEX) and np.any(split.labels == IGNORE_INDEX)
    labels, positions = np.array([5, 6, 7, 8, 9]), np.array([0, 1, 2, 0, 1])
    assert shift_targets(labels, positions).tolist() == [6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]


def test_micro_batch_tensors_carry_the_supervised_positions(tokenized_dir):
    """The fused loss reads ``supervised`` instead of searching the targets on the device (a host sync)."""
    import torch

    loader = PackedLoader(tokenized_dir, "train", global_sequences=4, micro_sequences=2, rank=0, world_size=1, seed=0)
    micro = loader.batch(1).micro_batches[0]
    tensors = micro.to_torch(torch.device("cpu"))
    flat_targets = tensors["targets"].reshape(-1)
    expected = torch.nonzero(flat_targets != IGNORE_INDEX).reshape(-1)
    assert tensors["supervised"].dtype == torch.long and 0 < tensors["supervised"].numel() < flat_targets.numel()
    assert torch.equal(tensors["supervised"], expected)


def test_uneven_split_over_ranks_is_a_data_error(tokenized_dir):
    from llmft.trainer.errors import DataError

    with pytest.raises(DataError, match="multiple of 4"):
        PackedLoader(tokenized_dir, "train", global_sequences=6, micro_sequences=1, rank=0, world_size=4, seed=0)
    with pytest.raises(DataError, match="fewer than one global batch"):
        PackedLoader(tokenized_dir, "train", global_sequences=100000, micro_sequences=1, rank=0, world_size=1, seed=0)


def test_qlora_without_cuda_fails_fast_with_a_clear_error(tiny_model_dir, tokenized_dir, tmp_path, capsys):
    code, _ = train_in_process(
        [
            f"model.name_or_path={tiny_model_dir}",
            f"data={tokenized_dir}",
            f"output_dir={tmp_path / 'q'}",
            "method=qlora",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "method=qlora" in err and "CUDA" in err and "method=lora on CPU" in err
    assert not (tmp_path / "q").exists()  # nothing was started


def test_missing_dataset_is_exit_1_naming_the_path(tiny_model_dir, tmp_path, capsys):
    code, _ = train_in_process(
        [f"model.name_or_path={tiny_model_dir}", f"data={tmp_path / 'nowhere'}", f"output_dir={tmp_path / 'o'}"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "nowhere" in err and "llmft data tokenize" in err


@pytest.mark.slow
def test_dora_run_trains_and_warns(base_overrides, tmp_path, capsys):
    code, stdout = train_in_process(base_overrides("dora", lora__use_dora="true", max_steps=1))
    assert code == 0
    assert "vLLM cannot serve DoRA" in stdout
    config = json.loads((tmp_path / "dora" / "final" / "adapter_config.json").read_text())
    assert config["use_dora"] is True


@pytest.mark.slow
def test_llmft_train_runs_the_shipped_tiny_config(repo_root, tiny_model_dir, tokenized_dir, tmp_path, capsys):
    import signal

    from llmft.cli import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = main(
            [
                "train",
                "--config",
                str(repo_root / "trainer/configs/tiny-cpu.yaml"),
                f"model.name_or_path={tiny_model_dir}",
                f"data={tokenized_dir}",
                f"output_dir={tmp_path / 'tiny'}",
                "max_steps=2",
                "eval_every=0",
                "save_every=0",
                "observe.progress_bar=false",
            ]
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 0
    assert "eval_loss=" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "tiny" / "final" / "training_manifest.json").read_text())
    assert manifest["config"]["lora"]["r"] == 8 and manifest["steps"] == 2


def test_print_config_and_torchrun_command(capsys):
    from llmft.cli import main
    from llmft.commands.train import torchrun_command

    assert main(["train", "--print-config", "model.name_or_path=m", "data=d", "lora.r=7"]) == 0
    assert "r: 7" in capsys.readouterr().out
    local = torchrun_command("2", ["lora.r=7"], env={})
    assert "--standalone" in local and local[-3:] == ["-m", "llmft.trainer", "lora.r=7"]
    assert "--nproc-per-node=2" in local
    pod = torchrun_command("8", [], env={"PET_NNODES": "2", "PET_MASTER_ADDR": "job-master-0"})
    assert "--standalone" not in pod and "--nproc-per-node=8" in pod  # torchrun reads PET_* itself


@pytest.mark.slow
def test_full_finetune_checkpoint_and_final_load_with_from_pretrained(
    base_overrides, tiny_model_dir, tokenized_dir, tmp_path
):
    from llmft.trainer.evaluate import evaluate_perplexity

    code, stdout = train_in_process(
        base_overrides(
            "full", method="full", optim__lr=1e-4, max_steps=2, save_every=1, eval_every=0, eval__max_sequences=0
        )
    )
    assert code == 0 and "full:" in stdout
    run = tmp_path / "full"
    for step_dir in (run / "checkpoints" / "step-1", run / "final"):
        assert (step_dir / "model.safetensors").is_file() and not (step_dir / "adapter_config.json").exists()
    final = evaluate_perplexity(str(run / "final"), str(tokenized_dir))
    reported = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    from float_bounds import decoder_reduction_length, rounding_bound
    from transformers import AutoConfig

    from llmft.trainer.data.shards import open_split

    # the same weights evaluated by another code path: fp32 rounding of the forward and of the mean over
    # the validation tokens (tests/float_bounds.py)
    tokens = int(open_split(tokenized_dir, "val").input_ids.shape[0])
    rel = rounding_bound(decoder_reduction_length(AutoConfig.from_pretrained(tiny_model_dir), tokens))
    assert final["eval_loss"] == pytest.approx([e for e in reported if e["event"] == "eval"][-1]["eval_loss"], rel=rel)
    first = evaluate_perplexity(str(run / "checkpoints" / "step-1"), str(tokenized_dir))
    base = evaluate_perplexity(str(tiny_model_dir), str(tokenized_dir))
    assert base["eval_loss"] > first["eval_loss"] > final["eval_loss"]


def test_trainer_defaults_the_cuda_allocator_to_expandable_segments(monkeypatch):
    from llmft.trainer.__main__ import use_expandable_segments

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # the user's choice, even empty, wins
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    use_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_garbage_collection_is_scheduled_during_training(monkeypatch):
    import gc

    from llmft.trainer.train import collect_garbage, scheduled_gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    assert gc.isenabled()
    with scheduled_gc(3):
        assert not gc.isenabled()
        for step in range(1, 8):
            collect_garbage(step, 3)
    assert gc.isenabled() and calls == [2, 1, 1]  # once before training, then steps 3 and 6
    with scheduled_gc(0):
        assert gc.isenabled()  # 0 = Python's automatic collector
        collect_garbage(3, 0)
    assert calls == [2, 1, 1]
