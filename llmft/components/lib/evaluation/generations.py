"""Answers of several models to one fixed prompt set, for people to compare side by side.

The evaluate step (when Langfuse is configured, see llmft/components/lib/evaluation/comparison.py) takes the first
``PROMPT_SET_SIZE`` conversations of the validation split (:func:`prompt_set`: the conversation minus
its last assistant turn is the prompt, that turn the reference answer), renders each with the chat
template the data was tokenized with, and lets each model answer greedily with at most
``MAX_NEW_TOKENS`` new tokens (:func:`generate_answers`). ``exact_match`` scores an answer only
where the reference is short (a label, a number, a name): a long free-text reference has no single
right wording.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmft.trainer.tokenizer import load_tokenizer

PROMPT_SET_SIZE = 16
"""Prompts per comparison: enough to see a difference, few enough to read (and to generate on one GPU in seconds)."""
MAX_NEW_TOKENS = 128
"""New tokens per answer (greedy)."""
SHORT_REFERENCE_CHARS = 64
"""Exact match is scored only for references up to this many characters."""
GENERATION_BATCH = 8


@dataclass(frozen=True)
class Prompt:
    """One conversation of the validation split, without its answer."""

    id: str
    """Stable across runs: a hash of the prompt messages."""
    messages: list
    reference: str
    """The last assistant turn of the conversation."""


def prompt_set(prepared_dir: str | Path, size: int = PROMPT_SET_SIZE, split: str = "val") -> list[Prompt]:
    """The first ``size`` conversations of ``<prepared_dir>/<split>.jsonl`` that end in an assistant turn."""
    path = Path(prepared_dir) / f"{split}.jsonl"
    prompts: list[Prompt] = []
    if not path.is_file():
        return prompts
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if len(prompts) >= size:
                break
            messages = (json.loads(line) if line.strip() else {}).get("messages")
            if not messages or messages[-1].get("role") != "assistant":
                continue  # a plain-text row has no prompt to answer
            prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
            digest = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]
            prompts.append(Prompt(digest, prompt, messages[-1]["content"]))
    return prompts


def normalize(text: str) -> str:
    """Case-folded, whitespace collapsed, trailing punctuation dropped."""
    return re.sub(r"\s+", " ", text).strip().rstrip(".!?;:,").strip().casefold()


def exact_match(answer: str, reference: str) -> float | None:
    """1.0 or 0.0 when ``reference`` is short enough to match exactly; None otherwise (not scored)."""
    if len(reference.strip()) > SHORT_REFERENCE_CHARS:
        return None
    return float(normalize(answer) == normalize(reference))


def generation_tokenizer(base_model: str, tokenized: dict):
    """The tokenizer the data was tokenized with, read as the trainer reads it
    (:func:`llmft.trainer.tokenizer.load_tokenizer`): ``base_model`` at the ``revision`` and with the
    ``chat_template`` of ``tokenized`` (the tokenized dataset's manifest.json), ready for batched
    generation: padding on the left, with EOS as the pad token when it has none."""
    tokenizer = load_tokenizer(base_model, tokenized.get("revision"), chat_template=tokenized.get("chat_template"))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


class Asked(Protocol):
    """What :func:`generate_answers` reads of a prompt: a :class:`Prompt` or a task_eval.Question."""

    @property
    def messages(self) -> list: ...


def generate_answers(
    model, tokenizer, prompts: Sequence[Asked], *, max_new_tokens: int = MAX_NEW_TOKENS, end_of_turn: str | None = None
) -> list[str]:
    """Greedy answers, in the order of ``prompts``; generation stops at EOS or ``end_of_turn``."""
    import torch  # heavy: torch

    stop = [tokenizer.eos_token_id]
    if end_of_turn and end_of_turn in tokenizer.get_vocab():
        stop.append(tokenizer.convert_tokens_to_ids(end_of_turn))
    device = next(model.parameters()).device
    answers: list[str] = []
    for start in range(0, len(prompts), GENERATION_BATCH):
        batch = prompts[start : start + GENERATION_BATCH]
        texts = [tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in batch]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            output = model.generate(
                **encoded,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=[i for i in stop if i is not None],
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        answers += [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
    return answers
