"""What the simulator tests of tests/k8s import: the simulated cluster's namespace and run id, a small tiny-model
run's overrides, and the plan whose job trains it on the simulated volume (the ``sim_volume`` fixture of conftest.py).

A module of its own, not conftest.py: a test module that imports ``conftest`` by that bare name gets whichever
folder's conftest pytest loaded last, so one pytest over several folders (``make test-clock-ahead``) would fail at
collection."""

from __future__ import annotations

from pathlib import Path

SIM_NAMESPACE = "team-a"
SIM_RUN_ID = "5d0c3a9e-7b1f-4e2a-8c6d-0a1b2c3d4e5f"
TINY_TRAIN = (
    "lora.alpha=8 batch.global_sequences=4 batch.micro_sequences=2 eval.max_sequences=8 eval_every=0 "
    "observe.progress_bar=false observe.tensorboard=false log_every=1 schedule.warmup_steps=1 keep_last=5"
)
"""finetune_overrides of a small, quiet run of the tiny model (a few seconds a step on this CPU)."""


def sim_plan(volume: Path, *, hpo: bool = False, run_id: str = SIM_RUN_ID, **changes):
    """A plan (the real builder, the pipelines' defaults) whose job trains the tiny model on ``volume``."""
    from llmft.components.lib.plan.build import build_plan, write_run_config
    from llmft.components.lib.plan.checks import compiled_settings
    from llmft.components.lib.plan.parameters import parameter_defaults

    values = {
        **parameter_defaults(),
        "base_model": str(volume / "base-models" / "tiny"),
        "volume_path": str(volume),
        "finetune_lora_r": 4,
        "serving_max_lora_rank": 8,
        "finetune_max_steps": 3,
        "finetune_overrides": TINY_TRAIN,
        "training_cpu": "1",
        "training_memory": "2Gi",
        **changes,
    }
    compiled = compiled_settings("llm-finetune-hpo" if hpo else "llm-finetune", values)
    plan = build_plan(values, run_id=run_id, compiled=compiled, environ={"MLFLOW_TRACKING_URI": "unused-here"})
    write_run_config(plan)  # as the plan step does: the job's `llmft train --config` reads it on the volume
    return plan
