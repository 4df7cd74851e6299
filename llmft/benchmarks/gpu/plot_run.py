"""Figures of one trainer run from its metrics.jsonl: loss, tokens/s, MFU and peak memory per logged step.

python -m llmft.benchmarks.gpu.plot_run METRICS_JSONL OUT_PNG [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("out")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    # heavy: matplotlib
    import matplotlib

    matplotlib.use("Agg")
    # heavy: matplotlib
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(a.metrics).read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    steps = [r["step"] for r in train]
    panels = [
        ("loss", "train loss", 1.0),
        ("tokens_per_s", "tokens/s", 1.0),
        ("mfu", "MFU (%)", 100.0),
        ("peak_mem_gib", "peak allocated (GiB)", 1.0),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=True):
        values = [r.get(key) for r in train]
        ax.plot(steps, [v * scale if v is not None else float("nan") for v in values], marker="o", ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(a.title or Path(a.metrics).name)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
