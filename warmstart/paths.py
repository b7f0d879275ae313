"""Where warmstart keeps its caches. The one environment variable that moves them is read here."""
from __future__ import annotations

import os
from pathlib import Path


def warmstart_cache_dir() -> Path:
    """The per-user cache root: $WARMSTART_CACHE_DIR, else $XDG_CACHE_HOME/warmstart, else ~/.cache/warmstart."""
    if os.environ.get("WARMSTART_CACHE_DIR"):
        return Path(os.environ["WARMSTART_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "warmstart"
