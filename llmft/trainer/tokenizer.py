"""The one way the project reads a base model's tokenizer.

The tokenize step (``llmft/trainer/data/tokenize.py``), the trainer (``llmft/trainer/train.py``, which saves the
tokenizer into ``final/``) and the evaluate step's answer comparison (``components/lib/evaluation/generations.py``)
all call :func:`load_tokenizer`, so they read the same files: the same ``revision`` (the trainer's
``model.revision``) and the same chat template (the one the data was tokenized with). transformers is
imported only when a tokenizer is loaded: ``llmft --help`` does not pay for it.
"""

from __future__ import annotations

import os

from llmft.trainer.errors import ConfigError, TransientError
from llmft.trainer.hf_files import hub_fault_message, hub_unreachable, quiet_hub_retries


def load_tokenizer(
    name_or_path: str,
    revision: str | None = None,
    *,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    field: str = "model.name_or_path",
):
    """``AutoTokenizer`` of a local model directory or a hub id at ``revision`` (a branch, tag or commit;
    None: the default branch). HF_TOKEN is used for gated models; offline (HF_HUB_OFFLINE=1) a hub id
    resolves from the local cache only. ``chat_template`` (the template text) replaces the tokenizer's own
    when given. Code from the model repository runs only with ``trust_remote_code=True``.

    Any failure to load is one ConfigError line naming ``field`` (the setting that gave the name), the
    model, the revision and the fix; a hub that does not answer is one TransientError line (exit 200)."""
    from transformers import AutoTokenizer  # heavy: transformers

    try:
        with quiet_hub_retries():
            tokenizer = AutoTokenizer.from_pretrained(
                name_or_path,
                revision=revision,
                token=os.environ.get("HF_TOKEN") or None,
                trust_remote_code=trust_remote_code,
            )
    except Exception as exc:  # noqa: BLE001 - any loader failure (missing files, unknown id, bad JSON) is the input's
        unreachable = hub_unreachable(exc)
        if unreachable:
            raise TransientError(hub_fault_message(field, name_or_path, unreachable)) from None
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        at = f" at revision {revision}" if revision else ""
        raise ConfigError(
            f"{field}={name_or_path!r}: cannot load the tokenizer{at} ({why}). Fix: give a local model directory "
            "or a hub id this machine can reach; set HF_TOKEN for gated models; offline (HF_HUB_OFFLINE=1) the "
            "model must be in the local cache"
        ) from None
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer
