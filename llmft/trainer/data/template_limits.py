"""Bounded chat-template rendering: a template that never ends, or writes without end, is one line.

A chat template is Jinja from the model's tokenizer files or ``--chat-template``: code the user did not
write. transformers renders it in a sandbox, which bounds ``range()`` to 100,000 items but not the time:
``{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}`` ran until the pod
was killed. Jinja compiles a template to Python, so a SIGALRM timer (main thread, POSIX) interrupts
it between bytecodes: :func:`render_deadline` arms it for each conversation and raises
:class:`TemplateTooSlow`. The probe render (:func:`render_probe`) also streams the output and stops at
:data:`~llmft.trainer.data.limits.MAX_PROBE_RENDER_CHARS`. A stop signal (SIGTERM, Ctrl-C) is not an
Exception, so it is never reported as a template error.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from llmft.trainer.data import limits
from llmft.trainer.errors import DataError


class TemplateTooSlow(DataError):
    """The chat template did not finish one conversation within :data:`MAX_TEMPLATE_SECONDS`, or wrote
    more than :data:`MAX_PROBE_RENDER_CHARS` for the probe (exit 1: the template is the input)."""


@contextlib.contextmanager
def render_deadline(seconds: float | None = None) -> Iterator[Callable[[], None]]:
    """``with render_deadline() as restart:`` call ``restart()`` before each render; a render that runs
    longer than ``seconds`` (default :data:`MAX_TEMPLATE_SECONDS`) raises :class:`TemplateTooSlow`. Off the
    main thread (no SIGALRM there) the renders are unbounded; the previous SIGALRM handler and timer are
    restored on exit."""
    seconds = limits.MAX_TEMPLATE_SECONDS if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield lambda: None
        return

    def expired(_signum, _frame):
        raise TemplateTooSlow(
            f"took more than {seconds:g} s to render one conversation (a loop that does not end?). Fix the template"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    try:

        def restart() -> None:
            signal.setitimer(signal.ITIMER_REAL, seconds)

        yield restart
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_probe(tokenizer, template: str, messages: list[dict]) -> str:
    """What ``apply_chat_template(messages, tokenize=False)`` renders, within the time and size bounds."""
    try:
        # heavy: transformers
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except (ImportError, AttributeError, TypeError):  # the internal moved: the public call, time-bounded only
        compiled = None
    with render_deadline() as restart:
        restart()
        if compiled is None:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        pieces, size = [], 0
        context = dict(tokenizer.special_tokens_map)
        for piece in compiled.generate(
            messages=messages, tools=None, documents=None, add_generation_prompt=False, **context
        ):
            size += len(piece)
            if size > limits.MAX_PROBE_RENDER_CHARS:
                raise TemplateTooSlow(
                    f"wrote more than {limits.MAX_PROBE_RENDER_CHARS:,} characters for a two-message conversation. "
                    "Fix the template"
                )
            pieces.append(piece)
        return "".join(pieces)
