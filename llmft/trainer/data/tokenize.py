"""``llmft data tokenize``: canonical JSONL -> tokenized, packed, cached shards.

For every split in the input directory (``train.jsonl``, ``val.jsonl``,
``test.jsonl``) the rows are rendered with the tokenizer's own chat template,
tokenized in batches by the fast tokenizer across ``num_proc`` processes, masked
to the assistant turns (text rows train on every token), cut to ``max_length``
by ``truncation``, and, with ``pack``, best-fit packed into sequences of at most
``max_length`` tokens. The result is the on-disk format of
:mod:`llmft.trainer.data.shards` plus ``manifest.json``; the directory appears
atomically, with a completion marker.

The cache key hashes the data files, the tokenizer (vocabulary, merges, added
and special tokens), the chat template, max length, packing and truncation. A
complete output directory with the same key is left untouched (``cache hit``).

Nothing silent: when more than ``max_drop_fraction`` of the rows (all splits
together) are dropped (too long, no trainable token, template errors) the run
fails with the counts per reason, cache hit or not. A document whose character
count alone proves it longer than ``max_length`` tokens is dropped without being
tokenized. ``output_dir`` is replaced only when llmft wrote it (or ``force``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import jinja2
import numpy as np

from llmft.trainer.data.encode import EncodePlan, encode_chunk, init_worker
from llmft.trainer.data.limits import DEFAULT_MAX_DROP_FRACTION, NORMALIZER_SLACK
from llmft.trainer.data.packing import best_fit_pack, packing_efficiency
from llmft.trainer.data.parallel import default_num_proc, ordered_map, worker_pool
from llmft.trainer.data.progress import progress
from llmft.trainer.data.shards import MANIFEST
from llmft.trainer.data.template_limits import TemplateTooSlow
from llmft.trainer.data.templates import (
    end_of_turn_marker,
    missing_template_error,
    resolve_chat_template,
    template_hash,
)
from llmft.trainer.errors import DataError
from llmft.trainer.io import atomic_directory, atomic_write_json, check_output_target, is_complete, sha256_file
from llmft.trainer.output_lock import output_lock
from llmft.trainer.tokenizer import load_tokenizer

FORMAT_VERSION = 2  # 2: replies located in their own turn and tokenized as their own pieces (new labels)
SPLITS = ("train", "val", "test")
TRUNCATION_CHOICES = ("drop", "truncate", "error")
CHUNK_BYTES = 1 << 19  # ~500 rows of Alpaca-sized JSON per worker task
COPY_BLOCK_TOKENS = 1 << 22  # tokens per block copy when writing unpacked shards
MAX_EXAMPLES = 10
TOKENIZED_KIND = "tokenized-dataset"


def tokenize_dataset(
    input_dir: str | os.PathLike,
    model: str,
    output_dir: str | os.PathLike,
    *,
    max_length: int = 2048,
    pack: bool = True,
    truncation: str = "drop",
    num_proc: int | None = None,
    chat_template: str | None = None,
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION,
    force: bool = False,
    revision: str | None = None,
) -> dict:
    """Tokenize every split of a prepared dataset; return the manifest (``cache_hit`` set). ``revision``
    pins a hub model's tokenizer to the revision the trainer loads (``model.revision``)."""
    output_dir = Path(output_dir)
    _check_drop_fraction(max_drop_fraction)
    inputs = (input_dir, *([model] if Path(model).exists() else []))
    check_output_target(output_dir, kind=TOKENIZED_KIND, force=force, inputs=inputs)
    split_files, tokenizer, plan, identity = _resolve_inputs(
        input_dir,
        model,
        max_length=max_length,
        pack=pack,
        truncation=truncation,
        num_proc=num_proc,
        chat_template=chat_template,
        revision=revision,
    )
    with output_lock(output_dir):  # a second tokenize of the same folder waits, then finds the first's cache hit
        cached = cached_manifest(output_dir, identity["cache_key"])
        if cached is not None:
            check_dropped(cached, max_drop_fraction)
            print(f"cache hit: {output_dir} already holds cache key {identity['cache_key'][:16]}; nothing rewritten")
            return {**cached, "cache_hit": True}
        started = time.perf_counter()
        with atomic_directory(output_dir, kind=TOKENIZED_KIND, marker=True, force=force, inputs=inputs) as tmp:
            splits = _tokenize_splits(split_files, tmp, tokenizer, plan, pack, num_proc or default_num_proc())
            manifest = {**identity, "cache_hit": False, "splits": splits}
            check_dropped(manifest, max_drop_fraction)
            manifest["created_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")  # noqa: UP017
            manifest["seconds"] = round(time.perf_counter() - started, 3)
            atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


def check_dropped(manifest: dict, max_drop_fraction: float) -> None:
    """DataError when more than ``max_drop_fraction`` of all rows were dropped, with counts per reason."""
    splits = manifest.get("splits") or {}
    rows = sum(int(s.get("rows", 0)) for s in splits.values())
    dropped = {name: Counter(s.get("dropped") or {}) for name, s in splits.items()}
    total = sum(sum(c.values()) for c in dropped.values())
    if rows == 0 or total / rows <= max_drop_fraction:
        return
    reasons = sum(dropped.values(), Counter())
    by_reason = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common())
    examples = [e for s in splits.values() for e in s.get("dropped_examples", [])][:3]
    first = "; ".join(f"{e['file']}:{e['line']}: {e['reason']}: {e['detail']}" for e in examples)
    raise DataError(
        f"{total} of {rows} rows dropped ({total / rows:.2%}), above --max-drop-fraction {max_drop_fraction:.2%}: "
        f"{by_reason}. First: {first}. Fix: raise --max-length or use --truncation truncate for too_long rows, "
        "fix the rows, or raise --max-drop-fraction if dropping them is intended"
    )


def _check_drop_fraction(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise DataError(f"--max-drop-fraction {value} must be in [0, 1]")


def cache_key_for(
    input_dir: str | os.PathLike,
    model: str,
    *,
    max_length: int = 2048,
    pack: bool = True,
    truncation: str = "drop",
    chat_template: str | None = None,
    revision: str | None = None,
) -> str:
    """The cache key ``tokenize_dataset`` gives these inputs, without tokenizing anything
    (loads the tokenizer and hashes the data files). Lets a pipeline pick a content-addressed
    output folder before calling ``tokenize_dataset``."""
    return _resolve_inputs(
        input_dir,
        model,
        max_length=max_length,
        pack=pack,
        truncation=truncation,
        num_proc=None,
        chat_template=chat_template,
        revision=revision,
    )[3]["cache_key"]


def _resolve_inputs(input_dir, model, *, max_length, pack, truncation, num_proc, chat_template, revision=None):
    """Validate arguments, find the splits, load the tokenizer and template; return
    (split files, tokenizer, plan, identity incl. cache key)."""
    _check_arguments(max_length, truncation, num_proc)
    input_dir = Path(input_dir)
    split_files = find_split_files(input_dir)
    tokenizer = fast_tokenizer(model, revision)
    template, template_source = resolve_chat_template(tokenizer, chat_template)
    if template is None and any(_has_conversations(p) for p in split_files.values()):
        raise missing_template_error(model)
    end_of_turn = _checked_end_of_turn(tokenizer, template, template_source) if template else ""
    max_chars = max_length * longest_token_chars(tokenizer) * NORMALIZER_SLACK
    plan = EncodePlan(template, end_of_turn, max_length, truncation, max_chars)
    identity = _identity(input_dir, split_files, model, tokenizer, plan, template_source, pack)
    identity["revision"] = revision
    return split_files, tokenizer, plan, identity


def _check_arguments(max_length: int, truncation: str, num_proc: int | None) -> None:
    if truncation not in TRUNCATION_CHOICES:
        raise DataError(f"--truncation {truncation!r}: choose one of {', '.join(TRUNCATION_CHOICES)}")
    if max_length < 2:
        raise DataError(f"--max-length {max_length} must be at least 2")
    if num_proc is not None and num_proc < 1:
        raise DataError(f"--num-proc {num_proc} must be at least 1")


def _checked_end_of_turn(tokenizer, template: str, source: str) -> str:
    """Compile the chat template and render a probe conversation with it; a template that is not valid
    Jinja, or fails on a plain user/assistant exchange, is a one-line DataError naming where it came from."""
    where = "the tokenizer's chat template" if source == "tokenizer" else f"--chat-template ({source})"
    try:
        return end_of_turn_marker(tokenizer, template)
    except TemplateTooSlow as exc:
        raise TemplateTooSlow(f"{where} {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(
            f"{where} is not valid Jinja: line {exc.lineno}: {exc.message}. Fix the template text"
        ) from None
    except Exception as exc:  # noqa: BLE001 - raise_exception(...), undefined names, type errors in the template
        raise DataError(
            f"{where} fails on a plain user/assistant conversation: {type(exc).__name__}: {str(exc).rstrip('.')}. "
            "Fix the template"
        ) from None


def longest_token_chars(tokenizer) -> int:
    """Most characters one token stands for (vocabulary and added tokens; WordPiece maps a whole unknown
    word of up to ``max_input_chars_per_word`` characters to one token). Byte-level vocabularies store one
    character per byte, so this over-counts: a safe bound."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    per_word = getattr(tokenizer.backend_tokenizer.model, "max_input_chars_per_word", 0) or 0
    return max(longest, int(per_word), 1)


def find_split_files(input_dir: Path) -> dict[str, Path]:
    if not input_dir.is_dir():
        raise DataError(f"{input_dir}: no such directory; create it with `llmft data prepare --output {input_dir}`")
    linked = [f"{s}.jsonl" for s in SPLITS if (input_dir / f"{s}.jsonl").is_symlink()]
    if linked:  # a link could point anywhere (another user's data, a secret): never followed
        raise DataError(
            f"{input_dir / linked[0]}: is a symlink; tokenize reads only the files `llmft data prepare` wrote. "
            f"Re-run `llmft data prepare --output {input_dir}` (or copy the file in)"
        )
    files = {s: input_dir / f"{s}.jsonl" for s in SPLITS if (input_dir / f"{s}.jsonl").is_file()}
    if "train" not in files:
        raise DataError(f"{input_dir}: no train.jsonl; create it with `llmft data prepare --output {input_dir}`")
    return files


def fast_tokenizer(model: str, revision: str | None = None):
    """The tokenizer the trainer loads (:func:`llmft.trainer.tokenizer.load_tokenizer`, at ``revision``, the
    trainer's ``model.revision``); tokenization needs a fast one (tokenizer.json) for its offsets."""
    tokenizer = load_tokenizer(model, revision, field="model")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{model!r} has no fast tokenizer (tokenizer.json); tokenization needs one for offsets")
    return tokenizer


def _has_conversations(path: Path) -> bool:
    with open(path, "rb") as fh:
        return any(b'"messages"' in line for line in fh)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything that decides token ids: the tokenizer.json model, normalizer,
    pre-tokenizer, post-processor and added tokens, plus the special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _identity(input_dir, split_files, model, tokenizer, plan: EncodePlan, template_source: str, pack: bool) -> dict:
    """Manifest fields that describe the inputs, and the cache key hashed from them."""
    dataset_hash = hashlib.sha256()
    for split, path in sorted(split_files.items()):
        dataset_hash.update(f"{split}\0{sha256_file(path)}\n".encode())
    report = input_dir / "report.json"
    source_hash = json.loads(report.read_text()).get("source_hash") if report.is_file() else None
    identity = {
        "format_version": FORMAT_VERSION,
        "dataset_hash": dataset_hash.hexdigest(),
        "tokenizer_hash": tokenizer_fingerprint(tokenizer),
        "chat_template_hash": template_hash(plan.template),
        "max_length": plan.max_length,
        "packed": bool(pack),
        "truncation": plan.truncation,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return {
        "cache_key": key,
        **identity,
        "source_hash": source_hash,
        "input_dir": str(input_dir),
        "tokenizer": model,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_source": template_source,
        "chat_template": plan.template,
        "end_of_turn": plan.end_of_turn,
    }


def cached_manifest(output_dir: Path, key: str) -> dict | None:
    """The manifest of a complete ``output_dir`` built with ``key``, else None."""
    path = output_dir / MANIFEST
    if not (is_complete(output_dir) and path.is_file()):
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        return None
    if not isinstance(manifest, dict) or manifest.get("cache_key") != key:
        return None
    for split in manifest.get("splits", {}):
        if not all(
            (output_dir / split / f"{a}.npy").is_file() for a in ("input_ids", "labels", "doc_offsets", "seq_offsets")
        ):
            return None
    return manifest


def _tokenize_splits(split_files, out_dir: Path, tokenizer, plan: EncodePlan, pack: bool, num_proc: int) -> dict:
    work = out_dir / ".work"
    work.mkdir()
    try:
        with worker_pool(num_proc, init_worker, (tokenizer, plan)) as pool:
            stats = {
                split: _tokenize_split(split, path, out_dir / split, work, pool, num_proc, plan, pack)
                for split, path in split_files.items()
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if stats["train"]["documents"] == 0:
        raise DataError(_empty_train_message(split_files["train"], stats["train"]))
    return stats


def _empty_train_message(path: Path, stats: dict) -> str:
    examples = "\n".join(
        f"  {e['file']}:{e['line']}: {e['reason']}: {e['detail']}" for e in stats["dropped_examples"][:5]
    )
    return (
        f"{path}: no trainable document left after tokenization (dropped: {stats['dropped']}). First ones:\n"
        f"{examples}\nFix: raise --max-length, use --truncation truncate, or check the chat template."
    )


def _read_chunks(path: Path) -> Iterator[tuple[str, int, bytes]]:
    """(file name, first line number, block of whole lines) — workers split the lines, so the
    main process only moves bytes."""
    block_bytes, line, rest = CHUNK_BYTES, 1, b""
    with open(path, "rb") as fh:
        while block := fh.read(block_bytes):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                rest = block
                continue
            rest = block[cut:]
            yield path.name, line, block[:cut]
            line += block.count(b"\n", 0, cut)
    if rest:
        yield path.name, line, rest


def _count_rows(path: Path) -> int:
    """Newline count (a fast C-speed pass) so the progress bar can show an ETA."""
    count = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            count += block.count(b"\n")
    return count


def _tokenize_split(split, path, split_dir, work, pool, num_proc, plan, pack) -> dict:
    ids_path, labels_path = work / f"{split}.ids.bin", work / f"{split}.labels.bin"
    lengths: list[np.ndarray] = []
    totals: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    examples: list[dict] = []
    bar = progress(desc=f"tokenize {split}", unit="rows", total=_count_rows(path))
    with open(ids_path, "wb") as ids_out, open(labels_path, "wb") as labels_out, bar:  # the bar clears on errors
        for result in ordered_map(pool, encode_chunk, _read_chunks(path), window=2 * num_proc + 2):
            result.input_ids.tofile(ids_out)
            result.labels.tofile(labels_out)
            lengths.append(result.lengths)
            totals.update(rows=result.rows, supervised=result.supervised, truncated=result.truncated)
            dropped.update(result.dropped)
            examples.extend(result.examples[: MAX_EXAMPLES - len(examples)])
            bar.update(result.rows)
    doc_lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
    sequences = best_fit_pack(doc_lengths, plan.max_length) if pack else None
    _write_split(split_dir, ids_path, labels_path, doc_lengths, sequences)
    return _split_stats(doc_lengths, sequences, totals, dropped, examples, plan.max_length)


def _write_split(split_dir: Path, ids_path: Path, labels_path: Path, doc_lengths: np.ndarray, sequences) -> None:
    """Write the four arrays of trainer.data.shards, documents in packed order."""
    split_dir.mkdir(parents=True)
    order = np.concatenate([np.asarray(s, np.int64) for s in sequences]) if sequences else np.arange(len(doc_lengths))
    seq_sizes = [len(s) for s in sequences] if sequences is not None else np.ones(len(doc_lengths), np.int64)
    total = int(doc_lengths.sum())
    outs = [
        np.lib.format.open_memmap(split_dir / f"{name}.npy", mode="w+", dtype=np.int32, shape=(total,))
        for name in ("input_ids", "labels")
    ]
    if total:
        # plain ndarray views: slicing the np.memmap subclass is slow
        srcs = [
            np.memmap(p, dtype=np.int32, mode="r", shape=(total,)).view(np.ndarray) for p in (ids_path, labels_path)
        ]
        _copy_in_order(srcs, [o.view(np.ndarray) for o in outs], doc_lengths, order, identity=sequences is None)
        del srcs
    for out in outs:
        out.flush()
    del outs
    np.save(split_dir / "doc_offsets.npy", np.concatenate([[0], np.cumsum(doc_lengths[order])]).astype(np.int64))
    np.save(split_dir / "seq_offsets.npy", np.concatenate([[0], np.cumsum(seq_sizes)]).astype(np.int64))


def _copy_in_order(srcs: list, outs: list, doc_lengths, order, *, identity: bool) -> None:
    """outs[k] = the documents of srcs[k] in ``order`` (whole blocks when the order is unchanged)."""
    if identity:
        block = COPY_BLOCK_TOKENS
        for src, out in zip(srcs, outs, strict=True):
            for start in range(0, len(out), block):
                out[start : start + block] = src[start : start + block]
        return
    src_starts = (np.cumsum(doc_lengths) - doc_lengths).tolist()
    lengths = doc_lengths.tolist()
    pos = 0
    for doc in order.tolist():
        start, size = src_starts[doc], lengths[doc]
        for src, out in zip(srcs, outs, strict=True):
            out[pos : pos + size] = src[start : start + size]
        pos += size


def _split_stats(doc_lengths, sequences, totals: Counter, dropped: Counter, examples, max_length: int) -> dict:
    tokens = int(doc_lengths.sum())
    n_seq = len(sequences) if sequences is not None else len(doc_lengths)
    seq_lengths = np.asarray([int(doc_lengths[s].sum()) for s in sequences]) if sequences is not None else doc_lengths
    return {
        "rows": int(totals["rows"]),
        "documents": int(len(doc_lengths)),
        "sequences": int(n_seq),
        "tokens": tokens,
        "supervised_tokens": int(totals["supervised"]),
        "packing_efficiency": round(packing_efficiency(tokens, n_seq, max_length), 6),
        "truncated": int(totals["truncated"]),
        "dropped": dict(dropped.most_common()),
        "dropped_examples": examples,
        "doc_length": _length_stats(doc_lengths),
        "seq_length": _length_stats(seq_lengths),
        "length_histogram": _histogram(doc_lengths, max_length),
    }


def _length_stats(lengths: np.ndarray) -> dict:
    if len(lengths) == 0:
        return {"min": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 2),
        "p50": int(p50),
        "p90": int(p90),
        "p99": int(p99),
        "max": int(lengths.max()),
    }


def _histogram(lengths: np.ndarray, max_length: int, bins: int = 32) -> dict:
    counts, edges = np.histogram(lengths, bins=bins, range=(0, max_length))
    return {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}
