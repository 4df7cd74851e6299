"""Hold GPU memory so that each visible GPU has ``--free-gib`` free: a larger card (H200, 140 GiB) then offers
a training process what an 80 GB H100 offers (about 77.7 GiB free at start: the trainer's logged budget of
70.5 GiB on an H100 = free x 0.92 - 1 GiB). The memory plan reads the free memory at start and the
allocator fails where the card would, so a plan made for an H100 is tried for fit; speed is the larger card's.

python -m llmft.benchmarks.gpu.hold_memory --free-gib 77.7 &   (runs until killed)
"""

from __future__ import annotations

import argparse
import time

import torch

GiB = 2**30


def hold(free_gib: float) -> list:
    held = []
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the context first: it takes memory too
        extra = torch.cuda.mem_get_info(device)[0] - free_gib * GiB
        if extra > 0:
            held.append(torch.empty(int(extra), dtype=torch.uint8, device=device))
        print(f"GPU {index}: {torch.cuda.mem_get_info(device)[0] / GiB:.2f} GiB free", flush=True)
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--free-gib", type=float, default=77.7)
    held = hold(p.parse_args().free_gib)
    print("held", flush=True)
    while held:
        time.sleep(60)


if __name__ == "__main__":
    main()
