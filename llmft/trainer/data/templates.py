"""Chat templates and assistant-only loss masking.

Each assistant reply is located inside its own turn by rendering, never by searching the
rendered text for the reply (a reply such as ``a`` or ``assistant`` also occurs in the
template's own headers). :class:`ReplyLocator` does it in two steps:

1. Layout (no extra render for an ordinary row): a conversation with the same roles and every
   content replaced by a unique sentinel of Unicode private-use characters is rendered once per
   role sequence and kept. Cut at the sentinels, it gives the template text around each message;
   the real rendering must equal that text with the real contents in place of the sentinels,
   character for character. Then each reply lies exactly where its sentinel was. When it does
   not, the same check runs on a render of this conversation with only its replies replaced.
2. Difference (one render per assistant turn), when the template rewrites a content or
   renders a turn differently depending on it (Qwen3 drops reasoning from earlier turns,
   writes a ``<think>`` block only into the last one, strips a leading newline; GLM-4 skips an
   empty message): the conversation is rendered with only that turn's content replaced by a
   sentinel; what differs from the real rendering (longest common prefix and suffix) is that
   reply as the template renders it. Reasoning kept by the template is supervised from its
   ``<think>``; an empty think block the template inserts stays unsupervised.

Each located reply (plus the end-of-turn marker the template writes right after it, e.g.
``<|im_end|>``) is a supervised character span; it lies after its turn's header and never
starts or ends inside a special token. A reply the template renders as nothing gives an
empty span, which tokenization rejects by name (``empty_assistant_reply``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from llmft.trainer.data.template_limits import render_deadline, render_probe
from llmft.trainer.errors import DataError

# Fallback templates for tokenizers without their own (``--chat-template NAME``).
FALLBACK_TEMPLATES = {
    "chatml": (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
}
_PROBE_USER = "llmft probe question"
_PROBE_ANSWER = "llmft probe answer 7f3a"
_MAX_END_OF_TURN = 32
# Whitespace, then a tag such as <|im_end|>, </s>, <|eot_id|>, <end_of_turn> or <|EOT|>.
_END_TAG = re.compile(r"[ \t]*\n?[ \t]*<[^\s<>]{1,30}>")
# Sentinel characters: Unicode private use, which no template writes.
_MARKS = tuple(chr(c) for c in range(0xE000, 0xE100))
_THINK_OPEN = re.compile(r"<think>\s*$")
_MISSING = object()
_MAX_LAYOUTS = 1024  # role sequences whose layout a locator keeps


class TemplateMismatch(Exception):
    """An assistant reply cannot be located inside its own turn of the rendered chat."""


class ReplySpan(NamedTuple):
    """Where one assistant reply lies in the rendered text (character offsets)."""

    message: int  # index of the assistant message in the conversation
    start: int  # first character of the reply as the template renders it
    end: int  # one past its last character (== start: the template renders nothing)
    stop: int  # ``end`` plus the end-of-turn marker written right after the reply


def resolve_chat_template(tokenizer, fallback: str | None) -> tuple[str | None, str]:
    """(template, where it came from). The tokenizer's own template wins; ``fallback`` is
    a name from FALLBACK_TEMPLATES, a path to a .jinja file, or Jinja text."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: use the default one
        own = own.get("default")
    if own:
        return own, "tokenizer"
    if not fallback:
        return None, "none"
    if fallback in FALLBACK_TEMPLATES:
        return FALLBACK_TEMPLATES[fallback], f"fallback:{fallback}"
    path = Path(fallback)
    if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
        if not path.is_file():
            raise DataError(f"--chat-template {fallback}: no such file")
        return path.read_text(encoding="utf-8"), f"fallback:{path.name}"
    if "{%" in fallback or "{{" in fallback:
        return fallback, "fallback:inline"
    raise DataError(
        f"--chat-template {fallback!r} is neither a known name ({', '.join(FALLBACK_TEMPLATES)}), "
        "a .jinja file, nor Jinja text"
    )


def missing_template_error(model: str) -> DataError:
    return DataError(
        f"tokenizer of {model!r} has no chat template and the data has conversational rows. "
        f"Fix: pass --chat-template with one of {', '.join(FALLBACK_TEMPLATES)} or a .jinja file "
        "(the same template must then be used when serving), or prepare the data as plain text."
    )


def template_hash(template: str | None) -> str:
    return hashlib.sha256((template or "").encode()).hexdigest()


def render(tokenizer, template: str, messages: list[dict]) -> str:
    """One conversation, as ``apply_chat_template(tokenize=False)``; TemplateTooSlow past the time bound."""
    with render_deadline() as restart:
        restart()
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)


def render_batch(tokenizer, template: str, conversations: list[list[dict]]) -> list[str]:
    """Render many conversations, each within the time bound."""
    return [render(tokenizer, template, messages) for messages in conversations]


def batch_renderer(tokenizer, template: str):
    """A function rendering many conversations; what ``apply_chat_template(tokenize=False)``
    renders, minus its per-call argument handling (3x less time per row).

    Uses transformers' compiled-template cache (the same Jinja sandbox and globals as
    ``apply_chat_template``); falls back to the public call if that internal moves. Tests
    check that the ids equal ``apply_chat_template(..., tokenize=True)`` row for row."""
    try:
        # heavy: transformers
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except (ImportError, AttributeError, TypeError):
        return lambda conversations: render_batch(tokenizer, template, conversations)
    context = dict(tokenizer.special_tokens_map)

    def render_many(conversations: list[list[dict]]) -> list[str]:
        texts = []
        with render_deadline() as restart:  # each conversation within the time bound (TemplateTooSlow)
            for c in conversations:
                restart()
                texts.append(
                    compiled.render(messages=c, tools=None, documents=None, add_generation_prompt=False, **context)
                )
        return texts

    return render_many


def end_of_turn_marker(tokenizer, template: str) -> str:
    """The text a template writes right after an assistant message (``<|im_end|>``,
    ``<|eot_id|>``, `` </s>``, ``\\n<|EOT|>``, ...), found by rendering a probe conversation.
    Supervised so the model learns to stop. Empty when the template writes nothing there
    (GLM-4: the next turn's header follows the reply directly)."""
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = render_probe(tokenizer, template, probe)  # bounded in time and size: the first render of a template
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        return ""
    tail = text[at + len(_PROBE_ANSWER) :]
    tag = _END_TAG.match(tail)
    if tag:
        return tag.group(0)
    marker = tail.lstrip(" \t").split("\n", 1)[0].strip()
    return marker if len(marker) <= _MAX_END_OF_TURN else ""


def special_token_texts(tokenizer) -> list[str]:
    """The special tokens of ``tokenizer`` (what a reply span must never cut through)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return sorted((t for t in texts if t), key=len, reverse=True)


class ReplyLocator:
    """Locates each assistant reply of a conversation in its rendered text (see the module
    docstring). One per chat template and tokenizer: keeps the renderer, the end-of-turn
    marker and a pattern of the special tokens."""

    def __init__(self, render_many: Callable, end_of_turn: str, special_tokens: Iterable[str] = ()):
        self._render_many = render_many
        self.end_of_turn = end_of_turn
        texts = [t for t in special_tokens if t]
        self._special = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._special_len = max((len(t) for t in texts), default=0)
        self._layouts: dict[tuple, object] = {}  # role sequence -> layout (see _shared_layout)

    def locate(self, text: str, messages: list[dict]) -> list[ReplySpan]:
        """One span per assistant message, in order. Raises TemplateMismatch when a reply
        cannot be tied to its own turn."""
        replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not replies:
            return []
        spans = self._by_layout(text, messages, self._shared_layout(messages))
        if spans is None:
            mark = _free_mark(text, messages)
            spans = self._by_layout(text, messages, self._layout(messages, replies, mark))
            if spans is None:
                spans = [self._by_difference(text, messages, i, mark) for i in replies]
        return self._checked(text, spans)

    def _render(self, messages: list[dict]) -> str | None:
        try:
            return self._render_many([messages])[0]
        except Exception:  # noqa: BLE001 - a template may raise on anything; the caller falls back
            return None

    def _shared_layout(self, messages: list[dict]):
        """The layout of a conversation with these roles and every content a sentinel: one render
        per role sequence (kept), so an ordinary row costs no render beyond its own."""
        key = tuple(m.get("role") for m in messages)
        layout = self._layouts.get(key, _MISSING)
        if layout is _MISSING:
            layout = self._layout(messages, range(len(messages)), _MARKS[0])
            if len(self._layouts) < _MAX_LAYOUTS:
                self._layouts[key] = layout
        return layout

    def _layout(self, messages: list[dict], replaced, mark: str):
        """(indices of the ``replaced`` messages in rendered order, the template text before, between
        and after them), from a render where their contents are sentinels; None when a sentinel is
        not rendered exactly once, verbatim."""
        sentinels = {i: f"{mark}{i}{mark}" for i in replaced}
        skeleton = self._render(
            [dict(m, content=sentinels[i]) if i in sentinels else m for i, m in enumerate(messages)]
        )
        if skeleton is None:
            return None
        found = []
        for i, sentinel in sentinels.items():
            at = skeleton.find(sentinel)
            if at < 0 or skeleton.find(sentinel, at + 1) >= 0:
                return None
            found.append((at, i))
        order, pieces, pos = [], [], 0
        for at, i in sorted(found):
            pieces.append(skeleton[pos:at])
            order.append(i)
            pos = at + len(sentinels[i])
        pieces.append(skeleton[pos:])
        return None if any(mark in piece for piece in pieces) else (order, pieces)

    def _by_layout(self, text: str, messages: list[dict], layout) -> list[ReplySpan] | None:
        """Spans when ``text`` is the layout with the real contents in place of the sentinels,
        character for character; else None."""
        if layout is None:
            return None
        order, pieces = layout
        parts, found, pos = [pieces[0]], [], len(pieces[0])
        for i, piece in zip(order, pieces[1:], strict=True):
            content = messages[i].get("content") or ""
            if messages[i].get("role") == "assistant":
                found.append((i, pos, pos + len(content)))
            parts += (content, piece)
            pos += len(content) + len(piece)
        if pos != len(text) or "".join(parts) != text:
            return None
        return [self._span(text, i, start, end) for i, start, end in found]

    def _by_difference(self, text: str, messages: list[dict], index: int, mark: str) -> ReplySpan:
        """The part of ``text`` that changes when only message ``index``'s content is replaced."""
        other = self._render([dict(m, content=mark) if i == index else m for i, m in enumerate(messages)])
        if other is None:
            raise TemplateMismatch(f"assistant message {index}: the template fails when its content changes")
        start = _common_prefix(text, other)
        tail = _common_suffix(text, other, min(len(text), len(other)) - start)
        end, other_end = len(text) - tail, len(other) - tail
        changed = other[start:other_end]
        if changed.count(mark) != 1:
            raise TemplateMismatch(f"assistant message {index}: the template does not render it in one place")
        if start < end and self._special is not None and self._special.search(changed.replace(mark, "")):
            raise TemplateMismatch(f"assistant message {index}: the template renders other turns differently with it")
        if "</think>" in text[start:end]:  # reasoning the template kept: supervised from its <think>
            opening = _THINK_OPEN.search(text, max(0, start - 64), start)
            start = opening.start() if opening else start
        return self._span(text, index, start, end)

    def _span(self, text: str, index: int, start: int, end: int) -> ReplySpan:
        stop = end + len(self.end_of_turn) if self.end_of_turn and text.startswith(self.end_of_turn, end) else end
        return ReplySpan(index, start, end, stop)

    def _checked(self, text: str, spans: list[ReplySpan]) -> list[ReplySpan]:
        previous = 0
        for span in spans:
            if span.start < previous:
                raise TemplateMismatch(f"assistant message {span.message} overlaps the turn before it")
            for at in (span.start, span.end, span.stop):
                if self._inside_special(text, at):
                    raise TemplateMismatch(f"assistant message {span.message}: its span would cut a special token")
            previous = span.stop
        return spans

    def _inside_special(self, text: str, at: int) -> bool:
        if self._special is None or at <= 0 or at >= len(text):
            return False
        lo, hi = max(0, at - self._special_len + 1), min(len(text), at + self._special_len - 1)
        return any(m.start() < at < m.end() for m in self._special.finditer(text, lo, hi))


def _free_mark(text: str, messages: list[dict]) -> str:
    """A private-use character found neither in the rendered text nor in any content."""
    contents = [m.get("content") or "" for m in messages]
    for mark in _MARKS:
        if mark not in text and not any(mark in c for c in contents):
            return mark
    raise TemplateMismatch("the conversation uses every sentinel character (U+E000-U+E0FF)")


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    """Length of the longest common suffix, at most ``limit``."""
    lo, hi = 0, max(0, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo
