"""Step 2b of the HPO pipeline: sweep the training hyperparameters with Katib.

Thin: the logic is ``llmft.components.lib.jobs.katib_sweep.run_sweep_step`` (Experiment built from llmft/katib/
and the plan's job, submitted through components.lib.cluster, waited for, best trial read back).
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from llmft.components.images import KATIB_IMAGE


@dsl.component(base_image=KATIB_IMAGE, install_kfp_package=False)
def sweep_hyperparameters(
    plan: Input[Artifact],
    tokenized: Input[Dataset],
    sweep: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """Search the training hyperparameters on the tokenized shards; return the best ``key=value`` pairs.

    ``hpo_backend=katib`` creates a Katib Experiment (trials are the plan's PyTorchJob running
    ``llmft train`` on the existing shards; objective: minimize ``eval_loss``), waits for it, and
    reads its optimal trial. ``local`` (kfp.local only) runs the same search space with Optuna,
    trials in sequence in this process. ``hpo_overrides`` edits the search
    (``space.lora_r.values=8,16``); ``hpo_trial_overrides`` are fixed trainer settings of every
    trial (``max_steps=200 eval_every=25``). With MLflow configured the sweep is a parent run
    and every trial a child run.

    Outputs: ``sweep`` (experiment.yaml, best.txt, state.json), ``metrics`` (best eval loss,
    trial counts). Returns the best ``key=value`` pairs; the train step passes them after
    ``--config <run_dir>/config.yaml`` (the plan's config, where every trial started too), so they win.
    """
    import json
    import os
    import shlex

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.jobs.katib_sweep import run_sweep_step

    run_plan = read_plan(plan.path)
    result = run_sweep_step(run_plan, tokenized_dir=tokenized.metadata["path"], output_dir=sweep.path)
    sweep.metadata.update(
        {
            "experiment": result["experiment"],
            "backend": run_plan.sweep.backend if run_plan.sweep else "",
            "best_overrides": " ".join(result["best_overrides"]),
        }
    )
    for name, value in sorted(result["metrics"].items()):
        metrics.log_metric(name, value)
    with open(os.path.join(sweep.path, "state.json"), "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    return shlex.join(result["best_overrides"])
