"""`llmft data prepare --input langfuse://NAME`: a Langfuse dataset, read by the real SDK from the
recording fake server (tests/langfuse_fake.py), becomes the same validated JSONL as any source."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from langfuse_fake import FakeLangfuse
from trainer_helpers import REPO, clean_env

from llmft.trainer.langfuse_sink import item_row

ITEMS = [
    {"input": "What is 2+2?", "expected_output": "4"},
    {"input": {"question": "Capital of France?"}, "expected_output": {"role": "assistant", "content": "Paris"}},
    {
        "input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "expected_output": {"content": "Hello"},
    },
    {"input": "An unanswered trace", "expected_output": None},  # no assistant turn: rejected
    {"input": "Archived", "expected_output": "gone", "status": "ARCHIVED"},  # not read at all
    {"input": {"a": 1, "b": 2}, "expected_output": "?"},  # no prompt to find: rejected
]


def prepare(spec: str, out, env: dict, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmft", "data", "prepare", "--input", spec, "--output", str(out), *extra]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def langfuse():
    with FakeLangfuse() as server:
        server.add_dataset("support/curated", ITEMS)
        yield server


@pytest.mark.slow
def test_a_langfuse_dataset_becomes_validated_jsonl_with_rejects_and_report(langfuse, tmp_path):
    env = clean_env(**langfuse.env())
    result = prepare(
        "langfuse://support/curated", tmp_path / "out", env, "--val-fraction", "0", "--max-reject-fraction", "0.5"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["source_kind"] == "langfuse" and report["source"] == "langfuse://support/curated"
    assert (report["total_rows"], report["accepted"], report["rejected"]) == (5, 3, 2)
    assert report["reject_reasons"] == {"no_assistant_turn": 1, "missing_field": 1}
    rows = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert sorted(rows, key=json.dumps) == sorted(
        [
            {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
            {
                "messages": [
                    {"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "Paris"},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                ]
            },
        ],
        key=json.dumps,
    )
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [
        ("langfuse://support/curated", 4, "no_assistant_turn"),
        ("langfuse://support/curated", 5, "missing_field"),  # the 5th active item (the archived one is skipped)
    ]
    again = prepare(
        "langfuse://support/curated", tmp_path / "again", env, "--val-fraction", "0", "--max-reject-fraction", "0.5"
    )
    assert again.returncode == 0
    assert json.loads((tmp_path / "again" / "report.json").read_text())["source_hash"] == report["source_hash"]
    assert [m for m, p, _ in langfuse.requests if "/api/public/" in p] and all(
        m == "GET" for m, _, _ in langfuse.requests
    )


@pytest.mark.slow
def test_a_missing_dataset_or_missing_keys_is_one_line_exit_1(langfuse, tmp_path):
    missing = prepare("langfuse://nope", tmp_path / "a", clean_env(**langfuse.env()))
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .endswith(f"langfuse://nope: no dataset named 'nope' on {langfuse.url}; check the name in Langfuse")
    )
    no_keys = prepare("langfuse://support/curated", tmp_path / "b", clean_env(LANGFUSE_HOST=langfuse.url))
    assert no_keys.returncode == 1 and "LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are not set" in no_keys.stderr
    assert "Traceback" not in missing.stderr + no_keys.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_item_inputs_and_expected_outputs_map_onto_messages():
    def row(item_input, expected):
        return item_row(type("Item", (), {"input": item_input, "expected_output": expected})())

    assert row({"messages": [{"role": "user", "content": "Hi"}]}, [{"role": "assistant", "content": "Yo"}]) == {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    }
    assert row({"prompt": "p", "question": "q"}, "a") == {
        "input": {"prompt": "p", "question": "q"},
        "expected_output": "a",
    }
    assert row("q", 42) == {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}]}
