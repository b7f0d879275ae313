"""Where warmstart keeps its caches. The one environment variable that moves them is read here."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def warmstart_cache_dir() -> Path:
    """The per-user cache root: $WARMSTART_CACHE_DIR, else $XDG_CACHE_HOME/warmstart, else ~/.cache/warmstart."""
    if os.environ.get("WARMSTART_CACHE_DIR"):
        return Path(os.environ["WARMSTART_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "warmstart"


def atomic_write(path: Path, write: Callable[[str], None], durable: bool = True) -> Path:
    """Create or replace `path` so that no reader ever sees a partial file: `write(tmp)` fills a temporary file in
    the same folder, which is then renamed over `path` (concurrent writers each rename a complete file; the last
    wins). durable: fsync the file before the rename and the folder after it, so a crash cannot leave an empty or
    missing file behind. The temporary is removed if anything fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def atomic_write_text(path: Path, text: str, durable: bool = True) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text), durable)
