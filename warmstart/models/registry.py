"""Architecture name -> model class. A plain dict: adding a family is one line here and one row in spec.FAMILIES."""
from __future__ import annotations

from torch import nn

from warmstart.models.decoder import DecoderLM
from warmstart.models.spec import ModelSpec

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
}


def build_model(spec: ModelSpec) -> nn.Module:
    """Instantiate the model for spec on whatever device/dtype context the caller set (meta, for binding)."""
    return MODELS[spec.architecture](spec)
