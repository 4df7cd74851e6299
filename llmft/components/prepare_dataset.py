"""Step 1: convert the raw dataset to validated JSONL (the plan step checked every parameter)."""
# No `from __future__ import annotations` in component modules: KFP reads the real annotation objects.

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from llmft.components.images import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def prepare_dataset(
    plan: Input[Artifact],
    prepared: Output[Dataset],
    metrics: Output[Metrics],
):
    """Write train/val/rejects JSONL and a report for the plan's dataset.

    The dataset (hub id, a file/folder on the volume, an https:// file or s3:// objects fetched into the
    folder being written, with the s3 Secret's AWS_* keys) is converted to the canonical schema, its columns
    renamed by ``dataset_columns``, under ``<data_root>/datasets/<run_id>``; rows that fail validation go to
    rejects.jsonl, and the step fails when more than ``dataset_max_reject_fraction`` of them are rejected.

    Outputs: ``prepared`` (report.json; metadata ``path`` = the folder on the volume) and
    ``metrics`` (rows accepted and rejected).
    """
    import json
    import os

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.task_attempts import task_attempt

    run_plan = read_plan(plan.path)
    # one error line and its exit code; a retry of a permanent failure ends at once (lib/task_attempts.py)
    with task_attempt(run_plan.layout.root, run_plan.run_id, "prepare-dataset"):
        run_plan.layout.use_hf_cache()  # before datasets/huggingface_hub are imported
        from llmft.trainer.data.prepare import prepare_dataset as prepare

        data = run_plan.data
        report = prepare(
            data.dataset,
            data.prepared_dir,
            format=data.format,
            split=data.split,
            hub_config=data.config,
            columns=data.columns,
            val_fraction=data.val_fraction,
            seed=data.seed,
            max_reject_fraction=data.max_reject_fraction,
        )

        os.makedirs(prepared.path, exist_ok=True)
        with open(os.path.join(prepared.path, "report.json"), "w") as fh:
            json.dump(report, fh, indent=2, sort_keys=True, default=str)
        prepared.metadata.update(
            {
                "path": data.prepared_dir,
                "accepted": report["accepted"],
                "rejected": report["rejected"],
                "format": str(report.get("format", data.format)),
                "source_hash": str(report.get("source_hash", "")),
            }
        )
        metrics.log_metric("rows_accepted", report["accepted"])
        metrics.log_metric("rows_rejected", report["rejected"])
        print(f"prepared {report['accepted']} rows ({report['rejected']} rejected) into {data.prepared_dir}")
