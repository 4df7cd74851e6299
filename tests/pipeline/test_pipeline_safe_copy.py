"""Issue 27 item 1, promote side: promote_to_volume copies no symlink, FIFO or device out of a
checkpoint (llmft/trainer/safe_files.py). Before the fix a checkpoint's tokenizer_config.json linking to a
secret was promoted with the secret's text, ready to be registered and served."""

from __future__ import annotations

import os

import pytest
from test_pipeline_promote_eval import evaluation, make_checkpoint

from llmft.components.lib.evaluation.promote import promote_to_volume
from llmft.trainer.safe_files import UnsafeInputError

SECRET = "CANARY-private-key\n"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "linked-folder"])
def test_promote_refuses_a_link_or_fifo_in_the_checkpoint_and_promotes_nothing(tmp_path, kind):
    run = tmp_path / "run"
    checkpoint = make_checkpoint(run, 10)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    if kind == "symlink":
        (checkpoint / "tokenizer_config.json").symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(checkpoint / "tokenizer_config.json")
    else:  # a folder one level down that is a link out of the checkpoint
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "tokenizer_config.json").write_text(SECRET)
        (checkpoint / "tokenizer").symlink_to(tmp_path / "outside")
    root = tmp_path / "data"
    if kind == "linked-folder":  # not entered: promoted without what the link points to
        decision = promote_to_volume(evaluation(100.0, 10.0, run_dir=run), root, "m", "r1", margin=0.0)
        promoted = root / "models" / "m" / "r1"
        assert decision.promoted and not (promoted / "tokenizer").exists()
        assert not [p for p in promoted.rglob("*") if p.is_file() and "CANARY" in p.read_text(errors="replace")]
        return
    with pytest.raises(UnsafeInputError, match="tokenizer_config.json is a (symlink|FIFO)") as info:
        promote_to_volume(evaluation(100.0, 10.0, run_dir=run), root, "m", "r1", margin=0.0)
    assert "CANARY" not in str(info.value)
    assert not (root / "models" / "m" / "r1").exists()
