"""An output folder is replaced only when it is empty or this program wrote it as the SAME kind: `llmft data tokenize
--output <a training run>` must never delete the run (llmft/trainer/io.py check_output_target)."""

from __future__ import annotations

import pytest

from llmft.trainer.data.tokenize import TOKENIZED_KIND
from llmft.trainer.errors import OutputNotOursError
from llmft.trainer.io import check_output_target, write_owner
from llmft.trainer.rundir import RUN_KIND


def _folder(path, kind: str | None):
    path.mkdir()
    (path / "payload.bin").write_bytes(b"x")
    if kind:
        write_owner(path, kind)
    return path


def test_an_llmft_folder_of_another_kind_is_refused(tmp_path):
    run = _folder(tmp_path / "run", RUN_KIND)
    with pytest.raises(OutputNotOursError, match=f"not written by llmft as {TOKENIZED_KIND}; refusing to replace it"):
        check_output_target(run, kind=TOKENIZED_KIND)
    check_output_target(run, kind=TOKENIZED_KIND, force=True)  # --force is the user's explicit word


def test_the_same_kind_an_empty_or_absent_folder_are_replaced(tmp_path):
    check_output_target(_folder(tmp_path / "tok", TOKENIZED_KIND), kind=TOKENIZED_KIND)
    (tmp_path / "empty").mkdir()
    check_output_target(tmp_path / "empty", kind=TOKENIZED_KIND)
    check_output_target(tmp_path / "absent", kind=TOKENIZED_KIND)
    with pytest.raises(OutputNotOursError, match="not written by llmft"):
        check_output_target(_folder(tmp_path / "theirs", None), kind=TOKENIZED_KIND)
