"""Where a boot's weights come from. Today: disk. The daemon path (attach zero-copy or by copy, fall back to disk)
plugs in here and reports the same LoadedWeights, so the boot sizes memory identically whichever way they came."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from warmstart.weights.charges import ExternalCharges
from warmstart.weights.loader import load_tensors, weights_nbytes


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    owned_bytes: int                 # weight bytes this process holds itself (disk load or copy attach)
    charges: ExternalCharges         # bytes a daemon holds for us (zero-copy attach)
    source: str                      # "disk" | "daemon-zero-copy" | "daemon-copy"
    fallback_reason: str | None = None


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, *, role: str = "target",
                 config=None) -> LoadedWeights:
    """Post-processed tensors for one model (role "target" or "draft")."""
    tensors = load_tensors(model_dir, dtype, device)
    return LoadedWeights(tensors, weights_nbytes(tensors), ExternalCharges(), "disk")
