"""Row formats accepted by ``llmft data prepare`` and their conversion to the
canonical schema.

Accepted input rows (one JSON object each):

- ``messages``          ``{"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}``
- ``sharegpt``          ``{"conversations": [{"from": "system|human|gpt", "value": "..."}, ...]}``
- ``alpaca``            ``{"instruction": "...", "input": "...", "output": "..."}`` (``input``, ``system`` optional)
- ``prompt_completion`` ``{"prompt": "...", "completion": "..."}`` (strings, or TRL-style lists of messages)
- ``text``              ``{"text": "..."}``

Canonical rows: ``{"messages": [{"role", "content"}, ...]}`` for every
conversational format, ``{"text": "..."}`` for plain text. A row that breaks its
format raises :class:`RowReject` with a reason from :data:`REJECT_FIXES`.

Conversation structure (:func:`check_structure`), the shape every common chat template
renders and the strict ones (Llama 2, Mistral, Gemma: "roles must alternate") demand:

1. at most one system message, and only as the first message (``misplaced_system``);
2. then a user turn first: an assistant never opens the conversation (``assistant_first``);
3. user and assistant turns alternate (``roles_not_alternating``: two users or two
   assistants in a row);
4. the last message is an assistant turn, the answer the model learns
   (``last_turn_not_assistant``).
"""

from __future__ import annotations

import re
from typing import Any

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
FORMAT_CHOICES = ("auto", *FORMATS)

# reason -> how to fix it (shown in error messages and rejects.jsonl)
REJECT_FIXES: dict[str, str] = {
    "invalid_json": "make the line one complete JSON object (JSON Lines: one object per line)",
    "not_utf8": "re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`): JSON Lines is UTF-8 text",
    "wrong_type": (
        "give the field the documented type (messages: list of {role, content} objects; other fields: strings)"
    ),
    "missing_field": "add the field, or pass --format to pick the format the rows are written in",
    "unknown_role": "use the roles system/user/assistant (ShareGPT: system/human/gpt)",
    "empty_assistant_content": "give every assistant turn non-empty content, or drop the turn",
    "no_assistant_turn": "add at least one assistant turn: it is what the model learns to produce",
    "empty_conversation": "give the row at least one user and one assistant message",
    "empty_prompt": "give the instruction/prompt some text",
    "empty_text": "give the text field some text, or drop the row",
    "duplicate_key": "write each key once per object: JSON keeps only the last value, so merge them or drop one",
    "too_deep": "flatten the row: no chat row needs lists or objects nested hundreds of levels deep",
    "row_too_large": "split the row into smaller conversations, or raise --max-row-bytes if such rows are intended",
    "misplaced_system": "keep one system message, as the first message (merge several into one)",
    "assistant_first": "start with a user turn (after an optional system message): an assistant turn answers it",
    "roles_not_alternating": "alternate user and assistant turns: merge consecutive turns of the same role",
    "last_turn_not_assistant": "end the conversation with the assistant's answer: drop the trailing turns",
}

# Accepted role names (lower-cased) -> canonical role. Covers OpenAI, ShareGPT and Gemma names.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}

# Which keys make ``auto`` pick which format (first match wins).
_DETECT_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("messages", ("messages",)),
    ("sharegpt", ("conversations",)),
    ("alpaca", ("instruction", "output")),
    ("prompt_completion", ("prompt", "completion")),
    ("text", ("text",)),
)
_EXPECTED = "one of: messages, conversations, instruction+output, prompt+completion, text"


# The end of a key: a quote, JSON whitespace, a colon. Inside a string a quote is always escaped (\"), so
# every key of a line matches once and a string only adds matches.
_KEY_END = re.compile(rb'"[ \t\r\n]*:')


class RowReject(Exception):
    """A row that cannot be used: ``reason`` (a key of REJECT_FIXES), ``field``, ``detail``."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.field = field
        self.detail = detail

    @property
    def fix(self) -> str:
        return REJECT_FIXES[self.reason]


def may_repeat_a_key(raw: bytes, value: Any) -> bool:
    """False when no object of the line ``raw`` (parsed: ``value``) can hold a key twice: the line has no
    more key ends than ``value`` has keys. Parsers keep the last of two equal keys silently."""
    keys, stack = 0, [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            keys += len(item)
            item = item.values()
        stack.extend([child for child in item if type(child) is dict or type(child) is list])
    return raw.count(b":") > keys and len(_KEY_END.findall(raw)) > keys  # every key has one colon after it


def deeper_than(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists and objects more than ``limit`` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return False


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` object_pairs_hook: RowReject(duplicate_key) naming the first key written twice."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise RowReject(
                "duplicate_key", key, f"key `{key}` appears twice in one object; JSON would keep the last silently"
            )
        seen.add(key)
    return dict(pairs)


def detect_format(row: dict) -> str:
    """The format whose keys ``row`` carries; RowReject(missing_field) when none."""
    for name, keys in _DETECT_KEYS:
        if any(k in row for k in keys):
            return name
    found = ", ".join(sorted(map(str, row))[:8]) or "no keys"
    raise RowReject("missing_field", "<row>", f"row matches no known format (keys: {found}); expected {_EXPECTED}")


def convert_row(row: Any, fmt: str = "auto") -> tuple[str, dict]:
    """Validate one parsed row; return (format, canonical row) or raise RowReject."""
    if not isinstance(row, dict):
        raise RowReject("wrong_type", "<row>", f"row must be a JSON object, got {_type_name(row)}")
    if fmt == "auto":
        fmt = detect_format(row)
    converter = _CONVERTERS.get(fmt)
    if converter is None:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")
    return fmt, converter(row)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _require(row: dict, field: str, fmt: str) -> Any:
    if field not in row or row[field] is None:
        raise RowReject("missing_field", field, f"{fmt} row has no `{field}` field")
    return row[field]


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RowReject("wrong_type", field, f"`{field}` must be a string, got {_type_name(value)}")
    return value


def _content_text(value: Any, field: str) -> str:
    """Message content: a string, or OpenAI-style text parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise RowReject(
        "wrong_type", field, f"`{field}` must be a string (or a list of text parts), got {_type_name(value)}"
    )


def _message(item: Any, field: str) -> dict:
    if not isinstance(item, dict):
        raise RowReject(
            "wrong_type", field, f"`{field}` must be an object with role and content, got {_type_name(item)}"
        )
    role_key, content_key = ("role", "content") if "role" in item or "content" in item else ("from", "value")
    for key in (role_key, content_key):
        if key not in item:
            raise RowReject("missing_field", f"{field}.{key}", f"message `{field}` has no `{key}`")
    role_raw = item[role_key]
    if not isinstance(role_raw, str):
        raise RowReject(
            "wrong_type", f"{field}.{role_key}", f"`{field}.{role_key}` must be a string, got {_type_name(role_raw)}"
        )
    role = ROLE_ALIASES.get(role_raw.strip().lower())
    if role is None:
        raise RowReject(
            "unknown_role",
            f"{field}.{role_key}",
            f"unknown role {role_raw!r} in `{field}`; accepted: {', '.join(sorted(ROLE_ALIASES))}",
        )
    content = item[content_key]
    if content is None and role == "assistant":
        content = ""
    return {"role": role, "content": _content_text(content, f"{field}.{content_key}")}


def canonical_messages(value: Any, field: str, *, structure: bool = True) -> list[dict]:
    """Validate a list of messages; return ``[{"role", "content"}, ...]``. With ``structure``, the
    order of roles is checked too (:func:`check_structure`)."""
    if not isinstance(value, list):
        raise RowReject("wrong_type", field, f"`{field}` must be a list of messages, got {_type_name(value)}")
    if not value:
        raise RowReject("empty_conversation", field, f"`{field}` is an empty list")
    messages = [_message(item, f"{field}[{i}]") for i, item in enumerate(value)]
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant" and not msg["content"].strip():
            raise RowReject("empty_assistant_content", f"{field}[{i}].content", f"assistant turn {field}[{i}] is empty")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowReject("no_assistant_turn", field, f"`{field}` has no assistant turn ({len(messages)} messages)")
    if structure:
        role_key = "role" if any("role" in item or "content" in item for item in value) else "from"
        check_structure(messages, field, role_key)
    return messages


def check_structure(messages: list[dict], field: str, role_key: str = "role") -> None:
    """Raise RowReject unless ``messages`` is [system], user, assistant, user, assistant, ..., assistant."""

    def at(i: int) -> str:
        return f"{field}[{i}].{role_key}"

    for i, msg in enumerate(messages):
        if msg["role"] == "system" and i > 0:
            where = "after the last turn" if i == len(messages) - 1 else f"at position {i}"
            raise RowReject("misplaced_system", at(i), f"system message {where}; only the first message may be one")
    first = 1 if messages[0]["role"] == "system" else 0
    if first < len(messages) and messages[first]["role"] == "assistant":
        raise RowReject("assistant_first", at(first), "the conversation opens with an assistant turn, not a user one")
    for i in range(first + 1, len(messages)):
        if messages[i]["role"] == messages[i - 1]["role"]:
            raise RowReject(
                "roles_not_alternating",
                at(i),
                f"two {messages[i]['role']} turns in a row ({field}[{i - 1}] and {field}[{i}])",
            )
    if messages[-1]["role"] != "assistant":
        raise RowReject(
            "last_turn_not_assistant",
            at(len(messages) - 1),
            f"the conversation ends with a {messages[-1]['role']} turn that no assistant turn answers",
        )


def _from_messages(row: dict) -> dict:
    return {"messages": canonical_messages(_require(row, "messages", "messages"), "messages")}


def _from_sharegpt(row: dict) -> dict:
    return {"messages": canonical_messages(_require(row, "conversations", "sharegpt"), "conversations")}


def _from_alpaca(row: dict) -> dict:
    instruction = _string(_require(row, "instruction", "alpaca"), "instruction")
    output = _string(_require(row, "output", "alpaca"), "output")
    extra = row.get("input")
    extra = "" if extra is None else _string(extra, "input")
    if not instruction.strip():
        raise RowReject("empty_prompt", "instruction", "`instruction` is empty")
    if not output.strip():
        raise RowReject("empty_assistant_content", "output", "`output` (the assistant answer) is empty")
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    system = row.get("system")
    if system is not None and _string(system, "system").strip():
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def _from_prompt_completion(row: dict) -> dict:
    prompt = _require(row, "prompt", "prompt_completion")
    completion = _require(row, "completion", "prompt_completion")
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL conversational prompt/completion
        canonical_messages(completion, "completion", structure=False)  # it must hold the assistant turn
        return {"messages": canonical_messages(prompt + completion, "prompt+completion")}
    prompt, completion = _string(prompt, "prompt"), _string(completion, "completion")
    if not prompt.strip():
        raise RowReject("empty_prompt", "prompt", "`prompt` is empty")
    if not completion.strip():
        raise RowReject("empty_assistant_content", "completion", "`completion` is empty")
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}


def _from_text(row: dict) -> dict:
    text = _string(_require(row, "text", "text"), "text")
    if not text.strip():
        raise RowReject("empty_text", "text", "`text` is empty")
    return {"text": text}


_CONVERTERS = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
    "prompt_completion": _from_prompt_completion,
    "text": _from_text,
}
