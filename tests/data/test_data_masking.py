"""Assistant-only loss masking: decode the supervised tokens of multi-turn rows.

Checked with the tiny ChatML tokenizer and with a real Qwen3 tokenizer, whose
template renders an empty think block into the LAST assistant turn only. The
property over random conversations and six real templates is in test_masking_property.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import chat, write_jsonl
from transformers import AutoTokenizer

from llmft.trainer.data.shards import IGNORE_INDEX, open_split
from llmft.trainer.data.templates import (
    ReplyLocator,
    TemplateMismatch,
    batch_renderer,
    end_of_turn_marker,
    special_token_texts,
)
from llmft.trainer.data.tokenize import tokenize_dataset

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_qwen3_many_rows_match_apply_chat_template(tmp_path, qwen_tokenizer_dir, prepared_sample):
    from data_helpers import read_jsonl

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    rows = read_jsonl(prepared_sample / "train.jsonl")[:60] + [MULTI_TURN]
    docs = _tokenize_rows(tmp_path, qwen_tokenizer_dir, rows)
    for row, (ids, labels) in zip(rows, docs, strict=True):
        assert ids.tolist() == list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
        answers = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert tok.decode(ids[labels != IGNORE_INDEX]) == "".join(answers)


def _locator(tok, template: str) -> ReplyLocator:
    return ReplyLocator(batch_renderer(tok, template), end_of_turn_marker(tok, template), special_token_texts(tok))


CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("answer", ["Yes.", "a", "im", "assistant", "user", "<|im_end|>", "\n"])
def test_answer_that_also_occurs_in_the_template_or_question_is_found_at_its_own_turn(tiny_model_dir, answer):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = chat(f"Say: {answer}", answer)["messages"]
    text = tok.apply_chat_template(messages, chat_template=CHATML, tokenize=False)
    [span] = _locator(tok, CHATML).locate(text, messages)
    header = "<|im_start|>assistant\n"
    assert span.start == text.index(header) + len(header)
    assert text[span.start : span.stop] == answer + "<|im_end|>" and span.end == span.stop - len("<|im_end|>")


@pytest.mark.parametrize(
    ("template", "reply"),
    [  # contents the template rewrites: the user's (layout of this row), every one (difference)
        (
            CHATML.replace("m['content'] }}", "m['content'] if m['role'] == 'assistant' else m['content'] | trim }}"),
            " a ",
        ),
        (CHATML.replace("m['content'] }}", "m['content'] | trim }}"), "a"),
    ],
)
def test_reply_is_located_when_the_template_rewrites_contents(tiny_model_dir, template, reply):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = chat("  a  ", " a ", " assistant ", " a ")["messages"]
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    spans = _locator(tok, template).locate(text, messages)
    assert [text[s.start : s.stop] for s in spans] == [reply + "<|im_end|>"] * 2
    assert [s.message for s in spans] == [1, 3]


def test_reply_the_template_renders_as_nothing_is_rejected_by_name(tiny_model_dir):
    """A template that skips empty messages (as GLM-4's first template does): no turn, no silent loss.
    Runs the tokenize worker (``init_worker`` + ``encode_chunk``); the count and the example go to the
    split's ``dropped`` / ``dropped_examples`` in manifest.json and the tokenize summary."""
    import json

    from llmft.trainer.data.encode import EncodePlan, encode_chunk, init_worker

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    skipping = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m['content'] %}").replace(
        "{% endfor %}", "{% endif %}{% endfor %}"
    )
    init_worker(tok, EncodePlan(skipping, end_of_turn_marker(tok, skipping), 512, "drop"))
    rows = [chat("Q1?", "A1.", "Q2?", ""), chat("Q?", "Fine.")]
    result = encode_chunk(("train.jsonl", 7, "\n".join(json.dumps(r) for r in rows).encode()))
    assert len(result.lengths) == 1 and dict(result.dropped) == {"empty_assistant_reply": 1}
    [example] = result.examples
    assert example["line"] == 7 and example["detail"].startswith("assistant turn 2 (message 3) maps to zero tokens")


def test_template_that_renders_a_reply_twice_is_a_named_mismatch(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    twice = CHATML.replace("<|im_end|>\n{% endfor %}", "<|im_end|>\n{% endfor %}{{ messages[-1]['content'] }}")
    messages = chat("Q?", "A.")["messages"]
    text = tok.apply_chat_template(messages, chat_template=twice, tokenize=False)
    with pytest.raises(TemplateMismatch, match="assistant message 1"):
        _locator(tok, twice).locate(text, messages)


@pytest.mark.parametrize(
    ("template", "marker"),
    [
        ("{% for m in messages %}<|start|>{{ m['content'] }}<|eot_id|>{% endfor %}", "<|eot_id|>"),
        ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n\n{% endfor %}", ""),
        ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n<|EOT|>\n{% endfor %}", "\n<|EOT|>"),
        ("{% for m in messages %}[INST] {{ m['content'] }} </s>{% endfor %}", " </s>"),
    ],
)
def test_end_of_turn_marker_is_read_from_the_template(tiny_model_dir, template, marker):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert end_of_turn_marker(tok, template) == marker


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_whole_text_path_supervises_every_token_overlapping_a_reply(tiny_model_dir, qwen_tokenizer_dir, which):
    """The path for tokenizers that tokenize a piece differently on its own (checked against brute force)."""
    from llmft.trainer.data.encode import _overlapping

    tok = AutoTokenizer.from_pretrained(tiny_model_dir if which == "tiny" else qwen_tokenizer_dir)
    text = tok.apply_chat_template(MULTI_TURN["messages"], tokenize=False) + " émoji 😀 tail  spaces"
    offsets = np.asarray(tok.backend_tokenizer.encode(text, add_special_tokens=False).offsets).reshape(-1, 2)
    rng = np.random.default_rng(0)
    for _ in range(200):
        begin, end = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
        expected = [(a < end and b > begin) if a < b else begin <= a < end for a, b in offsets.tolist()]
        assert _overlapping(offsets, begin, end).tolist() == expected, (begin, end)


def test_pieces_probe_accepts_byte_level_tokenizers(tiny_model_dir, qwen_tokenizer_dir):
    from llmft.trainer.data.encode import pieces_encode_alone

    no_system = CHATML.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}",
    )
    for directory in (tiny_model_dir, qwen_tokenizer_dir):
        tok = AutoTokenizer.from_pretrained(directory)
        for template in (tok.chat_template, no_system):  # a template refusing a system message (Gemma) too
            assert pieces_encode_alone(tok, _locator(tok, template))
