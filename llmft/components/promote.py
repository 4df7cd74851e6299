"""Step 5: promote the best checkpoint by promote_metric, if it beats the base model by the margin; either way the
step's decision ("promoted" or "not promoted") is its output, and the pipeline registers and deploys only under
``dsl.If(decision == "promoted")``."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def promote_best_checkpoint(
    plan: Input[Artifact],
    evaluation: Input[Artifact],
    promoted: Output[Model],
) -> NamedTuple("PromoteOutputs", [("decision", str), ("reason", str)]):  # type: ignore[valid-type]  # KFP's form
    """Pick the best checkpoint by the plan's ``promote_metric`` and copy it to a stable place, or decide not to.

    The gate: among the checkpoints that keep every ``promote_guards`` metric within its tolerance of the base's,
    the best must beat the base model on that metric by ``promote_margin`` (perplexity below
    ``base * (1 - promote_margin)``, a task score such as ``heldout.contains`` above ``base + promote_margin``).
    When it does, its servable files (adapter or weights, tokenizer, manifest; not optimizer state) are copied
    atomically to ``<data_root>/models/<mlflow_model_name>/<run_id>`` with a COMPLETE marker, and the decision is
    ``promoted``. When it does not, nothing is copied and the decision is ``not promoted``: the step succeeds,
    the pipeline skips register and deploy, and the run ends green (a nightly run that rightly keeps the
    champion is not a failure); the reason is the step's ``reason`` output, its last log line and the run
    summary's. A real failure (a checkpoint without its COMPLETE marker or weights, with ``serving_mode=lora`` an
    adapter vLLM could not serve, a margin out of range, a corrupt evaluation.json) fails the step with one
    ``error:`` line. The decision and its reason are also written as JSON beside that folder.

    Outputs: ``decision`` (``promoted`` / ``not promoted``), ``reason`` (one sentence), ``promoted``
    (promotion.json; metadata ``decision``, ``reason``, ``path``, ``checkpoint``, ``perplexity``, ``metric``,
    ``value``, ``base_value``).
    """
    import json
    import os
    from collections import namedtuple

    from llmft.components.lib.plan.schema import read_plan
    from llmft.components.lib.registry.promote import (
        GateRefused,
        promote_to_volume,
        promoted_destination,
        read_evaluation,
    )
    from llmft.components.lib.step_exit import step_outcome

    with step_outcome("promote-best-checkpoint"):
        run_plan = read_plan(plan.path)
        root, name, run_id = run_plan.layout.root, run_plan.registry.model_name, run_plan.run_id
        result = read_evaluation(os.path.join(evaluation.path, "evaluation.json"))  # one line naming a corrupt file
        destination = str(promoted_destination(root, name, run_id))
        try:
            decision = promote_to_volume(
                result,
                root,
                name,
                run_id,
                margin=run_plan.registry.promote_margin,
                metric=run_plan.registry.promote_metric,
                # serving_mode=lora: vLLM must be able to serve what is registered; auto/merged can merge it
                max_lora_rank=run_plan.serving.max_lora_rank if run_plan.serving.serving_mode == "lora" else None,
                guards=[(g.metric, g.tolerance) for g in run_plan.evaluation.guards],
            )
        except GateRefused as refused:
            decision, destination = refused.decision, ""

    verdict = "promoted" if decision.promoted else "not promoted"
    os.makedirs(promoted.path, exist_ok=True)
    with open(os.path.join(promoted.path, "promotion.json"), "w") as fh:
        json.dump(decision.to_dict(), fh, indent=2, sort_keys=True)
    promoted.metadata.update(
        {
            "decision": verdict,
            "reason": decision.reason,
            "path": destination,
            "checkpoint": decision.checkpoint,
            "step": decision.step,
            "perplexity": decision.perplexity,
            "base_perplexity": decision.base_perplexity,
            "metric": decision.metric,
            "value": decision.value,
            "base_value": decision.base_value,
        }
    )
    print(f"{verdict}: {decision.reason}")
    PromoteOutputs = namedtuple("PromoteOutputs", ["decision", "reason"])  # noqa: N806  # KFP reads the fields by name
    return PromoteOutputs(verdict, decision.reason)
