"""The disk path: safetensors -> post-processed tensors -> parameters bound into a meta-built model.

Tensors whose dtype already matches stay mmap-backed (no copy); others are converted once. The daemon uses the same
`load_tensors` so that daemon-served bytes equal disk-loaded bytes by construction."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from warmstart.errors import UserError
from warmstart.weights.quantize import checkpoint_kind, postprocess, resolve

_SAMPLES, _WINDOW = 16, 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the shard index, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index} is unreadable ({e}); the checkpoint is corrupt. Download it again.") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{model_dir} is missing shards named in its index: {', '.join(missing)}. "
                            "The download is incomplete; fetch the missing files.")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no *.safetensors files. warmstart loads safetensors checkpoints "
                        "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True)).")
    return files


def checkpoint_identity(model_dir: Path) -> list[dict]:
    """Content identity without reading all the weights: per file, its name, size, the sha256 of its header
    (names, dtypes, shapes, offsets) and a sha256 over SAMPLES evenly spaced 4 KiB windows of the tensor data.
    A re-saved checkpoint changes the header; a retrained one with identical shapes changes the samples. Reads
    about 64 KiB per file, so it costs microseconds at boot rather than hashing gigabytes."""
    out = []
    for f in checkpoint_files(model_dir):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise UserError(f"{f} is truncated (shorter than a safetensors header). Download it again.")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise UserError(f"{f} declares a {n}-byte safetensors header but the file has {size} bytes; it "
                                "is corrupt or truncated. Download or convert it again.")
            header = fh.read(min(n, 100 * 2**20))
            data_start, samples = 8 + n, hashlib.sha256()
            span = max(0, size - data_start - _WINDOW)
            for i in range(_SAMPLES):
                fh.seek(data_start + span * i // max(1, _SAMPLES - 1))
                samples.update(fh.read(_WINDOW))
        out.append({"file": f.name, "bytes": size, "header_sha256": hashlib.sha256(header).hexdigest(),
                    "sample_sha256": samples.hexdigest()})
    return out


def checkpoint_names(model_dir: Path) -> list[str]:
    """The checkpoint's tensor names, from the safetensors headers alone (an unreadable file adds none: the load
    reports it)."""
    names: list[str] = []
    for f in checkpoint_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                names.extend(fh.keys())
        except (SafetensorError, OSError):
            pass
    return names


def load_tensors(model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                 progress: bool = True, quantization: str = "auto",
                 shard: Callable[[dict], dict] | None = None) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, converted to dtype (floating tensors only), quantized or dequantized per
    `quantization` (weights/quantize.py), cut to one tensor-parallel rank's shard by `shard` (weights/shard.py),
    and placed on device. A tensor already in dtype on CPU that needs no post-processing is returned as an
    mmap-backed view: no copy, pages fault in on first use."""
    files = checkpoint_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    # tqdm's delay shows the bar only when loading is slow enough to need one.
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="weights",
               delay=2.0, disable=not progress, leave=False)
    try:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():
                        t = fh.get_tensor(name)
                        if t.is_floating_point() and t.dtype != dtype and not _quant_part(name):
                            t = t.to(dtype)
                        out[name] = t
                        bar.update(t.numel() * t.element_size())
            except SafetensorError as e:
                raise UserError(f"{f} is not a valid safetensors file ({e}). The checkpoint is corrupt or "
                                "truncated; download or convert it again.") from None
    finally:
        bar.close()
    if quantization != "none" or checkpoint_kind(out) == "quantized":
        if str(device) != "cpu":
            if quantization == "auto":
                # A quantized checkpoint (the default model's GGUF) is served in float on a GPU: the integer
                # kernels are CPU code. Its exact values, dequantized once here.
                quantization = "none"
            elif resolve(quantization, out) != "none":
                raise UserError(f"--quantization {quantization} runs on warmstart's CPU kernels only; on a GPU "
                                "use --quantization auto or none (weights in --dtype).")
        out = postprocess(out, dtype, quantization, shard)
    elif shard is not None:
        out = shard(out)
    return {n: t.to(device) for n, t in out.items()} if str(device) != "cpu" else out


def _quant_part(name: str) -> bool:
    """Canonical quantized tensors keep their dtypes (scales stay float32 until prepare rounds them)."""
    return name.rpartition(".")[2] in ("qweight", "scales", "mins")


def bind_weights(model: nn.Module, tensors: dict[str, torch.Tensor], tied: dict[str, str]) -> None:
    """Make the tensors the model's parameters, in O(tensors): no copies, no init. The model was built on meta.
    Fails if any parameter is left unbound or any tensor is left unused, so a half-bound model can never run."""
    from warmstart.models.quant import bind_quantized
    try:
        used = bind_quantized(model, tensors, tied)
    except (ValueError, AttributeError) as e:
        raise UserError(f"The checkpoint's quantized tensors do not fit the model ({e}); re-import it.") from None
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        source = name if name in tensors or name not in tied else tied[name]
        if source not in tensors:
            raise UserError(f"The checkpoint has no tensor for parameter {name}. It does not match its "
                            "config.json (wrong architecture or a partial file).")
        t = tensors[source]
        if tuple(t.shape) != tuple(param.shape):
            raise UserError(f"Tensor {source} has shape {tuple(t.shape)} but the config implies "
                            f"{tuple(param.shape)}. config.json and the weights disagree.")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        used.add(source)
    extra = sorted(set(tensors) - used)
    # A tied checkpoint may still carry a copy of lm_head; anything else left over means a mismatch.
    extra = [n for n in extra if n not in tied]
    if extra:
        raise UserError(f"The checkpoint has tensors the model does not use: {', '.join(extra[:5])}"
                        f"{' …' if len(extra) > 5 else ''}. config.json does not describe these weights.")
    if tied:
        # Tie by identity even when the checkpoint also stored lm_head, exactly as transformers does.
        for name, source in tied.items():
            module_name, _, attr = name.rpartition(".")
            if attr not in model.get_submodule(module_name)._parameters:
                continue            # quantized: bind_quantized tied it, or it keeps its own quantized weight
            src_mod, _, src_attr = source.rpartition(".")
            model.get_submodule(module_name)._parameters[attr] = model.get_submodule(src_mod)._parameters[src_attr]


def materialize_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Non-persistent buffers (RoPE frequencies) are computed, not loaded: rebuild those left on meta."""
    for module in model.modules():
        fn = getattr(module, "materialize", None)
        if fn is not None:
            fn(device)


def weights_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the bound weights occupy (each storage once, so tied tensors count once)."""
    seen, total = set(), 0
    for t in tensors.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total

