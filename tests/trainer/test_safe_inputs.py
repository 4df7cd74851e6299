"""Issue 27 items 1 and 6: export copies no symlink, FIFO or device into a servable artifact
(llmft/trainer/safe_files.py), while a Hugging Face hub cache snapshot (links into its own blobs/) still works.

Each case is `llmft export` in this process on an adapter made with PEFT on the tiny model. Before the
fix, an adapter whose generation_config.json links to a secret exported with exit 0 and the secret's
text in out/generation_config.json (and a linked chat_template.jinja inside out/tokenizer_config.json).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from llmft.cli import main
from llmft.trainer.hf_files import TOKENIZER_FILES

SECRET = "root:x:0:0:CANARY-not-for-artifacts:/root:/bin/bash\n"


def cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA adapter on the tiny model, carrying its tokenizer (as a run's final/ does)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("safe-export") / "adapter"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


def evil_copy(adapter_dir: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the adapter whose ``name`` is a symlink to a secret file outside it."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    evil = tmp_path / "evil"
    shutil.copytree(adapter_dir, evil)
    (evil / name).unlink(missing_ok=True)
    (evil / name).symlink_to(secret)
    return evil


def leaked(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    return [str(p) for p in directory.rglob("*") if p.is_file() and "CANARY" in p.read_text(errors="replace")]


@pytest.mark.parametrize("merge", [False, True], ids=["bundle", "merged"])
@pytest.mark.parametrize("name", ["generation_config.json", "chat_template.jinja", "adapter_config.json"])
def test_export_refuses_a_linked_file_and_writes_nothing(adapter_dir, tmp_path, name, merge):
    evil = evil_copy(adapter_dir, tmp_path, name)
    out = tmp_path / "out"
    code, err = cli("export", "--adapter", str(evil), "--output", str(out), *(["--merge"] if merge else []))
    assert code == 1, err
    assert err.count("\n") == 1 and f"{evil / name} is a symlink" in err and "CANARY" not in err, err
    assert not out.exists() and not leaked(tmp_path / "out") and not list(tmp_path.glob(".out.*"))


def test_export_refuses_a_fifo_instead_of_hanging(adapter_dir, tmp_path):
    fifo_dir = tmp_path / "fifo"
    shutil.copytree(adapter_dir, fifo_dir)
    os.mkfifo(fifo_dir / "generation_config.json")  # reading it would block forever
    code, err = cli("export", "--adapter", str(fifo_dir), "--output", str(tmp_path / "out"))
    assert code == 1 and "generation_config.json is a FIFO" in err and err.count("\n") == 1, err


def test_a_linked_parent_folder_is_outside_the_adapter(adapter_dir, tmp_path):
    from llmft.trainer.safe_files import UnsafeInputError, check_file

    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "generation_config.json").write_text(SECRET)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "sub").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafeInputError, match="outside"):
        check_file(tmp_path / "adapter" / "sub" / "generation_config.json", tmp_path / "adapter")


def test_a_hub_cache_snapshot_links_into_its_own_blobs_only(tmp_path):
    """huggingface_hub stores models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH
    (huggingface_hub/file_download.py, _create_symlink): followed there, refused elsewhere."""
    from llmft.trainer.safe_files import UnsafeInputError, read_text

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text('{"eos_token_id": 2}')
    (snapshot / "generation_config.json").symlink_to(Path("../../blobs/f00d"))
    assert json.loads(read_text(snapshot / "generation_config.json", snapshot)) == {"eos_token_id": 2}
    (tmp_path / "secret.txt").write_text(SECRET)
    (snapshot / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UnsafeInputError, match="is a symlink"):
        read_text(snapshot / "chat_template.jinja", snapshot)


def test_export_of_a_clean_adapter_still_works(adapter_dir, tmp_path):
    code, err = cli("export", "--adapter", str(adapter_dir), "--output", str(tmp_path / "out"))
    assert code == 0, err
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("size", ["lots", "0", "-1MB", "nan"])
def test_max_shard_size_that_is_not_a_size_above_zero_is_one_line_exit_1(adapter_dir, tmp_path, size):
    """Issue 27 item 6: `--max-shard-size lots` exited 3 (internal error) and `0` wrote one shard per tensor."""
    out = tmp_path / "out"
    code, err = cli(
        "export", "--adapter", str(adapter_dir), "--output", str(out), "--merge", f"--max-shard-size={size}"
    )
    assert code == 1 and err.count("\n") == 1 and "--max-shard-size" in err and "internal error" not in err, err
    assert not out.exists()


def test_a_full_disk_while_merging_names_the_output_the_bytes_needed_and_free(adapter_dir, tmp_path, monkeypatch):
    """Issue 29 item 6 for model writes: the merged shards hit ENOSPC (injected at the shard writer's
    Python write, llmft/trainer/weights_io.py ShardStream.write); was a raw OSError naming the temp file."""
    import errno

    from llmft.trainer import weights_io

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(weights_io.ShardStream, "write", full)
    out = tmp_path / "merged"
    code, err = cli("export", "--adapter", str(adapter_dir), "--output", str(out), "--merge")
    assert code == 200 and err.count("\n") == 1, err
    assert f"{out}: No space left on device" in err and "needs about" in err and "free of" in err, err
    assert not out.exists() and not list(tmp_path.glob(".merged.*"))
