"""Bad YAML input is one ConfigError line before anything walks it (issue 35 items 3 and 6): an alias bomb,
a 50,000-deep document, a binary file, a FIFO, an oversized file; in --config, in key=value overrides and in
`llmft sweep create --from-yaml`."""

from __future__ import annotations

import os

import pytest

from llmft.katib.errors import SweepError
from llmft.katib.experiment_yaml import load_yaml
from llmft.trainer.config_load import load_config
from llmft.trainer.errors import ConfigError
from llmft.trainer.yaml_limits import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, load_user_yaml


def alias_bomb(levels: int) -> str:
    """``levels`` lines, each a list of nine aliases of the line above: 9**levels values once expanded."""
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def refused(tmp_path, text: str | bytes, match: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=match) as error:
        load_config(str(path))
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    assert 9**5 > MAX_YAML_NODES  # five lines of aliases expand past the bound
    message = refused(tmp_path, alias_bomb(5) + "lora:\n  target_modules: *l4\n", "aliases")
    assert f"more than {MAX_YAML_NODES:,} values" in message and ", line 5:" in message


def test_aliases_within_the_bound_still_load():
    text = alias_bomb(4) + "lora: {target_modules: &m [q_proj, v_proj]}\nagain: *m\n"  # 9**4 = 6561 values
    loaded = load_user_yaml(text, "t.yaml")
    assert loaded["again"] == ["q_proj", "v_proj"] and len(loaded["l3"][0][0][0]) == 9


@pytest.mark.parametrize("depth", [MAX_YAML_DEPTH + 1, 50_000])
def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path, depth):
    refused(tmp_path, "lora: " + "[" * depth + "]" * depth + "\n", f"nested deeper than {MAX_YAML_DEPTH} levels")


def test_the_depth_limit_is_exactly_max_yaml_depth():
    """64 nested lists load; 65 are refused (the boundary, not only far past it)."""
    assert MAX_YAML_DEPTH == 64
    loaded = load_user_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH, "t.yaml")
    for _ in range(MAX_YAML_DEPTH - 1):
        (loaded,) = loaded
    assert loaded == []
    with pytest.raises(ConfigError, match=f"^t.yaml, line 1: nested deeper than {MAX_YAML_DEPTH} levels"):
        load_user_yaml("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1), "t.yaml")


@pytest.mark.parametrize("value", ["16.5", "16.000001", "true", "'16'x"])
def test_an_integer_key_refuses_a_fraction_rather_than_rounding_it(tmp_path, value):
    """lora.r=16.5 must not train at rank 16: a fraction (or a word) for an int is one line naming the key."""
    with pytest.raises(ConfigError, match=r"`lora.r` must be int|not a plain YAML value"):
        load_config(None, ["model.name_or_path=m", "data=d", f"lora.r={value}"])
    (tmp_path / "c.yaml").write_text("model: {name_or_path: m}\ndata: d\nlora:\n  r: 16.5\n")
    with pytest.raises(ConfigError, match=r"c.yaml, line 4: `lora.r` must be int, got 16.5$"):
        load_config(str(tmp_path / "c.yaml"))
    assert (
        load_config(None, ["model.name_or_path=m", "data=d", "lora.r=16.0"]).lora.r == 16
    )  # a whole number written as a float is that number


def test_a_binary_file_is_one_line(tmp_path):
    message = refused(tmp_path, b"lora:\n  r: 8\n\x7fELF\x02\x01\x01\x00\xd0\xff", "not UTF-8 text")
    assert ", line 3:" in message and "0xd0" in message


def test_an_oversized_file_is_refused_unread(tmp_path):
    refused(tmp_path, "# padding\n" * (MAX_YAML_BYTES // 10 + 1), "larger than 1024 KiB")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(fifo))


def test_an_override_bomb_is_refused(tmp_path):
    bomb = "[" + ", ".join(["[" + ", ".join(["[" + ", ".join(["x"] * 30) + "]"] * 30) + "]"] * 30) + "]"
    with pytest.raises(ConfigError, match="override `lora.target_modules=...`.*more than"):
        load_config(None, [f"lora.target_modules={bomb}"])


def test_an_experiment_file_is_bounded_too(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(alias_bomb(5))
    with pytest.raises(SweepError, match="aliases"):
        load_yaml(path)


def test_a_lora_rank_above_the_layers_features_is_refused_before_training(
    base_overrides, tiny_model_dir, tmp_path, capsys
):
    """The tiny model's hidden size is 128 and its k_proj has 64 outputs (2 KV heads of 32): lora.r=4096 on
    all-linear is refused in one line naming the narrowest layer, before any step or output; r=64 fits."""
    from trainer_helpers import train_in_process
    from transformers import AutoModelForCausalLM

    from llmft.trainer.config import LoraConfig
    from llmft.trainer.model import apply_lora

    overrides = base_overrides("rank", max_steps=1, lora__r=4096)  # target_modules: all-linear, the default
    code, _ = train_in_process(overrides)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # not transformers' loading bar
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err
    err = errors[0]
    assert "lora.r=4096 is larger than the targeted layer" in err and "k_proj (128 -> 64 features)" in err, err
    assert "Set lora.r <= 64" in err
    assert not (tmp_path / "rank" / "final").exists() and not list((tmp_path / "rank").glob("checkpoints/step-*"))

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert apply_lora(base, LoraConfig(r=64, alpha=8, target_modules=("all-linear",))) is not None  # min(in, out)
