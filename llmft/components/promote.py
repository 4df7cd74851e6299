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
    from collections import namedtuple

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.evaluation.promote import promote_step, verdict, write_promotion
    from llmft.components.lib.step_exit import step_outcome

    with step_outcome("promote-best-checkpoint"):
        decision, destination = promote_step(read_plan(plan.path), evaluation.path)
    promoted.metadata.update(write_promotion(decision, destination, promoted.path))
    print(f"{verdict(decision)}: {decision.reason}")
    PromoteOutputs = namedtuple("PromoteOutputs", ["decision", "reason"])  # noqa: N806  # KFP reads the fields by name
    return PromoteOutputs(verdict(decision), decision.reason)
