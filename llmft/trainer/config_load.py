"""Loading the trainer's configuration: defaults <- YAML file <- ``key=value`` overrides.

A YAML file maps 1:1 onto the tree of :mod:`llmft.trainer.config`; ``key=value`` overrides address
nested fields with dots (``lora.r=16``). Unknown keys and wrongly typed values raise
:class:`~llmft.trainer.errors.ConfigError` naming the file, line and key. Also here: the one
``key=value`` grammar of llmft (:func:`split_assignment`, :func:`parse_bool`), the config's YAML and
dict forms, and the diffs a resume checks.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
import unicodedata
from pathlib import Path
from typing import Any

import yaml

from llmft.trainer.config import TrainConfig, hints_of
from llmft.trainer.config_checks import validate
from llmft.trainer.errors import ConfigError
from llmft.trainer.yaml_limits import check_yaml_shape, compose_user_yaml, read_yaml_text

# Fields whose change does not alter the training math: allowed on resume.
RESUME_SAFE_PREFIXES = (
    "output_dir",
    "data",
    "eval_every",
    "save_every",
    "log_every",
    "keep_last",
    "resume",
    "force_resume",
    "max_bad_steps",
    "force_output_dir",
    "wait_for_output_dir",
    "max_restarts_without_progress",
    "gc_every",
    "observe.",
    "eval.",
    "debug.",
    "distributed.",
    "batch.micro_sequences",
    "kernels.",
    "model.attn_implementation",
    "model.gradient_checkpointing",
)


class _Source:
    """Where a value came from, for error messages (file + line, or the override)."""

    def __init__(self, path: str | None):
        self.path = path or "<defaults>"
        self.lines: dict[str, int] = {}
        self.overridden: set[str] = set()
        self.names: dict[str, str] = {}  # key -> where a program took it from (e.g. a pipeline parameter)
        self.override_label = "override"  # what the key=value items are called (e.g. train_overrides)

    def where(self, key: str) -> str:
        """The file and line, or the override, that set ``key``: also an override of a key below it (``k0.x=1``
        made the unknown ``k0``) or above it (``lora.r.x=4`` made ``lora.r`` a mapping)."""
        related = [k for k in self.overridden if k == key or k.startswith(key + ".") or key.startswith(k + ".")]
        if related:
            return f"{self.override_label} `{shown(min(related, key=len))}=...`"
        if key in self.lines:
            return f"{self.path}, line {self.lines[key]}"
        return self.names.get(key, self.path)


def shown(text: str) -> str:
    """``text`` with its control characters escaped (a newline as ``\\n``): an error that echoes what the user typed
    stays one line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


def _non_ascii_note(key: str) -> str:
    """Why a key that looks right is unknown: a letter from another alphabet (a Cyrillic о for o)."""
    odd = [c for c in key if not c.isascii()]
    if not odd:
        return ""
    return (
        f"; `{key}` holds {odd[0]!r} (U+{ord(odd[0]):04X} {unicodedata.name(odd[0], 'a non-ASCII character')}), "
        "not an ASCII letter: type the key again"
    )


def _compose_yaml(path: Path, source: _Source) -> dict:
    node = compose_user_yaml(read_yaml_text(path), str(path))  # bounded: size, depth, aliases expanded
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}, line {node.start_mark.line + 1}: the config must be a mapping of keys to values")
    return _node_to_dict(node, "", source)


PLAIN_TAGS = frozenset(
    "tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null", "timestamp", "map", "seq")
)


def _check_plain(node: yaml.Node, source: _Source) -> None:
    """Only plain values, lists and mappings: a tag such as ``!!python/object`` is refused (it
    would construct an object, which a config never needs)."""
    if node.tag not in PLAIN_TAGS:
        raise ConfigError(
            f"{source.path}, line {node.start_mark.line + 1}: YAML tag {node.tag.replace('tag:yaml.org,2002:', '!!')} "
            "is not allowed; a config holds plain values, lists and mappings only"
        )
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_plain(item, source)


def _node_to_dict(node: yaml.MappingNode, prefix: str, source: _Source) -> dict:
    _check_plain(node, source)
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        _check_plain(key_node, source)
        key = prefix + str(key_node.value)
        if key in source.lines:  # YAML would keep the last one silently
            raise ConfigError(
                f"{source.path}, line {key_node.start_mark.line + 1}: `{shown(key)}` is written twice (first on line "
                f"{source.lines[key]}); a mapping holds each key once: delete one"
            )
        source.lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            out[str(key_node.value)] = _node_to_dict(value_node, key + ".", source)
        else:
            _check_plain(value_node, source)
            out[str(key_node.value)] = yaml.safe_load(yaml.serialize(value_node))
    return out


BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
"""The words a ``key=value`` boolean may be, everywhere (trainer, pipeline arguments, sweep settings)."""


def split_assignment(text: str, example: str = "lora.r=16") -> tuple[str, str]:
    """``key=value`` -> (key, raw value): the one key=value grammar of llmft (the trainer's overrides,
    the pipeline's arguments, the sweep's settings). The key is stripped; the value is kept as written."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"`{text}`: expected key=value (for example {example})")
    return key.strip(), raw


def parse_bool(raw: str) -> bool:
    """A boolean word of :data:`BOOL_WORDS` (any case); ValueError otherwise."""
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise ValueError(raw) from None


def _apply_override(tree: dict, text: str, source: _Source) -> None:
    try:
        key, raw = split_assignment(text)
    except ConfigError:
        raise ConfigError(f"override `{shown(text)}`: expected key=value (for example lora.r=16)") from None
    try:
        check_yaml_shape(raw, f"override `{shown(key)}=...`")
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override `{shown(text)}`: not a plain YAML value ({' '.join(str(exc).split())})") from None
    node = tree
    parts = key.split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(
            f"override `{shown(text)}`: `{shown(key)}` has an empty name between dots; write e.g. lora.r=16"
        )
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override `{shown(text)}`: `{shown(part)}` is not a section")
    node[parts[-1]] = value
    source.overridden.add(key)


def load_config_checked(path: str | None, overrides: list[str] | None = None) -> tuple[TrainConfig, list[str]]:
    """Defaults <- YAML file <- ``key=value`` overrides, type-checked and validated once; the config
    and the warnings to log."""
    source = _Source(path)
    tree = _compose_yaml(Path(path), source) if path else {}
    return _resolve(tree, overrides or [], source)


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """:func:`load_config_checked` without the warnings."""
    return load_config_checked(path, overrides)[0]


def resolve_config(
    settings: dict,
    overrides: typing.Sequence[str] = (),
    *,
    source_name: str = "<settings>",
    names: typing.Mapping[str, str] | None = None,
    override_label: str = "override",
) -> tuple[TrainConfig, list[str]]:
    """Defaults <- ``settings`` (a nested dict of typed values, e.g. ``{"lora": {"r": 16}}``) <-
    ``key=value`` overrides, type-checked and validated once: what a program that holds typed values
    (the pipeline's plan step) builds a config from, with the same checks as a YAML file. ``names``
    (dotted key -> e.g. "pipeline parameter `lora_r`") and ``override_label`` (e.g. "train_overrides")
    say where a bad value came from."""
    source = _Source(source_name)
    source.names, source.override_label = dict(names or {}), override_label
    return _resolve(_deep_copy(settings), list(overrides), source)


def _deep_copy(tree: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _resolve(tree: dict, overrides: list[str], source: _Source) -> tuple[TrainConfig, list[str]]:
    for text in overrides:
        _apply_override(tree, text, source)
    cfg = _build(TrainConfig, tree, "", source)
    return cfg, validate(cfg, source.where)


def config_to_yaml(cfg: TrainConfig) -> str:
    """The whole config as YAML (every field, in declaration order): what ``--print-config`` prints
    and what the plan step writes as ``config.yaml``."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_from_dict(data: dict, source_name: str = "<dict>") -> TrainConfig:
    """Rebuild a config from :func:`config_to_dict` output (e.g. a checkpoint's train_config.json)."""
    return _build(TrainConfig, data, "", _Source(source_name))


def config_to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists), JSON/YAML-serialisable."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = config_to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def _build(cls, data: Any, prefix: str, source: _Source):
    section = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source.where(prefix.rstrip('.'))}: `{section}` must be a mapping")
    hints = hints_of(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{source.where(prefix + str(key))}: unknown key `{shown(prefix + str(key))}` "
                f"(known keys in {section}: {', '.join(sorted(known))}){_non_ascii_note(str(key))}"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], prefix + f.name + ".", source)
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, prefix + f.name, source)
    return cls(**kwargs)


def _coerce(value: Any, tp, key: str, source: _Source) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if isinstance(value, str) and value.strip().lower() in words:
            return value.strip().lower()
        tp = next(a for a in args if a is not type(None) and typing.get_origin(a) is not typing.Literal)
        if words:  # auto | bool, auto | int: the word, or a value of the other type
            try:
                return _coerce(value, tp, key, source)
            except ConfigError:
                raise _type_error(key, value, " or ".join([*words, tp.__name__]), source) from None
    if typing.get_origin(tp) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise _type_error(key, value, "a list", source)
        return tuple(_coerce(v, args[0] if args else str, key, source) for v in value)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str):  # a word YAML does not read as a boolean (e.g. "1" quoted)
                return parse_bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, dict | list):
                raise ValueError
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        raise _type_error(key, value, tp.__name__, source) from None
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _type_error(key: str, value: Any, expected: str, source: _Source) -> ConfigError:
    return ConfigError(f"{source.where(key)}: `{key}` must be {expected}, got {value!r}")


def diff_configs(old: dict, new: dict, *, ignore_prefixes: tuple[str, ...] = RESUME_SAFE_PREFIXES) -> list[str]:
    """Lines `key: old -> new` for every leaf that differs and is not resume-safe."""
    lines = []
    flat_old, flat_new = flatten_dict(old), flatten_dict(new)
    for key in sorted(set(flat_old) | set(flat_new)):
        if any(key == p or key.startswith(p if p.endswith(".") else p + ".") for p in ignore_prefixes):
            continue
        a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if a != b:
            lines.append(f"{key}: {a!r} -> {b!r}")
    return lines


def changed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """Dotted key -> value of every leaf that differs from the defaults (what a command line without
    the config file must carry to rebuild ``cfg``)."""
    default = flatten_dict(config_to_dict(TrainConfig()))
    return {k: v for k, v in flatten_dict(config_to_dict(cfg)).items() if default.get(k) != v}


def flatten_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"lora": {"r": 8}} -> {"lora.r": 8}: the dotted names `key=value` overrides use."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_dict(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def nest_dotted(flat: typing.Mapping[str, Any]) -> dict:
    """{"lora.r": 8} -> {"lora": {"r": 8}}: the inverse of :func:`flatten_dict`."""
    tree: dict = {}
    for dotted, value in flat.items():
        *sections, leaf = dotted.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return tree
