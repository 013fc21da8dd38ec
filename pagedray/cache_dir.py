"""Where pagedray keeps what it builds once per machine (the default model, compiled kernels).

One root, `$PAGEDRAY_CACHE_DIR` or `~/.cache/pagedray`, so that clearing or relocating the cache
is one setting for all of it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The folder for one kind of cached build, e.g. "models" or "kernels" (not created here)."""
    return Path(os.environ.get("PAGEDRAY_CACHE_DIR", "~/.cache/pagedray")).expanduser() / kind
