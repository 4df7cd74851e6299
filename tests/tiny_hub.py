"""The tiny model as a hub id at two commits, in an offline hub cache (the ``tiny_hub_cache`` and
``use_tiny_hub`` fixtures of tests/conftest.py build and select it).

huggingface_hub's cache layout: ``models--<org>--<name>/snapshots/<commit>`` with ``refs/main`` naming the
default commit. The two snapshots differ, so a test can tell which one a caller loaded: the tokenizer's
``model_max_length`` (HUB_MAX_LENGTH) and a leading ``{#- main -#}`` / ``{#- pinned -#}`` comment in its chat
template; the model's config.json carries ``hub_snapshot`` (HUB_MARKER, kept as an attribute of the config).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_HUB_ID = "acme/tiny-chat"
HUB_MAIN, HUB_PINNED = "a" * 40, "b" * 40
HUB_MARKER = {HUB_MAIN: "main", HUB_PINNED: "pinned"}
HUB_MAX_LENGTH = {HUB_MAIN: 1111, HUB_PINNED: 2222}


def build_hub_cache(root: Path, tiny_model_dir: Path) -> Path:
    repo = root / f"models--{TINY_HUB_ID.replace('/', '--')}"
    for commit, marker in HUB_MARKER.items():
        snapshot = repo / "snapshots" / commit
        shutil.copytree(tiny_model_dir, snapshot)
        config = json.loads((snapshot / "tokenizer_config.json").read_text())
        config["model_max_length"] = HUB_MAX_LENGTH[commit]
        template = snapshot / "chat_template.jinja"
        if template.is_file():
            template.write_text(f"{{#- {marker} -#}}" + template.read_text())
        else:
            config["chat_template"] = f"{{#- {marker} -#}}" + config["chat_template"]
        (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
        model_config = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**model_config, "hub_snapshot": marker}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_MAIN)
    return root
