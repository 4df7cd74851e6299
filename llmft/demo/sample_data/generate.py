"""Regenerate the shipped sample datasets (deterministic):

    python -m llmft.demo.sample_data.generate

Rows use the word lists the tiny tokenizer is trained on (llmft/trainer/tiny_model.py),
so the tiny model tokenizes them compactly and can learn their patterns in a
few dozen steps: fixed question/answer pairs, and small tasks whose answer is
read off the input (repeat a sentence, name its subject, verb or number).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmft.trainer.tiny_model import _ANSWERS, _OBJECTS, _QUESTIONS, _SUBJECTS, _TAILS, _VERBS

HERE = Path(__file__).resolve().parent
ALPACA_ROWS = 500
CHAT_ROWS = 60
# (1-based line, raw text) of deliberately broken rows in alpaca_demo.jsonl: 3 of 503 = 0.6% < 1%.
BAD_ALPACA_LINES = {
    57: '{"instruction": "Repeat the sentence.", "input": "The model trains the question quickly. 12", "output": ',
    213: json.dumps({"instruction": "What is two plus two?", "input": "", "output": "  "}),
    388: json.dumps({"input": "The pipeline packs the recipe with care. 7", "output": "The pipeline."}),
}
SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer in one short sentence.",
    "You are the pipeline assistant. Be brief and exact.",
)


def _sentence(rng: random.Random) -> tuple[str, str, str, int]:
    subject, verb = rng.choice(_SUBJECTS), rng.choice(_VERBS)
    number = rng.randint(0, 999)
    text = f"{subject} {verb} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)} {number}"
    return text[0].upper() + text[1:], subject, verb, number


def _task(rng: random.Random) -> tuple[str, str, str]:
    """(instruction, input, output) of one small read-off task."""
    text, subject, verb, number = _sentence(rng)
    kind = rng.randrange(4)
    if kind == 0:
        return "Repeat the sentence.", text, text
    if kind == 1:
        return "Who does the action in this sentence?", text, subject[0].upper() + subject[1:] + "."
    if kind == 2:
        return "What is the verb in this sentence?", text, verb.capitalize() + "."
    return "What number ends this sentence?", text, f"{number}."


def alpaca_rows(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for i in range(ALPACA_ROWS):
        if i % 10 == 0:
            q = rng.randrange(len(_QUESTIONS))
            row = {"instruction": _QUESTIONS[q], "input": "", "output": _ANSWERS[q]}
        else:
            instruction, text, output = _task(rng)
            row = {"instruction": instruction, "input": text, "output": output}
        rows.append(json.dumps(row))
    for line in sorted(BAD_ALPACA_LINES):
        rows.insert(line - 1, BAD_ALPACA_LINES[line])
    return rows


def chat_rows(seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for i in range(CHAT_ROWS):
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[i % 2]}] if i % 3 else []
        for _turn in range(rng.randint(2, 3)):
            if rng.random() < 0.4:
                q = rng.randrange(len(_QUESTIONS))
                user, answer = _QUESTIONS[q], _ANSWERS[q]
            else:
                instruction, text, answer = _task(rng)
                user = f"{instruction}\n\n{text}"
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append(json.dumps({"messages": messages}))
    return rows


def main() -> None:
    (HERE / "alpaca_demo.jsonl").write_text("\n".join(alpaca_rows()) + "\n")
    (HERE / "chat_demo.jsonl").write_text("\n".join(chat_rows()) + "\n")


if __name__ == "__main__":
    main()
