"""The demo's data: the sample datasets and the question and task files that ``make demo`` (``llmft pipeline
run-local``), ``llmft sweep run-local``, the notebooks and the tests use. Data, and the paths to it; nothing here
runs in a pipeline step but the files an evaluate step reads as a shipped task.

- ``sample_data/``: the datasets, each with its generator beside it (deterministic; regenerate with
  ``python -m llmft.demo.sample_data.generate`` or ``... .generate_facts``):
  ``alpaca_demo.jsonl``, about 500 Alpaca rows written in the tiny model's vocabulary, with 3 deliberately broken
  rows (invalid JSON, empty output, missing instruction) so a demo shows rejections while staying under the default
  1% reject limit; ``chat_demo.jsonl``, multi-turn OpenAI ``messages`` conversations with system turns;
  ``velmora_facts.jsonl``, ``velmora_three_facts.jsonl`` and ``velmora_questions.jsonl``, made-up facts about an
  island that does not exist and the held-out questions about them (the real-model demo).
- ``lm_eval_tasks/``: lm-evaluation-harness task YAMLs and their data, run offline by the evaluate step
  (``promote_eval_tasks=velmora_mc``; llmft/components/lib/evaluation/task_eval.py lists them).

A package of its own, not part of the trainer (the base layer every image runs) nor of the pipelines that use it:
this module imports nothing of ours (sample_data/generate.py reads the tiny model's word lists from llmft.trainer),
and the pipelines, the components' evaluation and the CLI read it (pyproject.toml's import-linter contract places
it beside llmft.katib, above llmft.trainer). The wheel carries it as package data, so both images have the files
where these paths point.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLE_DIR = HERE / "sample_data"
"""The sample datasets (``sample:<name>`` in run-local's ``dataset`` and ``promote_eval_questions``)."""
LM_EVAL_TASK_DIR = HERE / "lm_eval_tasks"
"""The lm-eval task YAMLs shipped with the package (their data beside them, as JSON Lines)."""


def sample_names() -> list[str]:
    return sorted(p.name for p in SAMPLE_DIR.glob("*.jsonl"))


def sample_path(name: str) -> Path:
    """Path of a shipped sample, by file name with or without ``.jsonl``."""
    path = SAMPLE_DIR / (name if name.endswith(".jsonl") else f"{name}.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"no sample dataset {name!r}; shipped: {', '.join(sample_names())}")
    return path
