"""`llmft --help` and the README's command reference must agree."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmft import cli
from llmft.cli import GROUPS, build_group_parser, main


def _subcommands(group: str) -> set[str]:
    parser = build_group_parser(group)
    for action in parser._actions:  # argparse keeps sub-parsers here
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()  # a group that is itself one command (train)


def _cli_commands() -> set[str]:
    commands = set()
    for group in GROUPS:
        subs = _subcommands(group)
        commands |= {f"llmft {group} {s}" for s in subs} if subs else {f"llmft {group}"}
    return commands


@pytest.mark.slow
def test_top_level_help_lists_every_group():
    out = subprocess.run([sys.executable, "-m", "llmft", "--help"], capture_output=True, text=True, check=True).stdout
    for group in GROUPS:
        assert re.search(rf"^\s+{group}\s", out, re.M), f"`{group}` missing from llmft --help"


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_group_has_help(group, capsys):
    with pytest.raises(SystemExit) as exc:
        main([group, "--help"])
    assert exc.value.code == 0
    assert "usage: llmft " + group in capsys.readouterr().out


def test_unknown_group_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-group"])
    assert exc.value.code == 2


def test_readme_command_reference_matches_cli(repo_root):
    readme = (repo_root / "README.md").read_text()
    section = readme.split("## Command reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(llmft [a-z-]+(?: [a-z-]+)?)", section, re.M))
    assert documented == _cli_commands(), (
        f"README only: {sorted(documented - _cli_commands())}; CLI only: {sorted(_cli_commands() - documented)}"
    )


def _lora_adapter(directory: Path, **config) -> Path:
    """A minimal PEFT LoRA folder: adapter_config.json (``config`` over r 8, one q_proj) and zero weights."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": "x", "r": 8, "target_modules": ["q_proj"], **config}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors = {f"base_model.model.q_proj.lora_{ab}.weight": torch.zeros(8, 8) for ab in "AB"}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def test_an_adapter_config_without_lora_alpha_is_bad_input_not_a_bug(tmp_path):
    """Found by the probe: a KeyError (exit 3, "internal error") before; now exit 1 naming the file and field."""
    from llmft.trainer.errors import ConfigError
    from llmft.trainer.merge import read_adapter

    with pytest.raises(ConfigError, match=r"adapter_config\.json: no lora_alpha field"):
        read_adapter(_lora_adapter(tmp_path / "adapter"))


@pytest.mark.slow
def test_an_export_refusal_is_the_only_line_on_stderr(tmp_path):
    """peft imports bitsandbytes, whose CPU backend warns at import on AVX512-BF16 CPUs (H100 hosts among them)
    that it cannot fetch an optional kernel from a hub: that warning stood before the one-line error."""
    adapter = _lora_adapter(tmp_path / "adapter", lora_alpha=16)
    (adapter / "generation_config.json").symlink_to("/etc/passwd")
    llmft = str(Path(sys.executable).parent / "llmft")
    out = subprocess.run(
        [llmft, "export", "--adapter", str(adapter), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "is a symlink" in out.stderr, out.stderr


def test_train_takes_options_between_key_value_words(tmp_path, capsys):
    """`llmft train lora.r=8 --config f.yaml data=...` (an override, then the config, then more): argparse
    alone stops at the option and refuses the words after it (exit 2)."""
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  name_or_path: some/model\nlora:\n  alpha: 64\n")
    assert main(["train", "lora.r=8", "--config", str(config), "data=/d", "--print-config", "seed=3"]) == 0
    printed = capsys.readouterr().out
    assert "  r: 8\n" in printed and "  alpha: 64.0\n" in printed
    assert "data: /d\n" in printed and "seed: 3\n" in printed


def test_a_group_whose_extra_is_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    """A group module that imports a package this install lacks (the light packages of an extra are imported at
    module level: docs/architecture.md) is one line naming the package and the extra, exit 1, no traceback."""
    (tmp_path / "group_without_its_extra.py").write_text("import no_such_package_of_an_extra\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.GROUPS, "sweep", ("group_without_its_extra", "sweeps"))
    monkeypatch.delenv("LLMFT_DEBUG", raising=False)
    assert cli.main(["sweep", "status"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "'no_such_package_of_an_extra'" in err
    assert "pip install 'kfp-llm-finetune[pipeline,katib]'" in err


def test_every_group_names_extras_that_setup_cfg_defines(repo_root):
    import configparser

    parser = configparser.ConfigParser()
    parser.read(repo_root / "setup.cfg", encoding="utf-8")
    defined = set(parser["options.extras_require"])
    assert set(cli.GROUP_EXTRAS) == set(cli.GROUPS)
    named = {extra for extras in cli.GROUP_EXTRAS.values() for extra in extras.split(",")}
    assert named <= defined, sorted(named - defined)
