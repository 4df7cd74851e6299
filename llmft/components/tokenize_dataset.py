"""Step 2: tokenize and pack the prepared JSONL onto the shared volume (content-addressed)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from llmft.components.images import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def tokenize_dataset(
    plan: Input[Artifact],
    prepared: Input[Dataset],
    tokenized: Output[Dataset],
    metrics: Output[Metrics],
):
    """Apply the model's chat template, mask the loss to assistant tokens, pack, and shard.

    The shards land in ``<data_root>/tokenized/<cache_key>``, where the key hashes the data,
    the tokenizer files, the chat template, ``finetune_max_length`` and packing: a rerun of the
    pipeline (or a Katib trial) with the same inputs reuses them without re-tokenizing.

    Outputs: ``tokenized`` (manifest.json; metadata ``path``, ``cache_key``, ``cache_hit``)
    and ``metrics`` (sequences, tokens, packing efficiency).
    """
    import json
    import os

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.task_attempts import task_attempt

    run_plan = read_plan(plan.path)
    # one error line and its exit code; a retry of a permanent failure ends at once (lib/task_attempts.py)
    with task_attempt(run_plan.layout.root, run_plan.run_id, "tokenize-dataset"):
        run_plan.layout.use_hf_cache()  # before transformers is imported
        from llmft.components.lib.plan.tokenized import manifest_metrics, tokenize_to_volume

        data = run_plan.data
        manifest = tokenize_to_volume(
            prepared.metadata["path"],
            run_plan.trainer.model,
            run_plan.layout.root,
            max_length=data.max_length,
            pack=data.packing,
            revision=run_plan.trainer.revision,
        )
        output_dir = manifest["path"]

        os.makedirs(tokenized.path, exist_ok=True)
        with open(os.path.join(tokenized.path, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=2, sort_keys=True, default=str)
        tokenized.metadata.update(
            {
                "path": output_dir,
                "cache_key": manifest["cache_key"],
                "cache_hit": bool(manifest.get("cache_hit", False)),
            }
        )
        for name, value in sorted(manifest_metrics(manifest).items()):
            metrics.log_metric(name, value)
        print(f"tokenized into {output_dir} (cache {'hit' if manifest.get('cache_hit') else 'miss'})")
