"""Step 5: promote the best checkpoint by promote_metric, if it beats the base model by the margin."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def promote_best_checkpoint(
    plan: Input[Artifact],
    evaluation: Input[Artifact],
    promoted: Output[Model],
):
    """Pick the best checkpoint by the plan's ``promote_metric`` and copy it to a stable place.

    Refuses (the step fails, so nothing is registered or deployed) unless the best
    checkpoint beats the base model on that metric by ``promote_margin``: perplexity below
    ``base * (1 - promote_margin)``, a task score (e.g. ``heldout.contains``) above
    ``base + promote_margin``, among the checkpoints that keep every ``eval_guards`` metric within its
    tolerance of the base's; and, with
    ``serving_mode=lora``, refuses a LoRA adapter vLLM could not serve (DoRA, ``modules_to_save``, a rank
    above ``max_lora_rank``; otherwise the next step serves such an adapter merged). Otherwise copies
    its servable files (adapter or weights, tokenizer, manifest; not optimizer state)
    atomically to ``<data_root>/models/<mlflow_model_name>/<run_id>`` with a COMPLETE marker.
    The decision and its reason are written as JSON beside that folder in both cases.

    Outputs: ``promoted`` (promotion.json; metadata ``path``, ``checkpoint``, ``perplexity``, ``metric``,
    ``value``, ``base_value``).
    """
    import json
    import os

    from llmft.components.lib.plan.schema import read_plan
    from llmft.components.lib.registry.promote import promote_to_volume, promoted_destination, read_evaluation

    run_plan = read_plan(plan.path)
    root, name, run_id = run_plan.layout.root, run_plan.registry.model_name, run_plan.run_id
    result = read_evaluation(os.path.join(evaluation.path, "evaluation.json"))  # one line naming a corrupt file
    destination = str(promoted_destination(root, name, run_id))
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

    os.makedirs(promoted.path, exist_ok=True)
    with open(os.path.join(promoted.path, "promotion.json"), "w") as fh:
        json.dump(decision.to_dict(), fh, indent=2, sort_keys=True)
    promoted.metadata.update(
        {
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
    print(f"promoted: {decision.reason}")
