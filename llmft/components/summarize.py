"""The last step: the run's summary as a Markdown artifact, what the KFP UI shows for the run at a glance.

Two components, one per branch of the promote decision (no optional artifact inputs: kfp.local refuses them
unset, kubeflow/pipelines#13061, and older backends resolve them unevenly); both write the same summary
(llmft/components/lib/summary.py ``write_markdown_summary``) from the artifacts they are given."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def summarize_run(
    plan: Input[Artifact],
    prepared: Input[Dataset],
    tokenized: Input[Dataset],
    run: Input[Model],
    evaluation: Input[Artifact],
    promoted: Input[Model],
    serving: Input[Artifact],
    registration: Input[Artifact],
    deployment: Input[Artifact],
    summary: Output[Markdown],
):
    """The summary of a promoted run, after deploy: rows kept and rejected, the training curve's end points,
    perplexity and task scores base against the best checkpoint, the gate's decision and reason, the MLflow
    version (or why nothing was registered), the endpoint and a copy-paste ``curl`` (what ``llmft pipeline
    run-local`` prints at the end).

    Outputs: ``summary`` (Markdown; metadata ``decision``).
    """
    from llmft.components.lib.summary import write_markdown_summary

    artifacts = dict(plan=plan, data=prepared, tokens=tokenized, training=run, curve=run, evaluation=evaluation)
    artifacts |= dict(promotion=promoted, serving=serving, registration=registration, deployment=deployment)
    summary.metadata["decision"] = write_markdown_summary({k: a.path for k, a in artifacts.items()}, summary.path)


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def summarize_not_promoted(
    plan: Input[Artifact],
    prepared: Input[Dataset],
    tokenized: Input[Dataset],
    run: Input[Model],
    evaluation: Input[Artifact],
    promoted: Input[Model],
    summary: Output[Markdown],
):
    """The summary of a run the promote gate stopped: the same rows up to the gate's decision and reason; nothing
    was registered or deployed.

    Outputs: ``summary`` (Markdown; metadata ``decision``).
    """
    from llmft.components.lib.summary import write_markdown_summary

    artifacts = dict(plan=plan, data=prepared, tokens=tokenized, training=run, curve=run, evaluation=evaluation)
    artifacts |= dict(promotion=promoted)
    summary.metadata["decision"] = write_markdown_summary({k: a.path for k, a in artifacts.items()}, summary.path)
