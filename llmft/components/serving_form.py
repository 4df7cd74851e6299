"""Step 6: choose how the promoted adapter is served (a vLLM LoRA module, or merged into its base)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from llmft.components.images import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def choose_serving_form(
    plan: Input[Artifact],
    promoted: Input[Model],
    serving: Output[Artifact],
):
    """Decide the serving form by the plan's ``serving_mode`` and, for ``merged``, merge the adapter.

    The servability check says whether vLLM can load the adapter as a LoRA module (no DoRA, no
    ``modules_to_save``, rank within ``serving_max_lora_rank``, target modules vLLM has LoRA layers for).
    ``auto``: LoRA when it can, else merged, with the reason logged; ``lora``: an adapter vLLM refuses
    fails the step; ``merged``: always merged. The merge is ``llmft export --merge`` (bf16, streamed
    shard by shard: about 2 GiB of memory, 2 bytes per parameter on the volume) into
    ``<data_root>/merged/<mlflow_model_name>/<run_id>``, atomically; a retry reuses a complete merge
    of the same adapter.

    Outputs: ``serving`` (serving.json: form, reason, servability problems, the directory to serve,
    the export manifest; metadata ``form``, ``model_dir``), read by register and deploy.
    """
    from llmft.components.lib.contracts.schema import read_plan
    from llmft.trainer.quiet import quiet_known_noise

    quiet_known_noise()  # the libraries' known noise off the task's log (llmft/trainer/quiet.py)

    run_plan = read_plan(plan.path)
    run_plan.layout.use_hf_cache()  # a hub base model is read from the volume's cache: before transformers
    from llmft.components.lib.serving.serving_form import prepare_serving_form, write_form

    form = prepare_serving_form(
        promoted.metadata["path"],
        serving_mode=run_plan.serving.serving_mode,
        max_lora_rank=run_plan.serving.max_lora_rank,
        merged_dir=run_plan.serving.merged_dir,
    )
    write_form(form, serving.path)
    serving.metadata.update({"form": form.form, "model_dir": form.model_dir, "reason": form.reason})
