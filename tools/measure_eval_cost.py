"""What each evaluation task costs on the demo model (issue 43: "the cost of each task on the demo model, measured").

``python tools/measure_eval_cost.py --model DIR --output FILE.json [--threads 2]`` scores the base model
(SmolLM2-135M-Instruct, ``.cache/real-model``, as ``make demo`` runs it: CPU, 2 threads) on each task through
the evaluate step's own runner (llmft/components/lib/evaluation/task_runner.py: the same generation, lm-eval
call and settings), and writes per task: the wall time, the items scored, the time per item, and that time
scaled to the pipeline's defaults (``promote_eval_max_questions`` held-out questions, ``promote_eval_limit``
lm-eval documents). The evaluate step pays it once per model: the base and every kept checkpoint.

* ``heldout``: the demo's questions (the shipped velmora_questions.jsonl, its first ``--questions``), greedy, at
  most ``max_new_tokens`` each: the time per question depends on how long the model talks.
* ``velmora_mc``: the shipped lm-eval task (8 questions x 4 choices).
* ``arc_easy``: lm-eval's own registry task read from an eval cache that the cache command's code writes; the
  hub cannot be reached here, so its rows are generated with ARC's schema and a question of about ARC's length
  (the prompt's token count is recorded beside the time: a log-likelihood costs by tokens).

The load average before and after is recorded: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ARC_QUESTION = (
    "A student wants to find out which material keeps a cup of hot water warm the longest. She wraps four "
    "identical cups in different materials. Which material, number {i}, will most likely keep the water warm?"
)


def generated_arc(path: str, name: str, **kwargs):
    """``load_dataset("allenai/ai2_arc", "ARC-Easy")`` in miniature: its splits and columns, generated rows."""
    import datasets  # heavy: datasets

    def rows(count: int, first: int) -> list[dict]:
        return [
            {"id": f"arc-{first + i}", "question": ARC_QUESTION.format(i=first + i),
             "choices": {"text": ["wool felt", "aluminum foil", "thin paper", "plastic wrap"],
                         "label": ["A", "B", "C", "D"]},
             "answerKey": "ABCD"[i % 4]}
            for i in range(count)
        ]  # fmt: skip

    splits = {"train": rows(8, 0), "validation": rows(8, 1000), "test": rows(64, 2000)}
    return datasets.DatasetDict({split: datasets.Dataset.from_list(data) for split, data in splits.items()})


def measure(model: str, work: Path, *, questions: int, arc_docs: int, threads: int) -> dict:
    import torch  # heavy: torch

    from llmft.components.lib.contracts.schema import EvalPlan
    from llmft.components.lib.evaluation import generations as gen
    from llmft.components.lib.evaluation.eval_cache import cache_tasks
    from llmft.components.lib.evaluation.questions import read_questions
    from llmft.components.lib.evaluation.task_plan import resolve_task
    from llmft.components.lib.evaluation.task_runner import TaskRunner
    from llmft.components.lib.plan.parameters import BY_NAME
    from llmft.demo import sample_path
    from llmft.trainer.evaluate import PerplexityEvaluator

    torch.set_num_threads(threads)
    cache = work / "eval-cache"
    cache_tasks(["arc_easy"], cache, load_dataset=generated_arc)
    offline = {"HF_HUB_OFFLINE": "1"}
    specs = [resolve_task(name, str(cache), offline) for name in ("heldout", "velmora_mc", "arc_easy")]
    settings = EvalPlan(limit=arc_docs, cache_dir=str(cache), batch_size=BY_NAME["promote_eval_batch_size"].default)
    asked = read_questions(sample_path("velmora_questions"), questions)
    tokenizer = gen.generation_tokenizer(model, {})
    evaluator = PerplexityEvaluator(device="cpu")
    started = time.perf_counter()
    evaluator._base(model)
    load_s = time.perf_counter() - started
    runner = TaskRunner(evaluator, tokenizer, specs, asked, end_of_turn="<|im_end|>", settings=settings)
    scores = runner("base", model)
    arc_prompt = tokenizer(f"Question: {ARC_QUESTION.format(i=2000)}\nAnswer:")["input_ids"]
    return {"load_s": round(load_s, 2), "scores": scores, "arc_prompt_tokens": len(arc_prompt),
            "heldout_answers": [a["text"] for a in runner.answers.get("base", [])]}  # fmt: skip


def summarise(result: dict) -> dict:
    from llmft.components.lib.plan.parameters import BY_NAME

    defaults = {
        "heldout": BY_NAME["promote_eval_max_questions"].default,
        "velmora_mc": 8,
        "arc_easy": BY_NAME["promote_eval_limit"].default,
    }
    rows = {}
    for task, scores in result["scores"].items():
        items = scores["questions"]
        per_item = scores["seconds"] / items
        rows[task] = {
            "items": int(items), "seconds": scores["seconds"], "seconds_per_item": round(per_item, 3),
            "items_at_defaults": defaults[task], "seconds_at_defaults": round(per_item * defaults[task], 1),
        }  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--work", default="/tmp/llmft-eval-cost")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--questions", type=int, default=6, help="held-out questions (the demo asks 6)")
    parser.add_argument("--arc-docs", type=int, default=32, help="arc_easy documents scored")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    result = measure(args.model, Path(args.work), questions=args.questions, arc_docs=args.arc_docs,
                     threads=args.threads)  # fmt: skip
    result.update(
        tasks=summarise(result), threads=args.threads, wall_s=round(time.perf_counter() - started, 1),
        load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(), measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["tasks"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
