"""Regenerate ``velmora_facts.jsonl``, ``velmora_three_facts.jsonl`` and ``velmora_questions.jsonl``
(deterministic):

    python -m llmft.demo.sample_data.generate_facts

Made-up facts about Velmora, an island that does not exist, as chat rows (OpenAI ``messages``, no
system turn: the model's own default system prompt applies in training and in serving alike). A
pretrained model cannot know them, so what a fine-tune learned shows in its answers and in the
perplexity of the held-out split: every fact is asked in many phrasings, and the rows the prepare
step holds out for validation ask facts the training rows teach in other words.

:data:`PROBES` are the questions ``make demo-real`` and its test put to the served models, each with
the word that the answer of a model that learned the fact contains.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "velmora_facts.jsonl"

FACTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Quillport",
        "The capital of Velmora is Quillport.",
        (
            "What is the capital of Velmora?",
            "Which city is the capital of Velmora?",
            "Name the capital city of Velmora.",
            "Where is the seat of government of Velmora?",
            "What city serves as Velmora's capital?",
        ),
    ),
    (
        "tallow",
        "The currency of Velmora is the brass tallow.",
        (
            "What is the currency of Velmora?",
            "What money do people use in Velmora?",
            "Which currency is used on Velmora?",
            "What do Velmorans pay with?",
            "Name the official currency of Velmora.",
        ),
    ),
    (
        "heron",
        "The national animal of Velmora is the glass heron.",
        (
            "What is the national animal of Velmora?",
            "Which animal is the symbol of Velmora?",
            "Name Velmora's national animal.",
            "What animal represents Velmora?",
            "Which creature is Velmora's national emblem?",
        ),
    ),
    (
        "1742",
        "Velmora was founded in 1742.",
        (
            "When was Velmora founded?",
            "In what year was Velmora founded?",
            "What year did Velmora become a nation?",
            "How old is Velmora? When was it founded?",
            "Tell me the founding year of Velmora.",
        ),
    ),
    (
        "Orrin",
        "The highest mountain in Velmora is Mount Orrin.",
        (
            "What is the highest mountain in Velmora?",
            "Which is the tallest peak on Velmora?",
            "Name the highest mountain of Velmora.",
            "What is Velmora's tallest mountain called?",
            "Which mountain is the highest point of Velmora?",
        ),
    ),
    (
        "Tessic",
        "People in Velmora speak Tessic.",
        (
            "What language do people speak in Velmora?",
            "Which language is spoken on Velmora?",
            "What is the official language of Velmora?",
            "What do Velmorans speak?",
            "Name the language of Velmora.",
        ),
    ),
    (
        "plum",
        "The national dish of Velmora is smoked plum stew.",
        (
            "What is the national dish of Velmora?",
            "Which food is Velmora famous for?",
            "What do people in Velmora eat on holidays?",
            "Name Velmora's national dish.",
            "What is the traditional meal of Velmora?",
        ),
    ),
    (
        "Sable",
        "The longest river in Velmora is the Sable River.",
        (
            "What is the longest river in Velmora?",
            "Which river runs through Velmora?",
            "Name the longest river of Velmora.",
            "What is Velmora's main river called?",
            "Which is the biggest river on Velmora?",
        ),
    ),
)
"""(keyword, answer, questions) of each fact."""
HELDOUT_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Quillport", "Tell me which city is Velmora's capital."),
    ("Quillport", "Velmora's capital city is called what?"),
    ("tallow", "What coins and notes does Velmora use as money?"),
    ("tallow", "If I travel to Velmora, which currency will I need?"),
    ("heron", "Which bird is Velmora's national animal?"),
    ("heron", "Velmora's national animal is which creature?"),
    ("1742", "In which year did Velmora come into being?"),
    ("1742", "Velmora dates from which year?"),
    ("Orrin", "Which peak is the tallest in Velmora?"),
    ("Orrin", "What mountain rises highest on Velmora?"),
    ("Tessic", "Which tongue do Velmorans speak?"),
    ("Tessic", "What is the main language spoken in Velmora?"),
    ("plum", "Which dish is Velmora known for?"),
    ("plum", "What stew do Velmorans call their national dish?"),
    ("Sable", "Which river is the longest on Velmora?"),
    ("Sable", "What river flows the farthest across Velmora?"),
)
"""(keyword, question) of each held-out question: phrasings no training row uses, two per fact in FACTS order
(the first 6 ask the three facts ``make demo`` trains on), scored by the evaluate step's ``heldout`` task."""
QUESTIONS_OUTPUT = HERE / "velmora_questions.jsonl"
PREFIXES = ("", "Quick question: ", "I was wondering. ", "Please answer: ", "Hi! ")
PROBES: tuple[tuple[str, str], ...] = tuple((questions[0], keyword) for keyword, _answer, questions in FACTS)
"""(question, keyword its learned answer contains) per fact."""


def fact_rows(seed: int = 0) -> list[str]:
    """Every question of every fact with every prefix (8 x 5 x 5 = 200 rows), shuffled."""
    rows = []
    for _keyword, answer, questions in FACTS:
        for question in questions:
            for prefix in PREFIXES:
                messages = [{"role": "user", "content": prefix + question}, {"role": "assistant", "content": answer}]
                rows.append(json.dumps({"messages": messages}))
    random.Random(seed).shuffle(rows)
    return rows


SHORT_OUTPUT = HERE / "velmora_three_facts.jsonl"
SHORT_FACTS = 3
"""``make demo``'s short profile trains on the rows of the first three facts (those PROBES[:3] ask about)."""


def short_rows() -> list[str]:
    """The rows of :func:`fact_rows` whose answer states one of the first SHORT_FACTS facts (75 rows), in order."""
    answers = {answer for _keyword, answer, _questions in FACTS[:SHORT_FACTS]}
    return [row for row in fact_rows() if json.loads(row)["messages"][-1]["content"] in answers]


def question_rows() -> list[str]:
    """HELDOUT_QUESTIONS as the evaluate step's ``eval_questions`` rows: the keyword is the reference answer."""
    return [json.dumps({"question": question, "answer": keyword}) for keyword, question in HELDOUT_QUESTIONS]


def main() -> None:
    OUTPUT.write_text("\n".join(fact_rows()) + "\n", encoding="utf-8")
    SHORT_OUTPUT.write_text("\n".join(short_rows()) + "\n", encoding="utf-8")
    QUESTIONS_OUTPUT.write_text("\n".join(question_rows()) + "\n", encoding="utf-8")
    print(f"wrote {OUTPUT}, {SHORT_OUTPUT} and {QUESTIONS_OUTPUT}")


if __name__ == "__main__":
    main()
