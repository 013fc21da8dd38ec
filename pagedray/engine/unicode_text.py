"""Text no tokenizer, hash or encoder accepts: a lone UTF-16 surrogate (from a `\\ud800` escape).

Python strings may hold one; UTF-8 cannot encode it. Prompts, chat content and request bodies are
checked with the same test, so each refuses it as a 400 rather than failing later as a 500.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """True if `text` holds a UTF-16 surrogate: not encodable text."""
    return not text.isascii() and _SURROGATE.search(text) is not None
