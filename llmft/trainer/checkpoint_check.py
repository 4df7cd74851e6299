"""Whether a committed checkpoint reads as whole, checked before anything is loaded.

A checkpoint carries its ``COMPLETE`` marker only after every file was written and fsynced
(llmft/trainer/checkpoint.py), but a file can still go bad afterwards: truncated by a full or flaky volume,
or edited by hand. Loading such a file fails deep inside torch, safetensors or json (exit 3), or,
for ``optimizer.pt``, after minutes of model loading. :func:`checkpoint_problem` reads only what a
few bytes tell (every JSON file parsed, adapter_config.json among them; safetensors headers against
the file size, the zip directory of the torch files against theirs) and returns one line naming the
first bad file, or None.

What the trainer does with a bad one (llmft/trainer/rundir.py, docs/failure-modes.md): ``resume=auto`` never
resumes from it; it falls back to the newest checkpoint that passes, warns naming the bad file, and
sets the bad folder aside as ``step-N.corrupt`` (kept, never pruned). ``resume=<path>`` naming a
bad one is refused (exit 1).
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.json"  # not config.json: full weights carry the HF model config.json
SCHEDULER_FILE = "scheduler.json"
OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_DIR = "deepspeed"
_STATE_INTS = ("step", "tokens_seen", "skipped_steps")


class Corrupt(Exception):
    """One file of a checkpoint that cannot be what the trainer wrote; the message names it."""


def checkpoint_problem(path: Path) -> str | None:
    """None when every file of the committed checkpoint ``path`` reads as whole, else one line naming
    the first bad file and what is wrong with it. An I/O error (OSError) is raised, not reported: it
    is transient, not a bad checkpoint."""
    try:
        _check_state(path)
        _json_object(path / CONFIG_FILE)
        if (path / SCHEDULER_FILE).exists() or not (path / "scheduler.pt").is_file():
            _json_object(path / SCHEDULER_FILE)
        for rng in sorted((path / "rng").glob("rank-*.json")):
            _json_object(rng)
        for other in sorted(set(path.glob("*.json")) - {path / STATE_FILE, path / CONFIG_FILE, path / SCHEDULER_FILE}):
            _json_object(other)  # adapter_config.json, config.json, the tokenizer's: every JSON file of it
        _check_weights(path)
        torch_files = sorted((path / DEEPSPEED_DIR).rglob("*.pt")) if (path / DEEPSPEED_DIR).is_dir() else []
        for file in torch_files or [path / OPTIMIZER_FILE]:
            zip_problem(file)
    except Corrupt as exc:
        return str(exc)
    return None


def _json_object(file: Path) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Corrupt(f"{file}: missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise Corrupt(f"{file}: not valid JSON ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(value, dict):
        raise Corrupt(f"{file}: holds a JSON {type(value).__name__}, not the object the trainer writes")
    return value


def _check_state(path: Path) -> None:
    state = _json_object(path / STATE_FILE)
    for key in _STATE_INTS:
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Corrupt(f"{path / STATE_FILE}: {key} is {value!r}, not a count")
    if "step" not in state:
        raise Corrupt(f"{path / STATE_FILE}: no step")
    match = STEP_DIR.match(path.name)
    if match and state["step"] != int(match.group(1)):
        raise Corrupt(
            f"{path / STATE_FILE}: step {state['step']} inside {path.name}: the state is not this checkpoint's"
        )
    if not isinstance(state.get("run_id", ""), str | None):
        raise Corrupt(f"{path / STATE_FILE}: run_id is {state['run_id']!r}, not a string")


def _check_weights(path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise Corrupt(f"{path}: no weights (*.safetensors)")
    for file in files:
        safetensors_problem(file)


def safetensors_problem(file: Path) -> None:
    """Corrupt unless ``file`` is a safetensors file whose header parses and whose tensors end exactly
    at the end of the file (the format: 8-byte little-endian header length, the JSON header, the bytes;
    https://github.com/huggingface/safetensors README "Format")."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise Corrupt(f"{file}: truncated ({size} bytes, shorter than a safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise Corrupt(f"{file}: truncated (its header alone needs {length:,} bytes; the file has {size:,})")
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError):
            raise Corrupt(f"{file}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise Corrupt(f"{file}: corrupt safetensors header (not an object)")
    ends = [_data_end(file, name, entry) for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        state = "truncated" if expected > size else "longer than its tensors"
        raise Corrupt(f"{file}: {state} (its tensors end at byte {expected:,}; the file has {size:,})")


def _data_end(file: Path, name: str, entry) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise Corrupt(f"{file}: corrupt safetensors header (tensor {name!r} has no data_offsets)")
    return offsets[1]


def zip_problem(file: Path) -> None:
    """Corrupt unless ``file`` (a ``torch.save`` file: a zip archive) has its whole zip directory and every
    member it lists lies inside the file; a truncated file loses the directory at its end."""
    try:
        size = file.stat().st_size
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
    except FileNotFoundError:
        raise Corrupt(f"{file}: missing") from None
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise Corrupt(f"{file}: truncated or corrupt (not a complete torch file: {exc})") from None
    for info in members:
        if info.header_offset + info.compress_size > size:
            raise Corrupt(f"{file}: truncated (member {info.filename} runs past the end of the file)")
