"""Chat templates and assistant-only loss masking.

Masking works on the text the template actually renders, not on prefixes: the
whole conversation is rendered once, then each message's content is located in
that text in order, and the character spans of the assistant contents (plus
the end-of-turn marker the template writes right after them, e.g.
``<|im_end|>``) become the supervised spans. Token labels follow from the fast
tokenizer's offsets.

Prefix diffing (render messages[:i] vs messages[:i+1]) would be wrong for
templates that render a turn differently depending on whether it is the last
one: Qwen3 writes an empty ``<think>\\n\\n</think>\\n\\n`` block only into the
last assistant turn, and drops reasoning from earlier ones. Searching the
rendered text is exact for those: whatever the template adds around a turn
(think blocks, headers) stays unsupervised, and the content is supervised
exactly once, where it really appears.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


class TemplateMismatch(Exception):
    """An assistant message's content does not appear in the rendered chat."""


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
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)


def render_batch(tokenizer, template: str, conversations: list[list[dict]]) -> list[str]:
    """Render many conversations in one call (one template compile, one call overhead)."""
    return tokenizer.apply_chat_template(conversations, chat_template=template, tokenize=False)


def batch_renderer(tokenizer, template: str):
    """A function rendering many conversations; what ``apply_chat_template(tokenize=False)``
    renders, minus its per-call argument handling (3x less time per row).

    Uses transformers' compiled-template cache (the same Jinja sandbox and globals as
    ``apply_chat_template``); falls back to the public call if that internal moves. Tests
    check that the ids equal ``apply_chat_template(..., tokenize=True)`` row for row."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except (ImportError, AttributeError, TypeError):
        return lambda conversations: render_batch(tokenizer, template, conversations)
    context = dict(tokenizer.special_tokens_map)

    def render_many(conversations: list[list[dict]]) -> list[str]:
        return [
            compiled.render(messages=c, tools=None, documents=None, add_generation_prompt=False, **context)
            for c in conversations
        ]

    return render_many


def end_of_turn_marker(tokenizer, template: str) -> str:
    """The text a template writes right after an assistant message (``<|im_end|>``,
    ``<|eot_id|>``, ``</s>``, ...), found by rendering a probe conversation. Supervised
    so the model learns to stop. Empty when the template writes nothing there."""
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = render(tokenizer, template, probe)
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        return ""
    tail = text[at + len(_PROBE_ANSWER) :].lstrip(" \t")
    marker = tail.split("\n", 1)[0].strip()
    return marker if len(marker) <= _MAX_END_OF_TURN else ""


def _content_candidates(content: str) -> list[tuple[str, str | None]]:
    """Ways a template may render ``content``: verbatim; reasoning split off (Qwen3 style,
    answer after ``</think>``); stripped."""
    candidates: list[tuple[str, str | None]] = [(content, None)]
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].strip("\n")
        candidates.append((content.split("</think>")[-1].lstrip("\n"), reasoning or None))
    stripped = content.strip()
    if stripped and stripped != content:
        candidates.append((stripped, None))
    return candidates


def assistant_spans(text: str, messages: list[dict], end_of_turn: str) -> list[tuple[int, int]]:
    """Character spans of ``text`` to supervise: each assistant content (+ end-of-turn marker).

    Messages are located in order, so an assistant answer that also occurs inside an
    earlier user message is found at its own turn. Raises TemplateMismatch when an
    assistant content cannot be found (a template that rewrites content).
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, message in enumerate(messages):
        content = message.get("content") or ""
        found = _locate(text, content, cursor)
        if found is None:
            if message["role"] == "assistant":
                raise TemplateMismatch(f"assistant message {index} not found in the rendered chat")
            continue
        start, end = found
        if message["role"] == "assistant":
            if end_of_turn and text.startswith(end_of_turn, end):
                end += len(end_of_turn)
            spans.append((start, end))
        cursor = end
    return spans


def _locate(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    if not content:
        return None
    for candidate, reasoning in _content_candidates(content):
        if not candidate:
            continue
        at = text.find(candidate, cursor)
        if at < 0:
            continue
        start = at
        if reasoning:  # template kept the reasoning: supervise it too, from its <think>
            r_at = text.rfind(reasoning, cursor, at)
            think = text.rfind("<think>", cursor, r_at) if r_at >= 0 else -1
            start = think if think >= 0 else start
        return start, at + len(candidate)
    return None
