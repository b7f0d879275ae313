"""What a weight daemon serves, described so that an engine can check it before trusting a single byte.

CacheKey: everything the served bytes depend on (checkpoint content, architecture, dtype, role, post-processing,
versions, parallel rank and size, device). Computed from the checkpoint's headers and config, before any load, on
both sides; an engine uses a daemon only when the whole key is equal, and a mismatch names every differing field.

Manifest: per tensor its name, dtype, shape, stride, region, byte offset, nbytes and a BLAKE2b-128 digest of its
bytes, plus a digest over the whole manifest (key and layout included), so that metadata cannot disagree with
itself unnoticed: tensor-level hashes alone would let a crafted shape through."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from warmstart.errors import UserError

# What load_tensors does after reading the checkpoint. Bump it whenever the disk path's post-processing changes,
# so that a daemon started by an older build can never serve bytes the new disk path would not produce.
POST_PROCESSING = "safetensors;floating->dtype;v3"   # v3: the native kernel's scales and mins are float16
# CPU regions are mmapped and tensors viewed at these offsets; 64 bytes is a cache line and covers every dtype's
# alignment. CUDA arenas use 256 so that every tensor starts where the caching allocator would have put it.
ALIGN = {"cpu": 64, "cuda": 256}
DIGEST_BYTES = 16
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
               "bool": torch.bool}
_NAME_OF = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32; a UserError for dtypes the manifest cannot carry."""
    if dtype not in _NAME_OF:
        raise UserError(f"dtype {dtype} cannot be served by the weight daemon; load this model from disk "
                        "(--load-format disk).")
    return _NAME_OF[dtype]


@dataclass(frozen=True)
class CacheKey:
    """The identity of a daemon's contents. Two keys are compatible only if every field is equal."""
    checkpoint: str          # sha256 over loader.checkpoint_identity: content, not path
    architecture: str
    dtype: str
    role: str                # "target" | "draft"
    post_processing: str
    warmstart_version: str
    torch_version: str
    rank: int
    world_size: int
    device: str              # "cpu" or the GPU UUID ("GPU-...")

    def mismatched_fields(self, other: "CacheKey") -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> "CacheKey":
        """Parse a peer's key; a ValueError for anything that is not exactly this schema."""
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise ValueError("cache key has the wrong fields")
        for f in fields(cls):
            want = int if f.type == "int" else str
            if type(d[f.name]) is not want:
                raise ValueError(f"cache key field {f.name} has the wrong type")
        return cls(**d)


def post_processing(quantization: str) -> str:
    """POST_PROCESSING plus what quantization adds: its mode and, since the int4 kernel's packing is ISA-specific,
    the CPU capability the tensors were packed for."""
    if quantization == "none":
        return f"{POST_PROCESSING};quantization={quantization}"
    from warmstart.models.quant import native_kernel
    kernel = "native" if native_kernel() else "torch"
    return (f"{POST_PROCESSING};quantization={quantization};kernel={kernel};"
            f"isa={torch.backends.cpu.get_cpu_capability()}")


def build_cache_key(model_dir: Path, dtype: torch.dtype, role: str, device_id: str, *, rank: int = 0,
                    world_size: int = 1, quantization: str = "auto") -> CacheKey:
    """The key for serving model_dir in dtype on device_id. Reads only headers and config.json (milliseconds)."""
    import warmstart
    from warmstart.models.spec import ModelSpec
    from warmstart.weights.loader import checkpoint_identity
    ident = json.dumps(checkpoint_identity(model_dir), sort_keys=True).encode()
    return CacheKey(checkpoint=hashlib.sha256(ident).hexdigest(),
                    architecture=ModelSpec.from_dir(model_dir).architecture, dtype=dtype_name(dtype), role=role,
                    post_processing=post_processing(quantization), warmstart_version=warmstart.__version__,
                    torch_version=torch.__version__, rank=rank, world_size=world_size, device=device_id)


def bytes_digest(data: memoryview | bytes) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's bytes in row-major order: the same for a disk-loaded tensor and its served copy."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().view(torch.uint8)
    return bytes_digest(memoryview(raw.numpy()) if raw.numel() else b"")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    region: int
    offset: int              # bytes from the start of the region
    nbytes: int
    digest: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"], d["stride"] = list(self.shape), list(self.stride)
        return d


@dataclass(frozen=True)
class Manifest:
    """The layout of a daemon's regions. `digest` covers key, regions and entries; `check` re-derives it."""
    key: CacheKey
    region_sizes: tuple[int, ...]
    entries: tuple[TensorEntry, ...]
    weight_bytes: int        # the post-processed tensor bytes: what a disk load of the same key owns
    digest: str = ""

    def body(self) -> dict:
        return {"key": self.key.to_dict(), "region_sizes": list(self.region_sizes),
                "entries": [e.to_dict() for e in self.entries], "weight_bytes": self.weight_bytes}

    def compute_digest(self) -> str:
        return bytes_digest(json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode())

    def sealed(self) -> "Manifest":
        return Manifest(self.key, self.region_sizes, self.entries, self.weight_bytes, self.compute_digest())

    def to_dict(self) -> dict:
        return {**self.body(), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: object) -> "Manifest":
        """Parse and fully validate a peer's manifest; ValueError names the first problem found."""
        if not isinstance(d, dict) or set(d) != {"key", "region_sizes", "entries", "weight_bytes", "digest"}:
            raise ValueError("manifest has the wrong fields")
        sizes = d["region_sizes"]
        if not isinstance(sizes, list) or not all(type(s) is int and s >= 0 for s in sizes):
            raise ValueError("manifest region sizes are not non-negative integers")
        if not isinstance(d["entries"], list) or type(d["weight_bytes"]) is not int or \
                not isinstance(d["digest"], str):
            raise ValueError("manifest entries, weight_bytes or digest have the wrong type")
        entries = tuple(_entry(e, sizes) for e in d["entries"])
        if len({e.name for e in entries}) != len(entries):
            raise ValueError("manifest names a tensor twice")
        m = cls(CacheKey.from_dict(d["key"]), tuple(sizes), entries, d["weight_bytes"], d["digest"])
        if m.compute_digest() != m.digest:
            raise ValueError("manifest digest does not match its contents")
        if sum(e.nbytes for e in entries) != m.weight_bytes:
            raise ValueError(f"manifest entries hold {sum(e.nbytes for e in entries)} bytes but it reports "
                             f"{m.weight_bytes}")
        return m


def _entry(e: object, region_sizes: list[int]) -> TensorEntry:
    """One entry, checked against its region: aligned, in bounds, and nbytes consistent with shape and stride."""
    keys = {"name", "dtype", "shape", "stride", "region", "offset", "nbytes", "digest"}
    if not isinstance(e, dict) or set(e) != keys:
        raise ValueError("manifest entry has the wrong fields")
    name, dt, shape, stride = e["name"], e["dtype"], e["shape"], e["stride"]
    ints = (e["region"], e["offset"], e["nbytes"])
    if not isinstance(name, str) or dt not in DTYPE_NAMES or not isinstance(e["digest"], str) or \
            any(type(v) is not int or v < 0 for v in ints) or not isinstance(shape, list) or \
            not isinstance(stride, list) or len(shape) != len(stride) or \
            any(type(v) is not int or v < 0 for v in shape + stride):
        raise ValueError(f"manifest entry {name!r} is malformed")
    region, offset, nbytes = ints
    itemsize = torch.empty((), dtype=DTYPE_NAMES[dt]).element_size()
    numel = 1
    for s in shape:
        numel *= s
    # The furthest element a strided view reaches must lie inside the entry's bytes, and those inside the region.
    span = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize if numel else 0
    if region >= len(region_sizes) or offset % 64 or offset + nbytes > region_sizes[region] or \
            nbytes != numel * itemsize or span > nbytes:
        raise ValueError(f"manifest entry {name!r} lies outside its region or disagrees with its shape")
    return TensorEntry(name, dt, tuple(shape), tuple(stride), region, offset, nbytes, e["digest"])
