"""One record per pipeline step: what its pod needs (image, CPU and memory, Secrets, GPU).

The pipeline builder (llmft/pipelines/llm_finetune.py ``apply_platform``) applies each step's record to its
KFP task, the plan's checks read which Secrets the tasks mount (the preflight reads them before any pod
waits on one), and docs/architecture.md's step table says the same. A new step is one record here (and its
component, and its call in the builder).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.components.lib.contracts.choices import NOT_PROMOTED, PROMOTED

RESOURCE_PARAMETERS = {
    "step": ("step_cpu", "step_memory"),
    "data": ("step_data_cpu", "step_data_memory"),
    "eval": ("step_eval_cpu", "step_eval_memory"),
}
"""A step's resource group -> the pipeline parameters of its CPU and memory (request = limit)."""
IMAGE_ROLES = ("pipeline", "trainer", "katib")
"""The images a component can run on (llmft/components/images.py ``all_images``)."""


@dataclass(frozen=True)
class Step:
    """One KFP task of the pipelines' body."""

    task: str
    """The task's name (its component function's, dashed)."""
    image: str
    """Which image its component runs on (IMAGE_ROLES); the builder refuses a component compiled for another."""
    resources: str = "step"
    """Its resource group (RESOURCE_PARAMETERS): data and eval steps load data or models, the others are light."""
    secrets: tuple[str, ...] = ()
    """Kinds of the Secrets mounted into its pod as environment variables (lib/plan/checks.py SECRET_KINDS)."""
    gpus: int = 0
    """GPUs of its own pod; a GPU step also gets the GPU toleration and the compiled node selector."""
    hpo_only: bool = False
    """Only the HPO pipeline runs it."""
    branch: str = ""
    """Which outcome of the promote step's gate it runs under (llmft/pipelines/llm_finetune.py: ``dsl.If`` /
    ``dsl.Else`` on its ``decision``): "" always, PROMOTED or NOT_PROMOTED."""


STEPS: tuple[Step, ...] = (
    Step("plan-run", "pipeline"),
    # langfuse: a langfuse://<dataset> source; s3: an s3:// one
    Step("prepare-dataset", "trainer", "data", ("hf", "langfuse", "s3")),
    Step("tokenize-dataset", "trainer", "data", ("hf",)),
    Step("sweep-hyperparameters", "katib", secrets=("mlflow",), hpo_only=True),
    # the launcher opens the pipeline run's MLflow parent run (lib/registry/lineage.py); the job's pods get the
    # plan's Secrets (JobPlan.secrets)
    Step("train-model", "pipeline", secrets=("mlflow",)),
    Step("evaluate-perplexity", "trainer", "eval", ("hf", "mlflow", "langfuse"), gpus=1),  # champion from MLflow
    Step("promote-best-checkpoint", "pipeline"),
    # the merge streams one tensor at a time, but a 70B one in float32 is GBs; hf: a hub base model
    Step("choose-serving-form", "trainer", "data", ("hf",), branch=PROMOTED),
    # langfuse: links the training trace
    Step("register-model", "pipeline", secrets=("mlflow", "langfuse"), branch=PROMOTED),
    Step("deploy-adapter", "pipeline", branch=PROMOTED),
    Step("summarize-run", "pipeline", branch=PROMOTED),  # the run summary (Markdown) of a promoted run
    Step("summarize-not-promoted", "pipeline", branch=NOT_PROMOTED),  # ... of a run the gate refused
)
"""Every step, in the order it runs."""
STEP: dict[str, Step] = {step.task: step for step in STEPS}


def task_order(*, hpo: bool) -> tuple[str, ...]:
    """The tasks of a promoted run of the plain (or the HPO) pipeline's body, in the order they run."""
    return tuple(step.task for step in STEPS if (hpo or not step.hpo_only) and step.branch != NOT_PROMOTED)


def mounted_secret_kinds() -> tuple[str, ...]:
    """The Secret kinds some step mounts (sorted): what the compiled pipeline needs to exist."""
    return tuple(sorted({kind for step in STEPS for kind in step.secrets}))
