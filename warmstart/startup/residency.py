"""How much of the mapped weights this process actually holds in memory.

Weights loaded by mmap (safetensors files, the daemon's sealed memfds) are resident only where they were touched:
an untied embedding has in memory only the rows of tokens seen so far. RSS counts only those pages, so comparing
RSS with "every weight byte" calls a healthy boot drifted. This module reads /proc/self/smaps and returns the
bytes of weight mappings that are mapped but not resident, so both sides of the comparison count the same pages."""
from __future__ import annotations

from pathlib import Path


def _is_weight_mapping(path: str) -> bool:
    return path.endswith(".safetensors") or path.startswith("/memfd:warmstart-")


def unresident_weight_bytes(smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of weight file mappings not resident in this process (mapping size minus its RSS); 0 if unreadable."""
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    total, current, size = 0, False, 0
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            current = len(head) == 6 and _is_weight_mapping(head[5].strip())
            size = 0
        elif current and line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif current and line.startswith("Rss:"):
            total += max(0, size - int(line.split()[1]) * 1024)
    return total
