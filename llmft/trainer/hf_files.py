"""The files of a Hugging Face model folder that make up its tokenizer (and chat template).

Torch-free on purpose: the promote step runs on the pipeline image, which has no torch; export
(llmft/trainer/export.py) and promote (llmft/components/lib/evaluation/promote.py) copy the same set.

Also how a hub load failure is told apart: the hub not answering is transient (exit 200, the
pipeline retries the step), anything else is the input's (exit 1)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


HUB_RETRY_LOGGER = "huggingface_hub.utils._http"
"""The logger on which huggingface_hub's ``http_backoff`` writes one warning per retry
(``'...' thrown while requesting HEAD ...`` and ``Retrying in Ns [Retry k/5]``; huggingface_hub 2.4
``utils/_http.py``): ten lines for one unreachable hub."""
_NETWORK_ERRORS = frozenset(
    {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "TransportError", "NetworkError"}
)
"""httpx's (and its vendored copies') transport errors, by class name: huggingface_hub wraps them."""


@contextmanager
def quiet_hub_retries() -> Iterator[None]:
    """Load from the hub without one warning line per retry: the retries still happen (a blip is
    cured), and a hub that stays unreachable is reported once, by :func:`hub_unreachable`'s caller."""
    logger = logging.getLogger(HUB_RETRY_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def hub_unreachable(exc: BaseException) -> str | None:
    """What made a hub load fail when a re-run may cure it (the hub or its network did not answer:
    refused or reset connection, DNS failure, timeout, HTTP 429 or 5xx), found anywhere in the
    exception's chain; None when the failure is the input's (unknown id, gated repo, offline and
    not cached, a bad file). huggingface_hub's ``OfflineModeIsEnabled`` is a ConnectionError, but offline
    mode is a choice, not a fault: the files are simply not in the cache."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    if any(type(item).__name__ == "OfflineModeIsEnabled" for item in chain):
        return None
    for current in chain:
        names = {cls.__name__ for cls in type(current).__mro__}
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(current, ConnectionError | TimeoutError | socket.gaierror) or names & _NETWORK_ERRORS:
            return f"{type(current).__name__}: {' '.join(str(current).split())[:200]}"
        if isinstance(status, int) and (status == 429 or status >= 500):
            return f"HTTP {status} from the hub"
    return None


def hub_fault_message(what: str, name: str, cause: str) -> str:
    """The one line for an unreachable hub (exit 200: the pipeline retries the step)."""
    return (
        f"{what}={name!r}: the Hugging Face hub did not answer ({cause}) after huggingface_hub's retries; "
        "a transient fault (exit 200): the step is retried. If it persists, check the network, HF_ENDPOINT and "
        "proxies, or pre-download the model and set HF_HUB_OFFLINE=1"
    )
