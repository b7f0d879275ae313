"""Architecture name -> model class. A plain dict: adding a family is one line here and one row in spec.FAMILIES."""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from warmstart.models.decoder import DecoderLM
from warmstart.models.spec import ModelSpec

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
}


def build_model(spec: ModelSpec) -> nn.Module:
    """Instantiate the model for spec on whatever device/dtype context the caller set (meta, for binding).
    Random init is skipped: every parameter is bound from a checkpoint, and initialising on meta would
    import torch._dynamo (a second of boot time) for nothing."""
    with _skip_init():
        return MODELS[spec.architecture](spec)


@contextmanager
def _skip_init():
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn
