"""Bounds on what the data steps accept: defined once, used by the library, the CLI and the pipeline.

- ``DEFAULT_MAX_ROW_BYTES``: ``llmft data prepare`` rejects a row larger than this (reason
  ``row_too_large``) without holding it in memory: a JSONL line is measured in bytes while it is
  read; a row of another format (CSV, Parquet, JSON array, hub) by the characters of its text.
  8 MiB is far above any context window (a 128k-token document is about 0.5 MB of text).
- ``DEFAULT_MAX_REJECT_FRACTION``: prepare fails when more than this share of rows is rejected.
- ``DEFAULT_MAX_DROP_FRACTION``: ``llmft data tokenize`` fails when more than this share of rows
  is dropped (too long for ``--max-length``, no trainable token, template errors), counting the
  rows of every split together.
- ``NORMALIZER_SLACK``: how many characters one token's worth of text may shrink to under the
  tokenizer's normalizer (NFC/NFKC compose at most a few code points into one); used by
  ``tokenize`` to drop a document that cannot fit in ``--max-length`` tokens before tokenizing it.
- ``MAX_TEMPLATE_SECONDS``: longest a chat template may take to render one conversation (the tokenize
  step's probe, then every row); a real template takes well under a millisecond. Longer is a template
  that never ends (nested ``range`` loops): one line naming the template, exit 1.
- ``MAX_ROW_DEPTH``: deepest nesting of lists and objects a decoded row may have (a CSV cell holding JSON, a
  hub or Langfuse row, a row of a ``.json`` array or Parquet file); a deeper one is rejected as ``too_deep``
  before anything walks it recursively (``json.dumps`` for the source hash or the reject's snippet would hit
  Python's recursion limit). A chat row is 3-4 levels deep; a JSONL line is bounded by the parser (~1,000).
- ``MAX_PROBE_RENDER_CHARS``: most characters a template may write for the two-message probe
  conversation (a long built-in system prompt is a few KiB).
"""

from __future__ import annotations

DEFAULT_MAX_ROW_BYTES = 8 << 20
DEFAULT_MAX_REJECT_FRACTION = 0.01
DEFAULT_MAX_DROP_FRACTION = 0.01
NORMALIZER_SLACK = 4
MAX_TEMPLATE_SECONDS = 10.0
MAX_PROBE_RENDER_CHARS = 1 << 20
MAX_ROW_DEPTH = 200
