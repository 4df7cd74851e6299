"""One tokenizer loader (llmft/trainer/tokenizer.py) for the tokenize step, the trainer and the evaluate step's
generations: each reads the base model's tokenizer at the trainer's ``model.revision``, with the chat template
the data was tokenized with. The tiny model sits in an offline hub cache at two commits whose tokenizers differ
(tests/tiny_hub.py), so a test can tell which commit a caller read."""

from __future__ import annotations

import json

import pytest
from tiny_hub import HUB_MAIN, HUB_MARKER, HUB_MAX_LENGTH, HUB_PINNED
from trainer_helpers import train_in_process

from llmft.trainer.errors import ConfigError
from llmft.trainer.tokenizer import load_tokenizer


def test_the_loader_reads_the_revision_asked_for_and_sets_the_template(use_tiny_hub):
    assert load_tokenizer(use_tiny_hub).model_max_length == HUB_MAX_LENGTH[HUB_MAIN]  # refs/main
    pinned = load_tokenizer(use_tiny_hub, HUB_PINNED)
    assert pinned.model_max_length == HUB_MAX_LENGTH[HUB_PINNED]
    assert pinned.chat_template.startswith("{#- pinned -#}")
    assert load_tokenizer(use_tiny_hub, HUB_PINNED, chat_template="{{ messages }}").chat_template == "{{ messages }}"


def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_setting_the_revision_and_the_fix(use_tiny_hub):
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(use_tiny_hub, "c" * 40, field="model")
    message = str(caught.value)
    assert message.startswith(f"model='{use_tiny_hub}': cannot load the tokenizer at revision {'c' * 40} (OSError: ")
    assert "Fix: " in message and "HF_HUB_OFFLINE=1" in message and len(message.splitlines()) == 1


def test_tokenize_reads_the_tokenizer_at_the_revision_it_is_given(use_tiny_hub, tmp_path):
    """The tokenize step's caller: the manifest records the pinned commit's template and the revision."""
    from llmft.trainer.data.tokenize import tokenize_dataset

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
            for i in range(4)]  # fmt: skip
    (prepared / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for commit in (HUB_PINNED, None):
        out = tmp_path / f"tokenized-{commit}"
        manifest = tokenize_dataset(prepared, use_tiny_hub, out, max_length=64, num_proc=1, revision=commit)
        marker = HUB_MARKER[commit or HUB_MAIN]
        assert manifest["chat_template"].startswith(f"{{#- {marker} -#}}"), marker
        assert manifest["revision"] == commit


@pytest.mark.slow
def test_the_trainer_reads_the_tokenizer_at_model_revision_with_the_datasets_template(
    use_tiny_hub, base_overrides, tokenized_dir, tmp_path
):
    """What final/ carries for serving: the tokenizer of model.revision, with the template the data was tokenized
    with (the dataset's manifest), not the one of the revision's tokenizer_config."""
    overrides = base_overrides("pinned", max_steps=1, model__name_or_path=use_tiny_hub, model__revision=HUB_PINNED)
    code, out = train_in_process(overrides)
    assert code == 0, out[-2000:]
    final = tmp_path / "pinned" / "final"
    assert json.loads((final / "tokenizer_config.json").read_text())["model_max_length"] == HUB_MAX_LENGTH[HUB_PINNED]
    dataset_template = json.loads((tokenized_dir / "manifest.json").read_text())["chat_template"]
    assert (final / "chat_template.jinja").read_text() == dataset_template
