"""Worker side of ``llmft data tokenize``: one chunk of canonical JSONL rows ->
token ids, unshifted labels (-100 outside assistant turns) and document lengths.

Runs in each worker process of the pool (or inline with one process). A chunk's
conversations are rendered with the chat template, each assistant reply is located in
its own turn (:class:`llmft.trainer.data.templates.ReplyLocator`), and the chunk is
tokenized in one fast-tokenizer batch.

Split at the reply boundaries: every rendered conversation is cut into pieces (prompt,
reply, end-of-turn marker, prompt, ...) and each piece is tokenized on its own, so no
token straddles a reply boundary and the supervised tokens decode to exactly the replies.
Where a boundary is an ordinary token boundary this gives the same ids as tokenizing the
whole text; where it is not (a reply starting with a newline after a header ending in
one) the reply is tokenized as the model generates it after the header. A probe checks
this per tokenizer (:func:`pieces_encode_alone`); a tokenizer that tokenizes a piece
differently on its own (SentencePiece-style prefix space) tokenizes the whole text and
supervises every token overlapping a reply instead.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from llmft.trainer.data.shards import IGNORE_INDEX
from llmft.trainer.data.template_limits import TemplateTooSlow
from llmft.trainer.data.templates import (
    ReplyLocator,
    ReplySpan,
    TemplateMismatch,
    batch_renderer,
    render,
    special_token_texts,
)
from llmft.trainer.errors import DataError

try:  # optional fast path; identical results
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads  # type: ignore[assignment]  # same use: text or bytes in, objects out

MAX_EXAMPLES = 10
_PROBE_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
# With a system message, and without for templates that refuse one (Gemma raises on it).
_PROBE_CHATS = ([{"role": "system", "content": "You are a helpful assistant."}, *_PROBE_TURNS], _PROBE_TURNS)


@dataclass(frozen=True)
class EncodePlan:
    """Settings every worker needs (picklable)."""

    template: str | None  # chat template text; None when the data has no conversations
    end_of_turn: str  # supervised marker after each assistant message ("<|im_end|>")
    max_length: int  # longest document kept (tokens)
    truncation: str  # drop | truncate | error
    max_chars: int = 0  # a document with more characters cannot fit in max_length tokens (0: no bound)


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
    """Pool initializer: keep the tokenizer, plan, compiled chat template and reply locator in the
    worker's globals (built once per worker)."""
    _WORKER["tokenizer"] = tokenizer
    _WORKER["plan"] = plan
    _WORKER["render_many"] = batch_renderer(tokenizer, plan.template) if plan.template else None
    _WORKER["locator"] = None
    _WORKER["split"] = False
    if plan.template:
        locator = ReplyLocator(_WORKER["render_many"], plan.end_of_turn, special_token_texts(tokenizer))
        _WORKER["locator"] = locator
        _WORKER["split"] = pieces_encode_alone(tokenizer, locator)


def pieces_encode_alone(tokenizer, locator: ReplyLocator) -> bool:
    """Whether tokenizing a rendered conversation piece by piece (cut at its reply spans) gives
    the ids of tokenizing it whole, on probe conversations with ordinary replies."""
    backend = tokenizer.backend_tokenizer
    checked = 0
    for messages in _PROBE_CHATS:
        try:
            text = locator._render_many([messages])[0]
            spans = locator.locate(text, messages)
        except Exception:  # noqa: BLE001 - a template that cannot render this probe: try the next one
            continue
        whole = backend.encode(text, add_special_tokens=False).ids
        pieces = [backend.encode(p, add_special_tokens=False).ids for p, _kind, _turn in _pieces(text, spans)]
        if [i for ids in pieces for i in ids] != whole:
            return False
        checked += 1
    return checked > 0  # no probe rendered: keep the whole-text path


def encode_chunk(task: tuple[str, int, bytes]) -> ChunkResult:
    """Encode ``(file label, first line number, block of JSONL lines)`` with the worker's tokenizer and plan."""
    label, first_line, block = task
    lines = [(first_line + i, raw) for i, raw in enumerate(block.split(b"\n")) if raw.strip()]
    tokenizer, plan = _WORKER["tokenizer"], _WORKER["plan"]
    result = ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), rows=len(lines))
    docs = _drop_overlong(_render_rows(tokenizer, plan, label, lines, result), plan, label, result)
    ids_parts, label_parts, lengths = [], [], []
    for line, ids, labels, empty_turn in _tokenize_docs(tokenizer, docs):
        if empty_turn is not None:
            _drop(result, label, line, "empty_assistant_reply", _empty_reply_detail(*empty_turn))
            continue
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


def _drop_overlong(docs: list[tuple], plan: EncodePlan, label: str, result: ChunkResult) -> list[tuple]:
    """Drop (or, with --truncation error, refuse) documents too long by characters alone, before
    tokenizing them: a huge row costs a length check, not a tokenizer pass. --truncation truncate
    tokenizes them, since it keeps their first max_length tokens."""
    if not plan.max_chars or plan.truncation == "truncate":
        return docs
    kept = []
    for doc in docs:
        line, chars = doc[0], len(doc[2])
        if chars <= plan.max_chars:
            kept.append(doc)
            continue
        detail = f"{chars:,} characters: more than --max-length {plan.max_length} tokens can hold"
        if plan.truncation == "error":
            raise DataError(
                f"{label}:{line}: document has {detail} (--truncation error). "
                "Fix: raise --max-length, or use --truncation drop|truncate."
            )
        _drop(result, label, line, "too_long", detail)
    return kept


def _empty_reply_detail(turn: int, message: int) -> str:
    return (
        f"assistant turn {turn} (message {message}) maps to zero tokens: the chat template renders its reply "
        "as nothing. Fix: give that turn a non-empty reply, or drop the row"
    )


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
            docs.append((line, "chat", text, _WORKER["locator"].locate(text, payload)))
        except TemplateMismatch as exc:
            _drop(result, label, line, "template_mismatch", f"{exc}; check the chat template")
    return docs


def _render_all(tokenizer, plan: EncodePlan, label: str, chats: list, result: ChunkResult) -> list[str | None]:
    if not chats or plan.template is None:  # the caller refused chats without a template
        return []
    try:
        return _WORKER["render_many"]([c[2] for c in chats])
    except TemplateTooSlow as exc:  # the template, not a row: one line for the whole run
        raise TemplateTooSlow(f"the chat template {exc} (at {label}:{chats[0][0]} or after)") from None
    except Exception:  # noqa: BLE001 - one bad row fails the batch: find it row by row
        pass
    texts: list[str | None] = []
    for line, _kind, messages in chats:
        try:
            texts.append(render(tokenizer, plan.template, messages))
        except TemplateTooSlow as exc:
            raise TemplateTooSlow(f"the chat template {exc} (at {label}:{line})") from None
        except Exception as exc:  # noqa: BLE001 - template raise_exception(...) and friends
            _drop(result, label, line, "template_error", f"chat template failed: {exc}")
            texts.append(None)
    return texts


def _tokenize_docs(tokenizer, docs: list[tuple]):
    """Yield (line, ids, labels, empty turn or None) per document: chats and texts in one batch each."""
    backend = tokenizer.backend_tokenizer
    chats = [d for d in docs if d[1] == "chat"]
    texts = [d for d in docs if d[1] == "text"]
    encoded = {}
    if chats:
        encode_chats = _encode_chats_in_pieces if _WORKER["split"] else _encode_chats_whole
        for doc, result in zip(chats, encode_chats(backend, chats), strict=True):
            encoded[doc[0]] = result
    if texts:
        eos = tokenizer.eos_token_id
        for doc, enc in zip(texts, backend.encode_batch([d[2] for d in texts], add_special_tokens=True), strict=True):
            ids = enc.ids + ([eos] if eos is not None and (not enc.ids or enc.ids[-1] != eos) else [])
            arr = np.asarray(ids, np.int32)
            encoded[doc[0]] = (arr, arr.copy(), None)
    for doc in docs:
        yield doc[0], *encoded[doc[0]]


_PROMPT, _REPLY, _END = 0, 1, 2


def _pieces(text: str, spans: list[ReplySpan]):
    """(piece, kind, turn) in text order: prompt, reply, end-of-turn marker, prompt, ... (empty pieces skipped,
    except a reply: an empty reply is reported, not skipped)."""
    cut = 0
    for turn, span in enumerate(spans, start=1):
        for piece, kind in ((text[cut : span.start], _PROMPT), (text[span.start : span.end], _REPLY)):
            if piece or kind == _REPLY:
                yield piece, kind, turn
        if span.stop > span.end:
            yield text[span.end : span.stop], _END, turn
        cut = span.stop
    if cut < len(text):
        yield text[cut:], _PROMPT, 0


def _encode_chats_in_pieces(backend, chats: list[tuple]) -> list[tuple]:
    """Tokenize every piece of every conversation in one batch; labels = ids on reply and marker pieces."""
    owners, pieces = [], []
    for index, (_line, _kind, text, spans) in enumerate(chats):
        for piece, kind, turn in _pieces(text, spans):
            owners.append((index, kind, turn))
            pieces.append(piece)
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets needed
    ids: list[list[int]] = [[] for _ in chats]
    labels: list[list[int]] = [[] for _ in chats]
    empty: list[tuple[int, str] | None] = [None] * len(chats)
    for (index, kind, turn), enc in zip(owners, encode(pieces, add_special_tokens=False), strict=True):
        piece_ids = enc.ids
        if kind == _REPLY and not piece_ids and empty[index] is None:
            empty[index] = (turn, chats[index][3][turn - 1].message)
        ids[index].extend(piece_ids)
        labels[index].extend(piece_ids if kind != _PROMPT else [IGNORE_INDEX] * len(piece_ids))
    return [
        (np.asarray(i, np.int32), np.asarray(lab, np.int32), e) for i, lab, e in zip(ids, labels, empty, strict=True)
    ]


def _encode_chats_whole(backend, chats: list[tuple]) -> list[tuple]:
    """Tokenize whole texts; supervise every token that overlaps a reply or its end-of-turn marker."""
    results = []
    for (_line, _kind, _text, spans), enc in zip(
        chats, backend.encode_batch([c[2] for c in chats], add_special_tokens=False), strict=True
    ):
        ids = np.asarray(enc.ids, np.int32)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        labels = np.full(len(ids), IGNORE_INDEX, np.int32)
        empty = None
        for turn, span in enumerate(spans, start=1):
            if not _overlapping(offsets, span.start, span.end).any() and empty is None:
                empty = (turn, span.message)
            inside = _overlapping(offsets, span.start, span.stop)
            labels[inside] = ids[inside]
        results.append((ids, labels, empty))
    return results


def _overlapping(offsets: np.ndarray, begin: int, end: int) -> np.ndarray:
    """Tokens whose characters overlap [begin, end) (a token without characters: by its position)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    return np.where(starts < ends, (starts < end) & (ends > begin), (starts >= begin) & (starts < end))


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
