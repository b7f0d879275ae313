"""Frozen engine configuration. Validated once in __post_init__; measured facts never come back in here."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from warmstart.errors import UserError
from warmstart.paths import warmstart_cache_dir

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8", "int4"]
PlanMode = Literal["auto", "off", "read", "write", "require"]
LoadFormat = Literal["auto", "disk", "daemon"]
WeightMode = Literal["zero_copy", "copy"]

# On a GPU the engine owns the card, so it may take 90 %. On a CPU the same RAM hosts everything else on the machine,
# so the default leaves it usable: 20 % of host RAM (4.7 GiB on a 24 GiB box) for weights, activations and KV.
DEFAULT_UTILIZATION = {"cuda": 0.9, "cpu": 0.2}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
          "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'256MiB' -> 268435456; '2GiB', '1.5G', '4096' also work. SI suffixes are powers of 10, IEC ones of 2."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"Cannot read {text!r} as a byte size. Write a number with an optional suffix, "
                        "for example 268435456, 256MiB, 2GiB or 1.5GB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Human-readable IEC size, for logs and errors."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class EngineConfig:
    """Everything a boot depends on that the user chooses. Defaults are the CLI's defaults."""

    model: str
    dtype: Dtype = "auto"
    device: str = "auto"                      # "auto" picks cuda when torch sees one, else cpu
    memory_utilization: float | None = None   # fraction of device total; None -> DEFAULT_UTILIZATION[device kind]
    kv_cache_memory: int | None = None        # explicit KV bytes: wins over utilization, bypasses plans
    max_model_len: int | None = None          # None -> the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512         # tokens per step; also the size of the profiling forward
    block_size: int = 16
    kv_cache_dtype: str = "auto"              # "auto" -> the model dtype
    quantization: Quantization = "auto"       # auto: a quantized checkpoint (imported GGUF) keeps its formats
    compile: bool = False
    threads: int | None = None                # CPU intra-op threads; None -> the cores this process may use
    cache_dir: Path = field(default_factory=warmstart_cache_dir)
    seed: int = 0
    # startup plans
    startup_plan: PlanMode = "auto"
    plan_free_tolerance: int | None = None    # bytes of free-memory shortfall a plan tolerates; None -> device default
    # weight daemon
    load_format: LoadFormat = "auto"
    weight_socket: str | None = None
    weight_mode: WeightMode = "zero_copy"
    weight_fallback: bool = True
    draft_model: str | None = None            # --speculative-model: the draft model of speculative decoding
    # speculative decoding (warmstart/spec): propose K tokens per decoding sequence, verify them in one forward
    num_speculative_tokens: int = 0
    draft_weight_socket: str | None = None    # the draft role's daemon socket (default: discovered for role draft)
    speculative_method: str | None = None     # "draft" | "ngram"; None -> "draft" when draft_model is set
    # prefix cache: reuse cached full KV blocks across requests, and keep the hottest across a restart
    enable_prefix_caching: bool = True
    prefix_cache_persist: int = 64 * 2**20    # bytes of cached KV written at graceful shutdown; 0 disables save+restore
    # tensor parallelism (warmstart/parallel/): world_size is --tensor-parallel-size; rank and world size are part
    # of every key so that plans never cross ranks. Under TP, `threads` is per rank (--threads-per-rank).
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"            # rank 0's rendezvous address (torchrun's MASTER_ADDR)
    master_port: int = 0                      # 0: a free port, chosen by rank 0
    tp_timeout: float = 600.0                 # seconds a collective may wait for a peer before it fails
    nnodes: int = 1                           # hosts the ranks span; the others join with `warmstart tp-join`

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"--dtype {self.dtype!r} is not supported; use auto, float32, bfloat16 or float16.")
        _check(re.fullmatch(r"auto|cpu|cuda(:\d{1,3})?", self.device) is not None,
               f"--device {self.device!r} is not supported; use auto, cpu, cuda or cuda:N (N a GPU index).")
        # torch.manual_seed's range; anything else would fail inside the boot with a traceback.
        _check(-2**63 <= self.seed < 2**64, f"--seed must be between -2**63 and 2**64-1, got {self.seed}.")
        if self.memory_utilization is not None:
            _check(0 < self.memory_utilization <= 1, f"--memory-utilization must be in (0, 1], got "
                   f"{self.memory_utilization}. It is the fraction of device memory this engine may use.")
        if self.kv_cache_memory is not None:
            _check(self.kv_cache_memory > 0, f"--kv-cache-memory must be a positive size such as 256MiB, got "
                   f"{self.kv_cache_memory}. Leave it out to size the KV cache from --memory-utilization.")
        if self.max_model_len is not None:
            _check(self.max_model_len > 0, f"--max-model-len must be positive, got {self.max_model_len}.")
        if self.threads is not None:
            _check(0 < self.threads <= 1024, f"--threads must be between 1 and 1024, got {self.threads}.")
        _check(self.max_num_seqs > 0, f"--max-num-seqs must be positive, got {self.max_num_seqs}.")
        _check(self.max_num_batched_tokens > 0,
               f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}.")
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0 and self.block_size <= 1024,
               f"--block-size must be a power of two up to 1024, got {self.block_size}.")
        _check(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16", "int8"),
               f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; use auto, float32, bfloat16, float16 "
               "or int8.")
        _check(self.kv_cache_dtype != "int8" or self.device_kind == "cpu",
               "--kv-cache-dtype int8 is a CPU cache (its kernels are CPU kernels); on CUDA use auto, bfloat16 or "
               "float16.")
        _check(self.quantization in ("auto", "none", "int8", "int4"),
               f"--quantization {self.quantization!r} is not one of auto, none, int8, int4.")
        _check(self.startup_plan in ("auto", "off", "read", "write", "require"),
               f"--startup-plan {self.startup_plan!r} is not one of auto, off, read, write, require.")
        _check(self.load_format in ("auto", "disk", "daemon"),
               f"--load-format {self.load_format!r} is not one of auto, disk, daemon.")
        _check(self.weight_mode in ("zero_copy", "copy"),
               f"--weight-mode {self.weight_mode!r} is not one of zero_copy, copy.")
        _check(self.prefix_cache_persist >= 0, f"--prefix-cache-persist must be a size of 0 or more (0 disables "
               f"it), got {self.prefix_cache_persist}.")
        _check(self.speculative_method in (None, "draft", "ngram"),
               f"--speculative-method {self.speculative_method!r} is not one of draft, ngram.")
        _check(self.speculative_method != "ngram" or self.draft_model is None,
               "--speculative-method ngram uses no second model; drop --speculative-model, or use method draft.")
        _check(self.speculative_method != "draft" or self.draft_model is not None,
               "--speculative-method draft needs --speculative-model PATH (a model with the target's vocabulary).")
        _check(0 <= self.num_speculative_tokens <= 15,
               f"--num-speculative-tokens must be between 0 and 15, got {self.num_speculative_tokens}.")
        _check(self.spec_method is None or self.num_speculative_tokens > 0,
               "Speculative decoding needs --num-speculative-tokens K (1 to 15): how many tokens to propose.")
        _check(self.num_speculative_tokens == 0 or self.spec_method is not None,
               "--num-speculative-tokens needs a proposer: --speculative-model PATH or --speculative-method ngram.")
        _check(0 <= self.rank < self.world_size, f"rank {self.rank} is outside world size {self.world_size}.")
        _check(1 <= self.world_size <= 1024, f"--tensor-parallel-size must be between 1 and 1024, got "
               f"{self.world_size}.")
        if self.world_size > 1:
            _check(not self.compile, "--compile is not supported with --tensor-parallel-size > 1 yet; drop one.")
            _check(self.spec_method is None, f"Speculative decoding (--speculative-"
                   f"{'model' if self.spec_method == 'draft' else 'method ngram'}) is not supported with "
                   f"--tensor-parallel-size {self.world_size} yet: drop --tensor-parallel-size, or drop "
                   "--speculative-model/--speculative-method and --num-speculative-tokens.")
            _check(0 <= self.master_port <= 65535, f"--master-port must be a TCP port, got {self.master_port}.")
        _check(self.nnodes >= 1 and self.world_size % self.nnodes == 0,
               f"--nnodes {self.nnodes} must divide --tensor-parallel-size {self.world_size} (the same number of "
               "ranks on every host).")
        if self.nnodes > 1:
            _check(self.master_port != 0 and self.master_addr not in ("", "0.0.0.0"),
                   "--nnodes > 1 needs an explicit --master-addr (an address the other hosts can reach) and "
                   "--master-port: the other hosts join there with `warmstart tp-join`.")

    @property
    def spec_method(self) -> str | None:
        """The speculative method in force: None (off), "draft" or "ngram"."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft" if self.draft_model is not None else None

    @property
    def device_kind(self) -> str:
        """'cpu' or 'cuda' — which device family the boot targets ('auto' resolved through torch)."""
        if self.device != "auto":
            return self.device.split(":")[0]
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def utilization(self) -> float:
        """The memory utilization in force: the user's, else the device default."""
        if self.memory_utilization is not None:
            return self.memory_utilization
        return DEFAULT_UTILIZATION[self.device_kind]

    def replace(self, **changes) -> "EngineConfig":
        """A new config with some fields changed (configs are never mutated)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        return d


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)
