"""A corrupt newest checkpoint is named and never resumed from (issue 35 item 5).

The checkpoints here are built by hand with the trainer's own file names and writers (safetensors,
torch.save, JSON): no model is loaded. docs/failure-modes.md ("Corrupt checkpoints") has a row per case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmft.trainer import checkpoint as ckpt
from llmft.trainer.checkpoint_check import checkpoint_problem
from llmft.trainer.errors import ConfigError


def _checkpoint(output_dir: Path, step: int) -> Path:
    """A committed step-<step> as the trainer writes one (LoRA, DDP)."""
    path = ckpt.checkpoints_root(output_dir) / f"step-{step}"
    (path / "rng").mkdir(parents=True)
    save_file(
        {"base.lora_A.weight": torch.ones(4, 8), "base.lora_B.weight": torch.zeros(8, 4)},
        str(path / "adapter_model.safetensors"),
    )
    torch.save(
        {"state": {0: {"exp_avg": torch.ones(4, 8)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        path / "optimizer.pt",
    )
    (path / "scheduler.json").write_text(json.dumps({"last_epoch": step}))
    (path / "rng" / "rank-0.json").write_text(json.dumps(ckpt.rng_state()))
    (path / "train_config.json").write_text(json.dumps({"lora": {"r": 4}}))
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "tokens_seen": 10 * step, "run_id": "r1"}))
    (path / "COMPLETE").write_text("ok\n")
    return path


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _state(step: int):
    def tamper(path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        (path / "trainer_state.json").write_text(json.dumps({**state, "step": step}))

    return tamper


CORRUPTIONS = {
    "truncated optimizer.pt": ("optimizer.pt", lambda p: _truncate(p / "optimizer.pt"), "truncated"),
    "truncated adapter": (
        "adapter_model.safetensors",
        lambda p: _truncate(p / "adapter_model.safetensors"),
        "truncated (its tensors end at byte",
    ),
    "state not JSON": (
        "trainer_state.json",
        lambda p: (p / "trainer_state.json").write_text('{"step": '),
        "not valid JSON",
    ),
    "state not an object": ("trainer_state.json", lambda p: (p / "trainer_state.json").write_text("[2]"), "JSON list"),
    "state step tampered": ("trainer_state.json", _state("two"), "step is 'two', not a count"),
    "state of another step": ("trainer_state.json", _state(3), "step 3 inside step-2"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_auto_resume_passes_over_a_corrupt_newest_checkpoint_naming_the_file(tmp_path, case):
    bad_file, corrupt, words = CORRUPTIONS[case]
    older, newest = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    assert checkpoint_problem(newest) is None and checkpoint_problem(older) is None
    corrupt(newest)
    choice = ckpt.find_resume_checkpoint("auto", tmp_path)
    assert choice.path == older
    [(skipped, problem)] = choice.skipped
    assert skipped == newest and problem.startswith(f"{newest / bad_file}: ") and words in problem, problem
    assert "\n" not in problem


def test_a_corrupt_explicit_resume_path_is_refused_naming_the_file(tmp_path):
    path = _checkpoint(tmp_path, 2)
    _truncate(path / "optimizer.pt")
    with pytest.raises(ConfigError, match=r"resume=.*step-2: .*step-2/optimizer.pt: truncated") as info:
        ckpt.find_resume_checkpoint(str(path), tmp_path)
    assert "\n" not in str(info.value)


def test_no_whole_checkpoint_left_is_refused_not_started_over(tmp_path):
    for step in (1, 2):
        _truncate(_checkpoint(tmp_path, step) / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"step-2/adapter_model.safetensors: truncated.*nothing safe to resume"):
        ckpt.find_resume_checkpoint("auto", tmp_path)


def test_a_set_aside_name_never_lists_as_a_checkpoint_nor_replaces_one(tmp_path):
    path = _checkpoint(tmp_path, 2)
    first = ckpt.set_aside_name(path)
    assert first.name == "step-2.corrupt"
    first.mkdir()
    assert ckpt.set_aside_name(path).name == "step-2.corrupt-2"
    path.rename(first.with_name("step-2.corrupt-2"))
    assert ckpt.complete_checkpoints(tmp_path) == []


def test_a_state_file_that_is_not_an_object_does_not_crash_the_listing(tmp_path):
    path = _checkpoint(tmp_path, 1)
    (path / "trainer_state.json").write_text("[1]")
    assert ckpt.complete_checkpoints(tmp_path, "r1") == []  # another run's (unknown) checkpoint, not a crash


def test_weights_of_another_shape_are_one_config_error_naming_the_checkpoint(tmp_path):
    model = torch.nn.Linear(4, 8)
    save_file({"weight": torch.zeros(16, 4), "bias": torch.zeros(16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"size mismatch for weight.*another lora.r"):
        ckpt.load_weights(model, tmp_path, lora=False)


def test_force_resume_cannot_cross_a_change_of_the_adapters_shape(tmp_path):
    path = _checkpoint(tmp_path, 2)
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "dataset_cache_key": "k"}))
    with pytest.raises(ConfigError, match=r"even with force_resume=true: lora.r: 4 -> 8"):
        ckpt.check_compatible(path, {"lora": {"r": 8}}, "k", force=True)
    assert ckpt.check_compatible(path, {"lora": {"r": 4}}, "k", force=True) == []


def test_a_changed_base_model_or_rank_is_one_line_naming_the_setting_and_the_fix(tmp_path):
    path = _checkpoint(tmp_path, 2)
    (path / "train_config.json").write_text(json.dumps({"model": {"name_or_path": "org/base-a"}, "lora": {"r": 4}}))
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "dataset_cache_key": "k1"}))
    new_base = {"model": {"name_or_path": "org/base-b"}, "lora": {"r": 4}}
    with pytest.raises(ConfigError) as base:
        ckpt.check_compatible(path, new_base, "k2", force=False)
    message = str(base.value)
    assert "\n" not in message
    assert "model.name_or_path: 'org/base-a' -> 'org/base-b'" in message and "'k1' -> 'k2'" in message
    assert message.endswith("or force_resume=true to continue anyway")

    with pytest.raises(ConfigError) as rank:
        ckpt.check_compatible(path, {"model": {"name_or_path": "org/base-a"}, "lora": {"r": 8}}, "k1", force=False)
    message = str(rank.value)
    assert "\n" not in message and "lora.r: 4 -> 8 changes which tensors the model trains" in message
    assert "Set it back to resume, or use a new output_dir" in message
    assert "force_resume" not in message  # forcing cannot cross a change of the adapters' shape: never offered
