"""Config tree: shipped configs, errors that name file/line/key, overrides, docs, schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from llmft.trainer.config import TrainConfig, iter_fields
from llmft.trainer.config_checks import validate
from llmft.trainer.config_load import config_from_dict, config_to_dict, diff_configs, load_config
from llmft.trainer.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "trainer" / "configs").glob("*.yaml"))


def test_three_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny-cpu.yaml", "qwen2.5-7b-lora-1xh100.yaml", "qwen3-30b-a3b-qlora-2x8xh100.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    raw = yaml.safe_load(path.read_text())
    cfg = load_config(str(path), [])
    validate(cfg)
    flat = config_to_dict(cfg)
    for section, values in raw.items():  # every key in the file landed in the tree unchanged
        if isinstance(values, dict):
            for key, value in values.items():
                got = flat[section][key]
                assert got == value or (isinstance(value, float | int) and math.isclose(got, value)), (section, key)
        else:
            assert flat[section] == values
    assert config_from_dict(flat) == cfg


def test_shipped_configs_describe_the_intended_runs():
    by_name = {p.name: load_config(str(p), []) for p in CONFIGS}
    qwen7 = by_name["qwen2.5-7b-lora-1xh100.yaml"]
    assert qwen7.method == "lora" and qwen7.model.dtype == "bfloat16" and qwen7.distributed.backend == "ddp"
    moe = by_name["qwen3-30b-a3b-qlora-2x8xh100.yaml"]
    assert moe.method == "qlora" and moe.distributed.backend == "deepspeed" and moe.distributed.zero_stage == 3
    assert moe.model.name_or_path == "Qwen/Qwen3-30B-A3B" and moe.batch.global_sequences % 16 == 0
    assert by_name["tiny-cpu.yaml"].model.dtype == "float32"


def test_deepspeed_config_for_the_two_node_run():
    from llmft.trainer.distributed import deepspeed_config

    moe = load_config(str(next(p for p in CONFIGS if p.name == "qwen3-30b-a3b-qlora-2x8xh100.yaml")), [])
    accum = moe.batch.global_sequences // 16 // moe.batch.micro_sequences
    ds = deepspeed_config(
        moe.distributed.zero_stage, accum_steps=accum, world_size=16, max_grad_norm=moe.optim.max_grad_norm, bf16=True
    )
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 16
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True} and ds["gradient_clipping"] == 1.0


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name_or_path: x\ndata: d\nlora:\n  r: 8\n  rnak: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), [])
    message = str(err.value)
    assert f"{path}, line 6" in message and "`lora.rnak`" in message and "r, target_modules" in message
    with pytest.raises(ConfigError, match="unknown key `nope`"):
        load_config(None, ["nope=1"])


def test_wrong_types_and_values_are_rejected_with_the_field(tmp_path):
    path = tmp_path / "typed.yaml"
    path.write_text("model:\n  name_or_path: x\ndata: d\nmax_steps: ten\n")
    with pytest.raises(ConfigError, match=r"line 4: `max_steps` must be int, got 'ten'"):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match="`method` is 'sft'; allowed values: lora, qlora, full"):
        load_config(None, ["model.name_or_path=x", "data=d", "method=sft"])
    with pytest.raises(ConfigError, match="`lora.dropout` must be in"):
        load_config(None, ["model.name_or_path=x", "data=d", "lora.dropout=1.5"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["lora.r"])
    with pytest.raises(ConfigError, match="`data` is required"):
        load_config(None, ["model.name_or_path=x"])


def test_overrides_nest_and_coerce():
    cfg = load_config(
        None,
        [
            "model.name_or_path=m",
            "data=d",
            "lora.r=32",
            "optim.lr=2e-5",
            "lora.target_modules=q_proj,v_proj",
            "debug.nan_steps=[3,4]",
            "model.gradient_checkpointing=true",
            "model.revision=null",
        ],
    )
    assert cfg.lora.r == 32 and cfg.optim.lr == 2e-5 and cfg.model.gradient_checkpointing is True
    assert cfg.lora.target_modules == ("q_proj", "v_proj") and cfg.debug.nan_steps == (3, 4)
    assert cfg.model.revision is None and cfg.model.attn_implementation == "auto"  # the default
    assert cfg.model.trust_remote_code is False and cfg.resume == "auto"
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lora.r = 1  # type: ignore[misc]


def test_every_field_has_a_doc_line():
    fields = list(iter_fields())
    names = [name for name, *_ in fields]
    assert len(names) == len(set(names))
    flat = _flatten(config_to_dict(TrainConfig()))
    assert set(names) == set(flat)
    for name, type_name, _default, doc in fields:
        assert doc and "\n" not in doc and doc.endswith("."), name
        assert type_name in (
            "str",
            "int",
            "float",
            "bool",
            "str | null",
            "list[str]",
            "list[int]",
            "auto | bool",
            "auto | int",
        ), (name, type_name)
    assert ("method", "str", "lora") == tuple(next(f for f in fields if f[0] == "method")[:3])
    assert "One of: lora, qlora, full." in dict((f[0], f[3]) for f in fields)["method"]


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def test_dora_warns_that_vllm_cannot_serve_it():
    cfg = load_config(None, ["model.name_or_path=m", "data=d", "lora.use_dora=true"])
    assert any("vLLM cannot serve DoRA" in w for w in validate(cfg))
    assert not validate(load_config(None, ["model.name_or_path=m", "data=d"]))


def test_resume_diff_ignores_operational_fields():
    old = config_to_dict(load_config(None, ["model.name_or_path=m", "data=d"]))
    new = config_to_dict(
        load_config(
            None,
            [
                "model.name_or_path=m",
                "data=/elsewhere",
                "log_every=1",
                "eval_every=5",
                "debug.kill_at_step=3",
                "optim.lr=1e-3",
            ],
        )
    )
    assert diff_configs(old, new) == ["optim.lr: 0.0002 -> 0.001"]


def test_lr_schedule_warmup_then_cosine_and_linear():
    from llmft.trainer.optim import lr_multiplier

    cosine = [lr_multiplier(s, total_steps=10, warmup=2, decay="cosine", min_lr_ratio=0.1) for s in range(10)]
    assert cosine[:2] == [0.5, 1.0] and cosine[2] == 1.0
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False)) and cosine[-1] > 0.1
    assert lr_multiplier(10, total_steps=10, warmup=2, decay="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    linear = [lr_multiplier(s, total_steps=4, warmup=0, decay="linear", min_lr_ratio=0.0) for s in range(4)]
    assert linear == [1.0, 0.75, 0.5, 0.25]
    assert lr_multiplier(7, total_steps=10, warmup=2, decay="constant", min_lr_ratio=0.0) == 1.0


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf", "-1e-4", "0"])
def test_learning_rate_must_be_a_finite_positive_number(value):
    with pytest.raises(ConfigError, match=r"optim\.lr") as err:
        load_config(None, ["model.name_or_path=m", "data=d", f"optim.lr={value}"])
    assert "\n" not in str(err.value)


def test_no_float_setting_accepts_infinity_or_nan():
    for key in ("lora.alpha", "optim.max_grad_norm", "epochs", "schedule.min_lr_ratio", "observe.peak_tflops"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(None, ["model.name_or_path=m", "data=d", f"{key}=.nan"])


def test_python_yaml_tags_are_a_one_line_error_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    config = tmp_path / "bad.yaml"
    config.write_text(f"model:\n  name_or_path: m\nseed: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(config), ["data=d"])
    message = str(err.value)
    assert f"{config}, line 3" in message and "!!python/object/apply:os.system" in message and "\n" not in message
    with pytest.raises(ConfigError, match="not a plain YAML value"):
        load_config(
            None, ["model.name_or_path=m", "data=d", f"seed=!!python/object/apply:os.system ['touch {marker}']"]
        )
    nested = tmp_path / "nested.yaml"
    nested.write_text("lora:\n  target_modules:\n    - q_proj\n    - !!python/name:os.system\n")
    with pytest.raises(ConfigError, match=r"line 4"):
        load_config(str(nested), [])
    assert not marker.exists()


def test_a_trainer_start_validates_the_config_once(tmp_path, monkeypatch, capsys):
    """Issue 26: the loader validates, and the trainer's entry point uses the warnings it returned (it
    validated twice before: in load_config, then again for the warnings)."""
    import llmft.trainer.config_load as config_module
    from llmft.trainer.__main__ import main

    calls = []
    real = config_module.validate
    monkeypatch.setattr(config_module, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))
    code = main([f"model.name_or_path={tmp_path}/no-model", f"data={tmp_path}/d", f"output_dir={tmp_path}/out"])
    assert code == 1 and "no such directory" in capsys.readouterr().err  # stopped at the model, after validating
    assert len(calls) == 1


def test_every_short_setting_name_names_a_trainer_key():
    """SETTING_NAMES (the pipeline's and the sweep's names of trainer settings) holds real keys only."""
    from llmft.trainer.config import SETTING_NAMES, iter_fields

    keys = {key for key, *_ in iter_fields()}
    assert set(SETTING_NAMES.values()) <= keys, sorted(set(SETTING_NAMES.values()) - keys)
    assert len(set(SETTING_NAMES.values())) == len(SETTING_NAMES)  # one short name per key


def test_nest_dotted_is_the_inverse_of_flatten_dict():
    from llmft.trainer.config_load import flatten_dict, nest_dotted

    tree = {"lora": {"r": 8, "target_modules": "q_proj,v_proj"}, "optim": {"lr": 1e-4}, "seed": 3}
    assert nest_dotted(flatten_dict(tree)) == tree
    assert nest_dotted({"observe.run_name": "x", "observe.mlflow_experiment": "e"}) == {
        "observe": {"run_name": "x", "mlflow_experiment": "e"}
    }
