"""`llmft --help` and the README's command reference must agree."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

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
