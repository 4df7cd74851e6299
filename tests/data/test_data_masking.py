"""Assistant-only loss masking: decode the supervised tokens of multi-turn rows.

Checked with the tiny ChatML tokenizer and with a real Qwen3 tokenizer, whose
template renders an empty think block into the LAST assistant turn only.
"""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import chat, write_jsonl
from llmft.trainer.data.shards import IGNORE_INDEX, open_split
from llmft.trainer.data.templates import assistant_spans, end_of_turn_marker
from llmft.trainer.data.tokenize import tokenize_dataset
from transformers import AutoTokenizer

MULTI_TURN = chat(
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Say Paris is the capital of France again.",
    "Paris is the capital of France.",
    "Name three primary colors.",
    "Red, blue and yellow.",
    system="You are a helpful assistant.",
)
EXPECTED = ("Paris is the capital of France.<|im_end|>" * 2) + "Red, blue and yellow.<|im_end|>"


def _tokenize_rows(tmp_path, model, rows, **kwargs):
    src = tmp_path / "prep"
    write_jsonl(src / "train.jsonl", rows)
    tokenize_dataset(src, str(model), tmp_path / "out", max_length=512, pack=False, num_proc=1, **kwargs)
    split = open_split(tmp_path / "out", "train")
    return [(np.asarray(split[i].input_ids), np.asarray(split[i].labels)) for i in range(len(split))]


def _supervised_runs(tok, ids, labels) -> list[str]:
    """Decoded contiguous runs of supervised tokens."""
    mask = labels != IGNORE_INDEX
    runs, start = [], None
    for i, on in enumerate([*mask.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    return runs


def test_tiny_tokenizer_multi_turn_supervises_exactly_the_assistant_turns(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    [(ids, labels)] = _tokenize_rows(tmp_path, tiny_model_dir, [MULTI_TURN])
    assert _supervised_runs(tok, ids, labels) == [
        "Paris is the capital of France.<|im_end|>",
        "Paris is the capital of France.<|im_end|>",
        "Red, blue and yellow.<|im_end|>",
    ]
    assert tok.decode(ids[labels != IGNORE_INDEX]) == EXPECTED
    prompt_text = tok.decode(ids[labels == IGNORE_INDEX])
    assert "You are a helpful assistant." in prompt_text and "Say Paris is the capital of France again." in prompt_text


def test_qwen3_template_last_turn_think_block_is_masked_correctly(tmp_path, qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    rendered = tok.apply_chat_template(MULTI_TURN["messages"], tokenize=False)
    assert rendered.count("<think>\n\n</think>\n\n") == 1, "expected Qwen3's last-turn-only think block"
    # Why prefix diffing fails here: the first turn renders differently once it is no longer last.
    first_turn = tok.apply_chat_template(MULTI_TURN["messages"][:3], tokenize=False)
    assert not rendered.startswith(first_turn)

    [(ids, labels)] = _tokenize_rows(tmp_path, qwen_tokenizer_dir, [MULTI_TURN])
    assert ids.tolist() == list(tok.apply_chat_template(MULTI_TURN["messages"], tokenize=True, return_dict=False))
    assert _supervised_runs(tok, ids, labels) == [
        "Paris is the capital of France.<|im_end|>",
        "Paris is the capital of France.<|im_end|>",
        "Red, blue and yellow.<|im_end|>",
    ]
    unsupervised = tok.decode(ids[labels == IGNORE_INDEX])
    assert "<think>\n\n</think>\n\n" in unsupervised and "<|im_start|>assistant" in unsupervised


def test_qwen3_reasoning_is_supervised_where_the_template_keeps_it(tmp_path, qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    row = chat(
        "Two plus two?",
        "<think>Earlier reasoning.</think>Four.",
        "And three plus three?",
        "<think>Add them.</think>Six.",
    )
    [(ids, labels)] = _tokenize_rows(tmp_path, qwen_tokenizer_dir, [row])
    runs = _supervised_runs(tok, ids, labels)
    # Qwen3 drops reasoning from earlier turns and re-renders it (with newlines) in the last one.
    assert runs == ["Four.<|im_end|>", "<think>\nAdd them.\n</think>\n\nSix.<|im_end|>"]
    assert "Earlier reasoning" not in tok.decode(ids)


def test_qwen3_many_rows_match_apply_chat_template(tmp_path, qwen_tokenizer_dir, prepared_sample):
    from data_helpers import read_jsonl

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    rows = read_jsonl(prepared_sample / "train.jsonl")[:60] + [MULTI_TURN]
    docs = _tokenize_rows(tmp_path, qwen_tokenizer_dir, rows)
    for row, (ids, labels) in zip(rows, docs, strict=True):
        assert ids.tolist() == list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
        answers = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert tok.decode(ids[labels != IGNORE_INDEX]) == "".join(answers)


def test_answer_repeated_inside_the_question_is_found_at_its_own_turn():
    text = "<|im_start|>user\nSay: Yes.<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
    spans = assistant_spans(text, chat("Say: Yes.", "Yes.")["messages"], "<|im_end|>")
    assert [text[a:b] for a, b in spans] == ["Yes.<|im_end|>"]
    assert spans[0][0] == text.index("assistant\nYes.") + len("assistant\n")


@pytest.mark.parametrize(
    ("template", "marker"),
    [
        ("{% for m in messages %}<|start|>{{ m['content'] }}<|eot_id|>{% endfor %}", "<|eot_id|>"),
        ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n\n{% endfor %}", ""),
    ],
)
def test_end_of_turn_marker_is_read_from_the_template(tiny_model_dir, template, marker):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert end_of_turn_marker(tok, template) == marker


class _UncoveredEncoding:
    """An encoding whose characters no token covers (forces the full-offsets fallback)."""

    def __init__(self, real):
        self.ids, self.offsets = real.ids, real.offsets

    def char_to_token(self, _pos):
        return None


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_label_spans_follow_token_start_offsets(tiny_model_dir, qwen_tokenizer_dir, which):
    from llmft.trainer.data.encode import _chat_labels

    tok = AutoTokenizer.from_pretrained(tiny_model_dir if which == "tiny" else qwen_tokenizer_dir)
    text = tok.apply_chat_template(MULTI_TURN["messages"], tokenize=False) + " émoji 😀 tail  spaces"
    encoding = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([o[0] for o in encoding.offsets])
    rng = np.random.default_rng(0)
    for _ in range(200):
        begin, end = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
        expected = (starts >= begin) & (starts < end)
        for enc in (encoding, _UncoveredEncoding(encoding)):
            ids, labels = _chat_labels(enc, len(text), [(begin, end)])
            assert np.array_equal(labels != IGNORE_INDEX, expected), (begin, end)
            assert np.array_equal(labels[expected], ids[expected])
