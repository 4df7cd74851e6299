"""tokenize_dataset: ids, manifest, cache hit/miss, truncation, dropped rows, templates, atomicity."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from data_helpers import chat, read_jsonl, write_jsonl
from transformers import AutoTokenizer

from llmft.trainer.data.shards import IGNORE_INDEX, open_split, read_manifest
from llmft.trainer.data.tokenize import cache_key_for, tokenize_dataset
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.io import is_complete

MANIFEST_KEYS = {
    "cache_key",
    "cache_hit",
    "splits",
    "max_length",
    "packed",
    "truncation",
    "tokenizer",
    "source_hash",
    "dataset_hash",
    "tokenizer_hash",
    "chat_template_hash",
    "vocab_size",
    "eos_token_id",
    "pad_token_id",
}
SPLIT_KEYS = {
    "rows",
    "documents",
    "sequences",
    "tokens",
    "supervised_tokens",
    "packing_efficiency",
    "dropped",
    "doc_length",
    "seq_length",
    "length_histogram",
    "truncated",
}


def _docs(directory, split="train"):
    s = open_split(directory, split)
    offsets = np.asarray(s.doc_offsets)
    return [
        (np.asarray(s.input_ids[a:b]), np.asarray(s.labels[a:b]))
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def _prepared(tmp_path, rows, name="prep"):
    directory = tmp_path / name
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", rows)
    return directory


def _tokenizer_copy(tiny_model_dir, tmp_path, chat_template=None):
    """The tiny tokenizer with its chat template removed (or replaced)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = chat_template
    out = tmp_path / "tok"
    tok.save_pretrained(out)
    for leftover in out.glob("chat_template.*"):
        if chat_template is None:
            leftover.unlink()
    return str(out)


def test_ids_equal_apply_chat_template_and_labels_are_assistant_only(tokenized_sample, prepared_sample, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = read_jsonl(prepared_sample / "train.jsonl")
    docs = _docs(tokenized_sample["unpacked"])
    assert len(docs) == len(rows) == tokenized_sample["unpacked_manifest"]["splits"]["train"]["documents"]
    for row, (ids, labels) in zip(rows, docs, strict=True):
        expected = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        assert ids.tolist() == list(expected)
        assert tok.decode(ids[labels != IGNORE_INDEX]) == row["messages"][-1]["content"] + "<|im_end|>"
        assert np.array_equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])


def test_manifest_is_complete_and_consistent(tokenized_sample, prepared_sample):
    manifest = tokenized_sample["packed_manifest"]
    assert MANIFEST_KEYS <= set(manifest)
    assert read_manifest(tokenized_sample["packed"]) == manifest
    assert manifest["cache_hit"] is False and manifest["packed"] is True and manifest["max_length"] == 256
    assert manifest["source_hash"] == json.loads((prepared_sample / "report.json").read_text())["source_hash"]
    for split in ("train", "val"):
        stats = manifest["splits"][split]
        assert SPLIT_KEYS <= set(stats)
        s = open_split(tokenized_sample["packed"], split)
        labels = np.asarray(s.labels)
        assert stats["tokens"] == s.num_tokens == len(labels)
        assert stats["supervised_tokens"] == int((labels != IGNORE_INDEX).sum())
        assert stats["sequences"] == len(s) and stats["documents"] == len(s.doc_offsets) - 1
        assert stats["packing_efficiency"] == pytest.approx(stats["tokens"] / (len(s) * 256), abs=1e-6)
        assert sum(stats["length_histogram"]["counts"]) == stats["documents"]
    assert is_complete(tokenized_sample["packed"])


def test_worker_count_does_not_change_the_output(tmp_path, prepared_sample, tiny_model_dir, tokenized_sample):
    out = tokenize_dataset(
        prepared_sample, str(tiny_model_dir), tmp_path / "np2", max_length=256, pack=False, num_proc=2
    )
    assert out["cache_key"] == tokenized_sample["unpacked_manifest"]["cache_key"]
    for name in ("input_ids", "labels", "doc_offsets", "seq_offsets"):
        a = np.load(tmp_path / "np2" / "train" / f"{name}.npy")
        b = np.load(tokenized_sample["unpacked"] / "train" / f"{name}.npy")
        assert np.array_equal(a, b), name


def test_cache_hit_rewrites_nothing_and_any_change_misses(tmp_path, tiny_model_dir, capsys):
    src = _prepared(tmp_path, [chat(f"Question {i}?", f"Answer {i}.") for i in range(40)])
    out = tmp_path / "shards"  # not tmp_path / "tok": _tokenizer_copy writes the model there, an input
    first = tokenize_dataset(src, str(tiny_model_dir), out, max_length=64, num_proc=1)
    assert cache_key_for(src, str(tiny_model_dir), max_length=64) == first["cache_key"]
    assert first["chat_template"] == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")}
    capsys.readouterr()
    again = tokenize_dataset(src, str(tiny_model_dir), out, max_length=64, num_proc=1)
    assert again["cache_hit"] is True and again["cache_key"] == first["cache_key"]
    assert "cache hit" in capsys.readouterr().out
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")} == stamps

    lines = (src / "train.jsonl").read_text().splitlines()
    lines[7] = json.dumps(chat("Question 7?", "A different answer."))
    (src / "train.jsonl").write_text("\n".join(lines) + "\n")
    edited = tokenize_dataset(src, str(tiny_model_dir), out, max_length=64, num_proc=1)
    assert edited["cache_hit"] is False and edited["cache_key"] != first["cache_key"]
    assert "cache hit" not in capsys.readouterr().out
    keys = {edited["cache_key"]}
    for kwargs in (
        {"max_length": 128},
        {"max_length": 64, "pack": False},
        {"max_length": 64, "truncation": "truncate"},
    ):
        changed = tokenize_dataset(src, str(tiny_model_dir), out, num_proc=1, **kwargs)
        assert changed["cache_hit"] is False and changed["cache_key"] not in keys
        keys.add(changed["cache_key"])
    other_template = _tokenizer_copy(
        tiny_model_dir,
        tmp_path,
        chat_template=AutoTokenizer.from_pretrained(tiny_model_dir).chat_template.replace("'\\n'", "'\\n\\n'"),
    )
    changed = tokenize_dataset(src, other_template, out, max_length=64, num_proc=1, truncation="truncate")
    assert changed["cache_hit"] is False and changed["cache_key"] not in keys
    assert (
        changed["dataset_hash"] == edited["dataset_hash"]
        and changed["chat_template_hash"] != edited["chat_template_hash"]
    )


def test_truncation_modes(tmp_path, tiny_model_dir):
    long_answer = " ".join(["the model trains the loss curve quickly."] * 30)
    src = _prepared(tmp_path, [chat("Q?", "Short."), chat("Q?", long_answer), chat("Q?", "Fine.")])
    dropped = tokenize_dataset(
        src, str(tiny_model_dir), tmp_path / "drop", max_length=64, num_proc=1, max_drop_fraction=0.5
    )
    stats = dropped["splits"]["train"]
    assert stats["documents"] == 2 and stats["dropped"] == {"too_long": 1}
    assert stats["dropped_examples"][0]["line"] == 2 and stats["dropped_examples"][0]["file"] == "train.jsonl"

    cut = tokenize_dataset(src, str(tiny_model_dir), tmp_path / "cut", max_length=64, truncation="truncate", num_proc=1)
    assert cut["splits"]["train"]["truncated"] == 1 and cut["splits"]["train"]["documents"] == 3
    assert cut["splits"]["train"]["doc_length"]["max"] == 64

    with pytest.raises(DataError, match=r"train\.jsonl:2: document has \d+ tokens, more than --max-length 64"):
        tokenize_dataset(src, str(tiny_model_dir), tmp_path / "err", max_length=64, truncation="error", num_proc=2)
    assert not (tmp_path / "err").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".err")], "temp directory left behind"


def test_row_without_trainable_token_is_reported_not_trained(tmp_path, tiny_model_dir):
    long_question = " ".join(["what does the scheduler read before lunch?"] * 30)
    src = _prepared(tmp_path, [chat("Q?", "A."), chat(long_question, "Answer."), chat("Q2?", "A2.")])
    manifest = tokenize_dataset(
        src,
        str(tiny_model_dir),
        tmp_path / "out",
        max_length=48,
        truncation="truncate",
        num_proc=1,
        max_drop_fraction=0.5,
    )
    stats = manifest["splits"]["train"]
    assert stats["documents"] == 2 and stats["dropped"] == {"no_trainable_token": 1}
    assert stats["dropped_examples"][0]["line"] == 2
    for _ids, labels in _docs(tmp_path / "out"):
        assert (labels != IGNORE_INDEX).any()


def test_text_rows_train_on_every_token_and_end_with_eos(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    src = _prepared(tmp_path, [{"text": "The model trains the loss curve quickly."}, chat("Q?", "A.")])
    tokenize_dataset(src, str(tiny_model_dir), tmp_path / "out", max_length=64, pack=False, num_proc=1)
    (ids, labels), (chat_ids, chat_labels) = _docs(tmp_path / "out")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == "The model trains the loss curve quickly."
    assert labels[0] == IGNORE_INDEX and np.array_equal(labels[1:], ids[1:])
    assert (chat_labels == IGNORE_INDEX).sum() > 0


def test_missing_chat_template_is_a_clear_error_and_fallback_works(tmp_path, tiny_model_dir):
    bare = _tokenizer_copy(tiny_model_dir, tmp_path)
    src = _prepared(tmp_path, [chat("Q?", "A.")])
    with pytest.raises(DataError, match="has no chat template.*--chat-template"):
        tokenize_dataset(src, bare, tmp_path / "out", max_length=64, num_proc=1)
    assert not (tmp_path / "out").exists()
    manifest = tokenize_dataset(src, bare, tmp_path / "out", max_length=64, num_proc=1, chat_template="chatml")
    assert manifest["chat_template_source"] == "fallback:chatml" and manifest["end_of_turn"] == "<|im_end|>"
    text_only = _prepared(tmp_path, [{"text": "hello there"}], name="text")
    assert (
        tokenize_dataset(text_only, bare, tmp_path / "t", max_length=64, num_proc=1)["chat_template_source"] == "none"
    )


def test_template_errors_drop_only_the_failing_rows(tmp_path, tiny_model_dir):
    strict = (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system role') }}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    )
    template_file = tmp_path / "strict.jinja"
    template_file.write_text(strict)
    bare = _tokenizer_copy(tiny_model_dir, tmp_path)
    src = _prepared(tmp_path, [chat("Q?", "A."), chat("Q?", "A.", system="S"), chat("Q3?", "A3.")])
    manifest = tokenize_dataset(
        src, bare, tmp_path / "out", max_length=64, num_proc=1, chat_template=str(template_file), max_drop_fraction=0.5
    )
    stats = manifest["splits"]["train"]
    assert stats["documents"] == 2 and stats["dropped"] == {"template_error": 1}
    assert stats["dropped_examples"][0]["line"] == 2 and "no system role" in stats["dropped_examples"][0]["detail"]


def test_nothing_trainable_fails_and_bad_inputs_are_named(tmp_path, tiny_model_dir):
    src = _prepared(tmp_path, [chat("Q?", "A long answer about the pipeline that will not fit.")])
    with pytest.raises(DataError, match="no trainable document left"):
        tokenize_dataset(src, str(tiny_model_dir), tmp_path / "out", max_length=8, num_proc=1)
    with pytest.raises(DataError, match="no train.jsonl"):
        tokenize_dataset(tmp_path, str(tiny_model_dir), tmp_path / "out", num_proc=1)
    with pytest.raises(ConfigError, match=r"^model='.*no-model': cannot load the tokenizer \(.*\)\. Fix: "):
        tokenize_dataset(src, str(tmp_path / "no-model"), tmp_path / "out", num_proc=1)
    with pytest.raises(DataError, match="--truncation"):
        tokenize_dataset(src, str(tiny_model_dir), tmp_path / "out", truncation="cut")
    assert not (tmp_path / "out").exists()


def test_empty_val_split_is_readable(tmp_path, tiny_model_dir):
    src = _prepared(tmp_path, [chat("Q?", "A.")])
    (src / "val.jsonl").write_text("")
    manifest = tokenize_dataset(src, str(tiny_model_dir), tmp_path / "out", max_length=32, num_proc=1)
    assert manifest["splits"]["val"]["documents"] == 0
    assert len(open_split(tmp_path / "out", "val")) == 0
    shutil.rmtree(tmp_path / "out")


def _die_in_worker(_task):
    import os

    os._exit(9)  # what an OOM kill looks like to the parent


def test_dead_worker_fails_fast_and_leaves_nothing(tmp_path, tiny_model_dir, monkeypatch):
    import llmft.trainer.data.tokenize as tokenize_module
    from llmft.trainer.errors import EXIT_TRANSIENT, TransientError

    src = _prepared(tmp_path, [chat(f"Q{i}?", f"A{i}.") for i in range(20)])
    monkeypatch.setattr(tokenize_module, "encode_chunk", _die_in_worker)
    with pytest.raises(TransientError, match="worker process died") as failure:
        tokenize_dataset(src, str(tiny_model_dir), tmp_path / "out", max_length=64, num_proc=2)
    assert failure.value.exit_code == EXIT_TRANSIENT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"], "partial output or temp dir left behind"


def test_chunk_and_copy_block_sizes_do_not_change_the_output(tmp_path, tiny_model_dir, monkeypatch):
    import llmft.trainer.data.tokenize as tokenize_module

    rows = [chat(f"Question {i}?", "the model trains the loss curve quickly. " * (i % 7 + 1)) for i in range(120)]
    rows[50] = chat("Q?", " ".join(["the pipeline packs every checkpoint."] * 40))  # too long: dropped
    src = _prepared(tmp_path, rows)
    (src / "train.jsonl").write_text((src / "train.jsonl").read_text().replace("\n", "\n\n", 3))  # blank lines
    reference = tokenize_dataset(src, str(tiny_model_dir), tmp_path / "ref", max_length=128, num_proc=1)
    plain = tokenize_dataset(src, str(tiny_model_dir), tmp_path / "plain", max_length=128, num_proc=1, pack=False)
    monkeypatch.setattr(tokenize_module, "CHUNK_BYTES", 700)
    monkeypatch.setattr(tokenize_module, "COPY_BLOCK_TOKENS", 97)
    small = tokenize_dataset(src, str(tiny_model_dir), tmp_path / "small", max_length=128, num_proc=2)
    small_plain = tokenize_dataset(
        src, str(tiny_model_dir), tmp_path / "small_plain", max_length=128, num_proc=2, pack=False
    )
    for a, b in (("ref", "small"), ("plain", "small_plain")):
        for name in ("input_ids", "labels", "doc_offsets", "seq_offsets"):
            assert np.array_equal(
                np.load(tmp_path / a / "train" / f"{name}.npy"), np.load(tmp_path / b / "train" / f"{name}.npy")
            ), (a, name)
    assert small["splits"]["train"]["dropped_examples"] == reference["splits"]["train"]["dropped_examples"]
    assert reference["splits"]["train"]["dropped_examples"][0]["line"] == 51 + 3
    assert (
        small["splits"]["train"]["rows"]
        == small_plain["splits"]["train"]["rows"]
        == plain["splits"]["train"]["rows"]
        == 120
    )
