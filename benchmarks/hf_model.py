"""The transformers baseline of a warmstart model folder, for the benchmarks that compare against it."""
from __future__ import annotations

from pathlib import Path


def hf_float_model(folder: Path, dtype):
    """transformers' model of a warmstart model folder in `dtype`. A folder imported from GGUF keeps its linears
    quantized (`.qweight` tensors), which transformers cannot read (from_pretrained would leave those layers
    randomly initialized): they are dequantized as warmstart's `--quantization none` does, the same weights.
    Other folders load with from_pretrained (only the files' headers are read to tell which)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from warmstart.weights.quantize import postprocess
    files = sorted(Path(folder).glob("*.safetensors"))

    def keys(f):
        with safe_open(f, "pt") as h:
            return list(h.keys())
    if not any(k.endswith(".qweight") for f in files for k in keys(f)):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    model.load_state_dict(postprocess(tensors, torch.float32, "none"), strict=False)
    model.tie_weights()
    return model.to(dtype)
