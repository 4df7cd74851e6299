"""Issue 43's "done when": a run with promote_eval_tasks=heldout,arc_easy, arc_easy's data from the volume's cache,
and a guard task completes offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, tests/conftest.py) through kfp.local; its
report shows base against adapter for each task and the gate's decision with its reason.

arc_easy is lm-eval's OWN registry task (lm_eval/tasks/arc/arc_easy.yaml of the installed lm-eval, not an
imitation); its data is a small generated subset with ARC's schema, written by the cache command's own code
(eval_cache.cache_tasks) with only ``datasets.load_dataset`` (the hub download, which cannot run here) replaced."""

from __future__ import annotations

import json

import datasets
import pytest

from llmft.components.lib.evaluation.eval_cache import INDEX, cache_tasks

ARC_FIELDS = ("id", "question", "choices", "answerKey")


def generated_arc(path: str, name: str, **kwargs) -> datasets.DatasetDict:
    """What ``load_dataset("allenai/ai2_arc", "ARC-Easy")`` returns, in miniature: the same splits and columns."""
    assert (path, name, kwargs) == ("allenai/ai2_arc", "ARC-Easy", {}), "the registry YAML's own dataset"

    def rows(count: int, first: int) -> list[dict]:
        return [
            {"id": f"arc-{first + i}", "question": f"Which word names the colour number {i}?",
             "choices": {"text": [f"colour {i}", "stone", "river", "cloud"], "label": ["A", "B", "C", "D"]},
             "answerKey": "ABCD"[i % 4]}
            for i in range(count)
        ]  # fmt: skip

    splits = {"train": rows(6, 0), "validation": rows(4, 100), "test": rows(8, 200)}
    return datasets.DatasetDict({split: datasets.Dataset.from_list(data) for split, data in splits.items()})


def test_the_cache_holds_what_the_command_writes_for_lm_evals_own_arc_easy(tmp_path):
    lines = cache_tasks(["arc_easy"], tmp_path, load_dataset=generated_arc)
    index = json.loads((tmp_path / INDEX).read_text())
    task = index["tasks"]["arc_easy"]
    assert task["yaml"] == "arc/arc_easy.yaml" and task["metrics"] == ["acc", "acc_norm"]
    assert {s: r["rows"] for s, r in task["splits"].items()} == {"test": 8, "train": 6, "validation": 4}
    assert (
        datasets.load_dataset("parquet", data_files=str(tmp_path / task["splits"]["test"]["file"]))["train"][0][
            "answerKey"
        ]
        == "A"
    ), "each split is a Parquet file datasets reads offline"
    assert lines[0] == "arc_easy: test 8 rows, train 6 rows, validation 4 rows"


@pytest.mark.slow
def test_heldout_and_arc_easy_from_the_cache_with_a_guard_run_offline_and_the_report_shows_the_gate(tmp_path):
    from llmft.pipelines.local_run import run_pipeline_locally

    volume = tmp_path / "volume"
    cache_tasks(["arc_easy"], volume / "eval-cache", load_dataset=generated_arc)
    changes = {
        "volume_path": str(volume), "promote_eval_tasks": "heldout,arc_easy", "promote_guards": "arc_easy.acc:0.9",
        "promote_eval_limit": 8, "promote_eval_batch_size": 4, "promote_eval_max_questions": 4,
    }  # fmt: skip
    outcome = run_pipeline_locally(changes, work_dir=tmp_path / "work")
    assert outcome.succeeded, outcome.render(0.0) + "\n" + outcome.log_path.read_text()[-4000:]
    evaluation = outcome.facts["evaluation"]
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    for model in (evaluation["base"], best):
        assert model["tasks"]["arc_easy"]["questions"] == 8 and 0 <= model["tasks"]["arc_easy"]["acc"] <= 1
        assert set(model["tasks"]["heldout"]) >= {"exact_match", "contains", "token_f1"}
    assert evaluation["eval_sets"]["arc_easy"]["size"] == 8 and evaluation["eval_sets"]["arc_easy"]["version"] == "1.0"
    gate = evaluation["gate"]
    assert gate["promoted"] and [g["metric"] for g in gate["guards"]] == ["arc_easy.acc"] and gate["guards"][0]["held"]
    page = (outcome.run_dir / "evaluate-perplexity" / "report").read_text()
    assert "arc_easy.acc" in page and "heldout.token_f1" in page and "Promotion gate" in page
    assert "guard arc_easy.acc:" in page and "guards held: arc_easy.acc" in page
    summary = outcome.render(1.0)
    assert "arc_easy" in summary and "guard       arc_easy.acc" in summary, summary
