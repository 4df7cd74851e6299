"""`llmft bench eval-threads`: why the evaluate step slows down more than training on a busy CPU, measured.

The evaluate step of ``make demo`` does two kinds of work on the CPU: perplexity (forwards over packed rows: large
matrix products) and held-out generation (greedy decoding: one token per forward, so every forward is a few hundred
tiny operations, each a parallel region of torch's OpenMP pool). Training is forwards and backwards over packed
rows. This benchmark times each kind of work alone, in a fresh process per arm, with:

- ``threads``: torch's intra-op threads (``OMP_NUM_THREADS`` and ``torch.set_num_threads``), 1 or 2;
- ``wait``: OpenMP's wait policy (``OMP_WAIT_POLICY``: unset = libgomp's spin-then-sleep, or ``passive``);
- ``load``: busy processes (``while True: pass``) running beside it on the same CPUs, 0 or 2 — the "two busy
  processes" of issue 49 item 6.

On a machine with more than two CPUs, every process (arms and load) is pinned to the same two CPUs
(``os.sched_setaffinity``), so a 16-core device machine measures the 2-core machine's contention without other
users' noise. The model is SmolLM2-135M-Instruct's shape (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads,
vocabulary 49,152): ``--model`` a directory (the converted real model) or ``random`` (the same shape, random
weights: the arithmetic is the same). Writes ``<date>-<label>-eval-threads.json`` and ``.md`` into ``--results-dir``
(default ``benchmarks/results`` under the current directory), atomically. Module top imports: stdlib and
``llmft.trainer.io`` (stdlib only itself; ``llmft bench`` imports this to read its flags).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmft.benchmarks import RESULTS_DIR
from llmft.trainer.io import atomic_write_text

PHASES = ("decode", "prefill", "train")
"""decode: greedy generation of 6 prompts (batch 6) for ``--new-tokens`` tokens, as the held-out task generates;
prefill: no-grad forwards of 4 packed rows of 256 tokens, as perplexity evaluates; train: forward + backward of the
same rows, as a training step."""
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                     max_position_embeddings=2048)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random", help="a model directory, or 'random' (SmolLM2-135M's shape)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens each decode arm generates (default 48)")
    parser.add_argument(
        "--layers",
        type=int,
        default=SMOLLM2_SHAPE["num_hidden_layers"],
        help="decoder layers of the random model (default 30, SmolLM2-135M's; fewer = the same work per layer, "
        "cheaper to measure)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each arm, interleaved; the median is kept")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--label", default="cpu", help="the machine's name in the results' file names")
    parser.add_argument(
        "--results-dir",
        default=str(RESULTS_DIR),
        help=f"where to write the JSON and Markdown (default: {RESULTS_DIR}, under the current directory)",
    )
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: this process is one arm


ARMS = (
    {"threads": 2, "wait": ""},
    {"threads": 1, "wait": ""},
    {"threads": 2, "wait": "passive"},
)
"""Thread settings, each measured in its own process (OpenMP reads its variables once, at start)."""


def run(args: argparse.Namespace) -> int:
    phases = [p for p in args.phases.split(",") if p]
    if args.arm:  # in the arm's own process: every phase, idle and loaded, --repeat times interleaved
        print(json.dumps(_measure_arm(phases, args)))
        return 0
    cpus = _two_cpus()
    load_before = os.getloadavg()[0]
    rows = []
    for arm in ARMS:
        timings = _run_arm(arm, args, cpus)
        for phase in phases:
            for load in (0, 2):
                runs = timings[f"{phase}/{load}"]
                rows.append({"phase": phase, "load": load, **arm, "runs": runs, "median_s": statistics.median(runs)})
                print(f"{phase:8} load {load} threads {arm['threads']} {arm['wait'] or 'default':8} "
                      f"median {statistics.median(runs):7.2f} s  {runs}", flush=True)  # fmt: skip
    _write(rows, args, cpus, (load_before, os.getloadavg()[0]))
    return 0


def _two_cpus() -> list[int] | None:
    """The two CPUs every process is pinned to (None on a machine of two CPUs or fewer: nothing to pin)."""
    available = sorted(os.sched_getaffinity(0))
    return available[:2] if len(available) > 2 else None


BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
"""A busy loop that ends when the process that started it is gone (never an orphan spinning on)."""


class _busy:
    """``count`` busy processes (no torch: a bare loop) on this process's CPUs for the ``with`` block."""

    def __init__(self, count: int):
        self.count, self.procs = count, []

    def __enter__(self):
        cpus = os.sched_getaffinity(0)
        for _ in range(self.count):
            proc = subprocess.Popen([sys.executable, "-S", "-c", BUSY])
            os.sched_setaffinity(proc.pid, cpus)
            self.procs.append(proc)
        time.sleep(0.5 if self.count else 0)
        return self

    def __exit__(self, *_exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _run_arm(arm: dict, args: argparse.Namespace, cpus: list[int] | None) -> dict[str, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(arm["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_WAIT_POLICY", None)
    if arm["wait"]:
        env["OMP_WAIT_POLICY"] = arm["wait"]
    command = [sys.executable, "-m", "llmft.benchmarks.eval_threads", "--arm", "1", "--model", args.model,
               "--new-tokens", str(args.new_tokens), "--phases", args.phases, "--repeat", str(args.repeat),
               "--layers", str(args.layers)]  # fmt: skip
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, preexec_fn=preexec)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_arm(phases: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    import torch  # heavy: torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    model = _model(args.model, args.layers)
    timings: dict[str, list[float]] = {f"{phase}/{load}": [] for phase in phases for load in (0, 2)}
    for _ in range(args.repeat):
        for load in (0, 2):
            with _busy(load):
                for phase in phases:
                    timings[f"{phase}/{load}"].append(round(_time_phase(phase, model, args.new_tokens), 3))
    return timings


def _time_phase(phase: str, model, new_tokens: int) -> float:
    import torch  # heavy: torch

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    if phase == "decode":
        prompts = torch.randint(0, vocab, (6, 40), generator=generator)
        model.eval()
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            started = time.perf_counter()
            model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)  # fmt: skip
        return time.perf_counter() - started
    rows = torch.randint(0, vocab, (4, 256), generator=generator)
    if phase == "prefill":
        model.eval()
        with torch.no_grad():
            model(rows[:1], labels=rows[:1], use_cache=False)  # warm-up
            started = time.perf_counter()
            model(rows, labels=rows, use_cache=False)
        return time.perf_counter() - started
    model.train()
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    model(rows, labels=rows, use_cache=False).loss.backward()
    return time.perf_counter() - started


def _model(source: str, layers: int):
    import transformers  # heavy: transformers

    if source == "random":
        config = transformers.LlamaConfig(**{**SMOLLM2_SHAPE, "num_hidden_layers": layers})
        return transformers.LlamaForCausalLM(config).float()
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype="float32")


def _write(rows: list[dict], args: argparse.Namespace, cpus: list[int] | None, load: tuple[float, float]) -> None:
    date = _dt.date.today().isoformat()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": date,
        "machine": {
            "cpus": os.cpu_count(),
            "pinned_to": cpus,
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },  # fmt: skip
        "command": " ".join(["llmft bench eval-threads", *sys.argv[3:]]),
        "load_average_1min": {"before": round(load[0], 2), "after": round(load[1], 2)},
        "model": args.model,
        "layers": args.layers if args.model == "random" else None,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    stem = out / f"{date}-{args.label}-eval-threads"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(record, indent=2) + "\n")
    atomic_write_text(stem.with_suffix(".md"), markdown(rows) + "\n")
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """One line per phase and setting: median seconds idle, beside 2 busy processes, and the slowdown."""
    lines = [
        "| phase | threads | OMP wait | alone, s | beside 2 busy processes, s | slowdown |",
        "|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["load"] == 0):
        busy = next(r for r in rows if r["load"] == 2 and all(r[k] == row[k] for k in ("phase", "threads", "wait")))
        slowdown = busy["median_s"] / row["median_s"]
        lines.append(
            f"| {row['phase']} | {row['threads']} | {row['wait'] or 'default'} | {row['median_s']:.2f} | "
            f"{busy['median_s']:.2f} | {slowdown:.1f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
