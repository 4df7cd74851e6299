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


def test_held_out_answers_are_decoded_with_one_cpu_thread_and_the_threads_come_back(use_tiny_hub):
    """A decoding step's hundreds of tiny parallel regions wait for descheduled threads on a shared CPU
    (llmft/trainer/cpu_threads.py; llmft bench eval-threads): the evaluate step decodes with one thread, then gives
    perplexity back its threads."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmft.components.lib.evaluation.generations import Prompt, generate_answers

    tokenizer = generation_tokenizer(use_tiny_hub, {"cache_key": "k"})
    model = AutoModelForCausalLM.from_pretrained(use_tiny_hub).eval()
    seen = []
    real_generate = model.generate

    def generate(**kwargs):
        seen.append(torch.get_num_threads())
        return real_generate(**kwargs)

    model.generate = generate
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = [Prompt(id=str(i), messages=[{"role": "user", "content": f"Q{i}?"}], reference="A") for i in range(3)]
        assert len(generate_answers(model, tokenizer, prompts, max_new_tokens=2)) == 3
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decode_threads_leave_a_gpu_and_a_single_thread_alone():
    import types

    import torch

    from llmft.trainer.cpu_threads import decode_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with decode_threads(types.SimpleNamespace(type="cuda")):
            assert torch.get_num_threads() == 2
        with decode_threads(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        with decode_threads(torch.device("cpu")):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
