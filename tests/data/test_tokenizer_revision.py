"""The tokenize step reads the tokenizer at the revision the trainer loads (``model.revision``).

Offline, a hub id resolves through the local hub cache: ``models--<org>--<name>/snapshots/<commit>`` with
``refs/main`` naming the default commit (huggingface_hub's cache layout). Two snapshots of one id whose chat
templates differ give two cache keys: tokenizing at a pinned commit must give that commit's key, not main's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_hub import HUB_MAIN as MAIN
from tiny_hub import HUB_PINNED as PINNED
from tiny_hub import TINY_HUB_ID as REPO


def _cache_key(cache: Path, prepared: Path, model: str, revision: str | None) -> str:
    code = (
        "import sys\nfrom llmft.trainer.data.tokenize import cache_key_for\n"
        "print(cache_key_for(sys.argv[1], sys.argv[2], max_length=128, revision=sys.argv[3] or None))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(prepared), model, revision or ""],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_tokenize_reads_the_tokenizer_at_the_trainers_revision(tiny_hub_cache, prepared_sample):
    cache = tiny_hub_cache
    snapshots = cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
    pinned = _cache_key(cache, prepared_sample, REPO, PINNED)
    assert pinned == _cache_key(cache, prepared_sample, str(snapshots / PINNED), None)
    assert _cache_key(cache, prepared_sample, REPO, None) == _cache_key(
        cache, prepared_sample, str(snapshots / MAIN), None
    )
    assert pinned != _cache_key(cache, prepared_sample, REPO, None)
