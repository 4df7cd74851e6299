"""Bounds on the YAML files a user hands the program (``--config``, ``--from-yaml``) and on ``key=value`` values.

YAML aliases make a few lines stand for an exponential tree (``a: &a [x, x, x]``, ``b: &b [*a, *a, *a]``, ...):
PyYAML composes the shared nodes cheaply, but anything that walks the result (type checks, validation, a
serializer) visits every expanded node, so a 9-line file kept the trainer busy for minutes. A document
nested 50,000 deep makes PyYAML's recursive composer overflow the stack (RecursionError, an "internal
error"). And a file that is not text (a binary pasted as --config) failed UnicodeDecodeError. Every such
input is now one :class:`~llmft.trainer.errors.ConfigError` line (exit 1), found before anything walks it:
the file is read at most :data:`MAX_YAML_BYTES`, decoded as UTF-8, and its events (PyYAML's parser is
iterative, so this never recurses) are scanned once for depth and for the node count with every alias
expanded.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from llmft.trainer.errors import ConfigError

MAX_YAML_BYTES = 1 << 20
"""Largest YAML file read (1 MiB): a trainer config is a few KiB, a Katib Experiment a few tens of KiB."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists (a config nests 3 deep, an Experiment about 15)."""
MAX_YAML_NODES = 20_000
"""Most values (scalars, lists, mappings) with every alias expanded: about 100x what a real file holds."""


def read_yaml_text(path: str | os.PathLike, what: str = "config file") -> str:
    """The text of the YAML file ``path``: a regular file (a FIFO would block) of at most
    :data:`MAX_YAML_BYTES`, UTF-8 (a BOM is dropped). Anything else is one ConfigError naming the file."""
    path = Path(path)
    try:
        if not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "missing"
            raise ConfigError(f"{path}: cannot read the {what}: {kind}; give the path of a YAML file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{path}: the {what} is larger than {MAX_YAML_BYTES // 1024} KiB; a YAML {what} is a small text file "
            "(check the path)"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}, line {line}: the {what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "give a YAML text file, saved as UTF-8"
        ) from None


def check_yaml_shape(text: str, where: str) -> None:
    """Refuse ``text`` (one ConfigError naming ``where`` and the line) when its nesting is deeper than
    :data:`MAX_YAML_DEPTH` or it holds more than :data:`MAX_YAML_NODES` values once its aliases are expanded.
    Syntax errors are left to the caller's own parse (yaml.YAMLError)."""
    anchors: dict[str, int] = {}
    open_nodes: list[list] = []  # [anchor, expanded size so far] of each mapping/list being read
    for event in yaml.parse(text):
        if isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append([event.anchor, 1])
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{where}, line {_line(event)}: nested deeper than {MAX_YAML_DEPTH} levels; "
                    "a config is a few levels of mappings and lists"
                )
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, anchors.get(event.anchor or "", 1)
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        else:
            continue
        if anchor is not None:
            anchors[anchor] = size
        if open_nodes:
            open_nodes[-1][1] += size
        if size > MAX_YAML_NODES or (open_nodes and open_nodes[-1][1] > MAX_YAML_NODES):
            raise ConfigError(
                f"{where}, line {_line(event)}: more than {MAX_YAML_NODES:,} values once its aliases "
                "(*name) are expanded; write the values out, or use fewer aliases"
            )


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark is not None else 0


def compose_user_yaml(text: str, where: str) -> yaml.Node | None:
    """``yaml.compose(text)`` after :func:`check_yaml_shape`; a syntax error is one ConfigError line."""
    try:
        check_yaml_shape(text, where)
        return yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_user_yaml(text: str, where: str):
    """``yaml.safe_load(text)`` after :func:`check_yaml_shape`; a syntax error is one ConfigError line."""
    try:
        check_yaml_shape(text, where)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
