"""The evaluate step's answer comparison reads the tokenizer the data was tokenized with: the base model at the
revision and with the chat template the tokenized dataset's manifest records (llmft/trainer/tokenizer.py, the loader the
tokenize step and the trainer use). The tiny model sits in an offline hub cache at two commits (tests/tiny_hub.py)."""

from __future__ import annotations

from tiny_hub import HUB_MAIN, HUB_MARKER, HUB_MAX_LENGTH, HUB_PINNED

from llmft.components.lib.evaluation.generations import generation_tokenizer


def test_generations_read_the_tokenizer_at_the_datasets_revision_with_its_template(use_tiny_hub):
    manifest = {"revision": HUB_PINNED, "chat_template": "{{ messages[0]['content'] }}", "cache_key": "k"}
    tokenizer = generation_tokenizer(use_tiny_hub, manifest)
    assert tokenizer.model_max_length == HUB_MAX_LENGTH[HUB_PINNED]
    assert tokenizer.chat_template == manifest["chat_template"]
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None


def test_a_manifest_without_a_revision_reads_the_default_branch_and_its_template(use_tiny_hub):
    """Datasets tokenized before the manifest recorded ``revision``/``chat_template`` keep working."""
    tokenizer = generation_tokenizer(use_tiny_hub, {"cache_key": "k"})
    assert tokenizer.model_max_length == HUB_MAX_LENGTH[HUB_MAIN]
    assert tokenizer.chat_template.startswith("{#- main -#}")


def test_the_evaluate_step_loads_the_base_at_the_trainers_revision(use_tiny_hub):
    """The perplexities (and the comparison, which reuses the evaluator) score the base the adapter was trained
    over: the commit ``model.revision`` names, not the default branch."""
    from llmft.components.lib.evaluation.checkpoints import base_evaluator
    from llmft.trainer.config import ModelConfig

    for revision, commit in ((HUB_PINNED, HUB_PINNED), (None, HUB_MAIN)):
        evaluator = base_evaluator(ModelConfig(name_or_path=use_tiny_hub, revision=revision))
        with evaluator.applied(use_tiny_hub) as model:
            assert model.config.hub_snapshot == HUB_MARKER[commit]
