"""Worker side of ``llmft data tokenize``: one chunk of canonical JSONL rows ->
token ids, unshifted labels (-100 outside assistant turns) and document lengths.

Runs in each worker process of the pool (or inline with one process). A chunk's
conversations are rendered with the chat template in one call and tokenized in
one fast-tokenizer batch; labels come from the tokenizer's character offsets
and the supervised spans of :func:`llmft.trainer.data.templates.assistant_spans`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from llmft.trainer.data.shards import IGNORE_INDEX
from llmft.trainer.data.templates import TemplateMismatch, assistant_spans, batch_renderer, render
from llmft.trainer.errors import DataError

try:  # optional fast path; identical results
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads

MAX_EXAMPLES = 10


@dataclass(frozen=True)
class EncodePlan:
    """Settings every worker needs (picklable)."""

    template: str | None  # chat template text; None when the data has no conversations
    end_of_turn: str  # supervised marker after each assistant message ("<|im_end|>")
    max_length: int  # longest document kept (tokens)
    truncation: str  # drop | truncate | error


@dataclass
class ChunkResult:
    """Documents of one chunk, in input order, plus what was dropped and why."""

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    rows: int = 0
    supervised: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)


_WORKER: dict = {}


def init_worker(tokenizer, plan: EncodePlan) -> None:
    """Pool initializer: keep the tokenizer, plan and a compiled chat template in the worker's globals."""
    _WORKER["tokenizer"] = tokenizer
    _WORKER["plan"] = plan
    _WORKER["render_many"] = batch_renderer(tokenizer, plan.template) if plan.template else None


def encode_chunk(task: tuple[str, int, bytes]) -> ChunkResult:
    """Encode ``(file label, first line number, block of JSONL lines)`` with the worker's tokenizer and plan."""
    label, first_line, block = task
    lines = [(first_line + i, raw) for i, raw in enumerate(block.split(b"\n")) if raw.strip()]
    tokenizer, plan = _WORKER["tokenizer"], _WORKER["plan"]
    result = ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), rows=len(lines))
    docs = _render_rows(tokenizer, plan, label, lines, result)
    ids_parts, label_parts, lengths = [], [], []
    for line, ids, labels in _tokenize_docs(tokenizer, plan, docs):
        ids, labels = _fit(ids, labels, plan, label, line, result)
        if ids is None:
            continue
        labels[0] = IGNORE_INDEX  # nothing precedes a document's first token: never a target
        supervised = int(np.count_nonzero(labels != IGNORE_INDEX))
        if supervised == 0:
            _drop(result, label, line, "no_trainable_token", "no supervised token left (nothing to learn from)")
            continue
        result.supervised += supervised
        ids_parts.append(ids)
        label_parts.append(labels)
        lengths.append(len(ids))
    if lengths:
        result.input_ids = np.concatenate(ids_parts)
        result.labels = np.concatenate(label_parts)
        result.lengths = np.asarray(lengths, np.int32)
    return result


def _drop(result: ChunkResult, label: str, line: int, reason: str, detail: str) -> None:
    result.dropped[reason] += 1
    if len(result.examples) < MAX_EXAMPLES:
        result.examples.append({"file": label, "line": line, "reason": reason, "detail": detail})


def _render_rows(tokenizer, plan: EncodePlan, label: str, lines, result: ChunkResult) -> list[tuple]:
    """Parse rows; render conversations. Returns [(line, kind, text, spans)] in input order."""
    parsed = []
    for line, raw in lines:
        try:
            row = _loads(raw)
        except ValueError as exc:
            _drop(result, label, line, "invalid_row", f"not valid JSON: {exc}")
            continue
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            parsed.append((line, "chat", row["messages"]))
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            parsed.append((line, "text", row["text"]))
        else:
            _drop(result, label, line, "invalid_row", "row has neither `messages` nor `text`: run `llmft data prepare`")
    chats = [p for p in parsed if p[1] == "chat"]
    if chats and plan.template is None:
        raise DataError(f"{label}:{chats[0][0]}: conversational row but no chat template; pass --chat-template")
    rendered = dict(zip((c[0] for c in chats), _render_all(tokenizer, plan, label, chats, result), strict=True))
    docs = []
    for line, kind, payload in parsed:
        if kind == "text":
            docs.append((line, "text", payload, None))
            continue
        text = rendered[line]
        if text is None:
            continue
        try:
            docs.append((line, "chat", text, assistant_spans(text, payload, plan.end_of_turn)))
        except TemplateMismatch as exc:
            _drop(result, label, line, "template_mismatch", f"{exc}: the template rewrites assistant content")
    return docs


def _render_all(tokenizer, plan: EncodePlan, label: str, chats: list, result: ChunkResult) -> list[str | None]:
    if not chats:
        return []
    try:
        return _WORKER["render_many"]([c[2] for c in chats])
    except Exception:  # noqa: BLE001 - one bad row fails the batch: find it row by row
        pass
    texts: list[str | None] = []
    for line, _kind, messages in chats:
        try:
            texts.append(render(tokenizer, plan.template, messages))
        except Exception as exc:  # noqa: BLE001 - template raise_exception(...) and friends
            _drop(result, label, line, "template_error", f"chat template failed: {exc}")
            texts.append(None)
    return texts


def _tokenize_docs(tokenizer, plan: EncodePlan, docs: list[tuple]):
    """Yield (line, ids, labels) per document, tokenizing chats and texts in two batches."""
    backend = tokenizer.backend_tokenizer
    chats = [d for d in docs if d[1] == "chat"]
    texts = [d for d in docs if d[1] == "text"]
    encoded = {}
    if chats:
        for doc, enc in zip(chats, backend.encode_batch([d[2] for d in chats], add_special_tokens=False), strict=True):
            encoded[doc[0]] = _chat_labels(enc, len(doc[2]), doc[3])
    if texts:
        eos = tokenizer.eos_token_id
        for doc, enc in zip(texts, backend.encode_batch([d[2] for d in texts], add_special_tokens=True), strict=True):
            ids = enc.ids + ([eos] if eos is not None and (not enc.ids or enc.ids[-1] != eos) else [])
            arr = np.asarray(ids, np.int32)
            encoded[doc[0]] = (arr, arr.copy())
    for doc in docs:
        ids, labels = encoded[doc[0]]
        yield doc[0], ids, labels


def _chat_labels(encoding, text_length: int, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Labels = ids for tokens that START inside a supervised character span, else -100."""
    ids = np.asarray(encoding.ids, np.int32)
    labels = np.full(len(ids), IGNORE_INDEX, np.int32)
    starts = None
    for begin, end in spans:
        lo = _first_token_from(encoding, begin, len(ids), text_length)
        hi = _first_token_from(encoding, end, len(ids), text_length)
        if lo is None or hi is None:  # rare: long run of characters no token covers; use all offsets
            if starts is None:
                starts = np.fromiter((o[0] for o in encoding.offsets), np.int64, count=len(ids))
            lo, hi = np.searchsorted(starts, (begin, end), side="left")
        labels[lo:hi] = ids[lo:hi]
    return ids, labels


def _first_token_from(encoding, char: int, n_tokens: int, text_length: int, lookahead: int = 16) -> int | None:
    """Index of the first token whose start offset is >= ``char`` (a few calls, not all offsets)."""
    if char >= text_length:
        return n_tokens
    for pos in range(char, min(char + lookahead, text_length)):
        token = encoding.char_to_token(pos)
        if token is not None:
            return token if encoding.token_to_chars(token)[0] >= char else token + 1
    return None


def _fit(ids, labels, plan: EncodePlan, label: str, line: int, result: ChunkResult):
    """Apply --truncation to a document longer than --max-length."""
    if len(ids) <= plan.max_length:
        return ids, labels
    if plan.truncation == "error":
        raise DataError(
            f"{label}:{line}: document has {len(ids)} tokens, more than --max-length {plan.max_length} "
            "(--truncation error). Fix: raise --max-length, or use --truncation drop|truncate."
        )
    if plan.truncation == "truncate":
        result.truncated += 1
        return ids[: plan.max_length], labels[: plan.max_length]
    _drop(result, label, line, "too_long", f"{len(ids)} tokens > --max-length {plan.max_length}")
    return None, None
