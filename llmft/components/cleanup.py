"""Exit handler of both pipelines: delete what a failed run left running (its jobs hold GPUs)."""

from kfp import dsl

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def cleanup_run(run_id: str):
    """Delete the run's unfinished PyTorchJobs, TrainJobs and Katib Experiments (label
    ``pipelines.kubeflow.org/run-id``); finished ones are kept (they hold no GPU; their pods keep
    the logs). Runs after the pipeline's body whatever its outcome (``dsl.ExitHandler``); it takes
    only the run id because an exit task may depend on no other task. Under kfp.local there is
    nothing on a cluster to delete.
    """
    from llmft.components.lib.jobs.cleanup import cleanup_after_run

    cleanup_after_run(run_id)
