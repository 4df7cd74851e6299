"""One key=value grammar (issue 26): the trainer's overrides, the pipeline's CLI arguments and the
sweep's settings split ``key=value`` and read booleans the same way (llmft/trainer/config_load.py
``split_assignment`` / ``parse_bool``). Before, katib accepted on/off and llmft/pipelines/defaults did not."""

from __future__ import annotations

import pytest

from llmft.katib.errors import SweepError
from llmft.katib.experiment import SweepSpec, apply_overrides
from llmft.pipelines.defaults import parse_arguments
from llmft.trainer.config_load import BOOL_WORDS, load_config
from llmft.trainer.errors import ConfigError

REQUIRED = ["model.name_or_path=m", "data=d"]


@pytest.mark.parametrize("word", sorted(BOOL_WORDS))
def test_every_boolean_word_means_the_same_everywhere(word):
    expected = BOOL_WORDS[word]
    assert parse_arguments([f"serving_deploy={word.upper()}"])["serving_deploy"] is expected
    assert apply_overrides(SweepSpec(), [f"early_stopping={word}"]).early_stopping is expected
    quoted = f"observe.tensorboard='{word}'"  # quoted: YAML leaves it a string, the grammar reads it
    assert load_config(None, [*REQUIRED, quoted]).observe.tensorboard is expected


def test_a_word_that_is_no_boolean_is_refused_everywhere():
    with pytest.raises(ConfigError, match="serving_deploy"):
        parse_arguments(["serving_deploy=maybe"])
    with pytest.raises(SweepError, match="early_stopping"):
        apply_overrides(SweepSpec(), ["early_stopping=maybe"])
    with pytest.raises(ConfigError, match="observe.tensorboard"):
        load_config(None, [*REQUIRED, "observe.tensorboard=maybe"])


@pytest.mark.parametrize("item", ["no-equals-sign", "=value"])
def test_an_item_without_a_key_is_refused_everywhere(item):
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_arguments([item])
    with pytest.raises(SweepError, match="expected key=value"):
        apply_overrides(SweepSpec(), [item])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, [*REQUIRED, item])


@pytest.mark.parametrize("item", ["lora..r=4", ".lora.r=4", "lora.r.=4"])
def test_an_empty_name_between_dots_blames_the_override(item, tmp_path):
    """Issue 35: `lora..r=4` was reported against the config file, which never named it."""
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  name_or_path: m\ndata: d\n")
    with pytest.raises(ConfigError) as error:
        load_config(str(config), [item])
    assert str(error.value).startswith(f"override `{item}`") and "empty name between dots" in str(error.value)
    assert str(config) not in str(error.value)
