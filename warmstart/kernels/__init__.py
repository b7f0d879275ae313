"""Attention that reads the paged KV cache in place.

`paged_attention` runs the compiled CPU kernel (warmstart.kernels._paged, built by `make venv` via setup.py) when it
is available and the inputs are on the CPU, and the pure-torch `paged_attention_torch` otherwise; both have the same
semantics. `has_native()` says which one runs, and `NATIVE_UNAVAILABLE_REASON` says why the kernel is not used
(None when it is).

Layout: k_cache/v_cache are one layer's [num_blocks, block_size, Hkv, D]; context position p of sequence s lives at
cache[block_tables[s, p // block_size], p % block_size]. Query t (of sequence seq_idx[t]) attends over positions
0..ctx_lens[t]-1, so a chunk of new tokens at positions c..c+n-1 passes ctx_lens c+1..c+n (causal). The kernels take
any strides with contiguous rows; the runner's cache is head-major in memory (`kv_blocks`)."""
from __future__ import annotations

import importlib
import logging
import os
import platform

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = ["paged_attention", "paged_attention_torch", "has_native", "NATIVE_UNAVAILABLE_REASON", "qlinear",
           "has_qlinear", "QLINEAR_UNAVAILABLE_REASON", "dense_linear", "DENSE_GEMV_MAX_ROWS", "qlinear_isa",
           "set_qlinear_isa", "panel_threshold",
           "add_rms_norm", "rotary_", "write_kv", "kv_blocks", "kv_slot_rows", "silu_mul", "argmax",
           "has_fused", "FUSED_UNAVAILABLE_REASON", "native_stack", "STACK_UNAVAILABLE_REASON"]

_REQUIRED_X86_FLAGS = ("avx2", "fma", "f16c")   # the kernel is compiled for x86-64-v3's vector ISA (see setup.py)


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _load_native(name: str = "_paged"):
    """Returns (module, None) or (None, reason). Checks the CPU before loading: the .so holds AVX2/FMA/F16C code."""
    if os.environ.get("WARMSTART_NO_NATIVE_KERNELS"):
        return None, "disabled by WARMSTART_NO_NATIVE_KERNELS"
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags = _cpu_flags()
        if flags is None:
            return None, "cannot read /proc/cpuinfo to check for avx2/fma/f16c"
        missing = [f for f in _REQUIRED_X86_FLAGS if f not in flags]
        if missing:
            return None, f"CPU lacks {', '.join(missing)} (the kernel is built for x86-64-v3)"
    try:
        native = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        reason = f"extension not built ({e})"
        for err in (f"_build_error_{name}.txt", "_build_error.txt"):   # this module's own build, or all four's
            err = os.path.join(os.path.dirname(__file__), err)
            if os.path.exists(err):
                with open(err) as f:
                    reason += f"; last build: {f.read().strip()}"
                break
        return None, reason
    return native, None


_native, NATIVE_UNAVAILABLE_REASON = _load_native()
if NATIVE_UNAVAILABLE_REASON is not None:
    log.info("paged attention: pure-torch fallback (%s)", NATIVE_UNAVAILABLE_REASON)


def has_native() -> bool:
    return _native is not None


# ------------------------------------------------------------------------------------------------ int8 KV rows
# An int8 cache row holds a (token, head)'s D codes, then its float32 scale in the next 4 bytes: x = code * scale,
# scale = max|x| / 127 (per token and head, as llama.cpp's q8_0 cache does per block of 32). 68 bytes per row of 64
# instead of 128 (float16): a long context's decode reads ~half the bytes, and a budget holds ~1.9x the blocks.
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of the KV cache: head_dim, and an int8 row's 4 scale bytes after it."""
    return head_dim + KV_SCALE_BYTES if dtype is torch.int8 else head_dim


def kv_blocks(storage: torch.Tensor, lead: tuple[int, ...], num_blocks: int, block_size: int, kv_heads: int,
              row: int) -> torch.Tensor:
    """`storage` (contiguous, numel = prod(lead) x num_blocks x block_size x kv_heads x row) as the cache's logical
    [*lead, num_blocks, block_size, kv_heads, row], laid out head-major: [*lead, num_blocks, kv_heads, block_size,
    row] in memory, so each head's rows of a block are block_size x row contiguous elements, as vLLM lays them out.
    Decode attention reads one head's rows position after position; with heads interleaved per position (the
    logical order in memory) that is a stride of kv_heads rows, and on Zen 2/3 EPYCs the hardware prefetcher then
    falls behind. Batch 8 x 2,048 positions, same kernel, bit-identical results (benchmarks/paged_attention.py
    --layouts head position): float16 1.39x (1 thread) and 1.20x (2) faster head-major on a Zen 3, 1.19x and 1.21x
    on a Zen 2; int8 1.06-1.11x (its arithmetic, not memory, limits it there)."""
    n = len(lead)
    return storage.view(*lead, num_blocks, kv_heads, block_size, row).transpose(n + 1, n + 2)


def kv_slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of `slots` (slot = block x block_size + offset) of one layer's cache [blocks, block_size, Hkv, row]:
    a new [len(slots), Hkv, row] tensor."""
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs]


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """float [..., D] -> int8 [..., D + 4] rows (codes, then the float32 scale's bytes); the compiled write_kv writes
    the same bytes (csrc/fused.h write_rows_i8)."""
    x = x.float()
    d = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, (x / d).round().clamp(-127, 127), torch.zeros_like(x)).to(torch.int8)
    return torch.cat([codes, d.contiguous().view(torch.int8)], dim=-1)


def kv_rows_as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] read back as [..., D] values of `dtype` (int8 rows: codes * scale)."""
    if rows.dtype is not torch.int8:
        return rows.to(dtype)
    d = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-KV_SCALE_BYTES].float() * d).to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_idx: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (D + 4 for int8 rows); block_tables int32
    [S, max_blocks]; seq_idx, ctx_lens int32 [T]. Returns [T, H, D] in q's dtype, accumulated in fp32."""
    if _native is not None and q.device.type == "cpu" and k_cache.device.type == "cpu":
        if v_cache.dtype != k_cache.dtype:
            v_cache = v_cache.to(k_cache.dtype)
        out = _native.paged_attention(q, k_cache, v_cache, block_tables, seq_idx, ctx_lens, float(scale))
        return out if q.dtype == torch.float32 else out.to(q.dtype)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_idx, ctx_lens, scale)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_idx: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same semantics in plain torch (any device): per sequence, gather its context blocks once, then attend all
    of that sequence's queries with a mask (position p visible to query t iff p < ctx_lens[t]). fp32 math."""
    T, H, D = q.shape
    _, bs, Hkv, row = k_cache.shape
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return out.to(q.dtype)
    G = H // Hkv
    seq_cpu, ctx_cpu = seq_idx.tolist(), ctx_lens.tolist()
    by_seq: dict[int, list[int]] = {}
    for t, s in enumerate(seq_cpu):
        by_seq.setdefault(s, []).append(t)
    for s, rows in by_seq.items():
        length = max(ctx_cpu[t] for t in rows)
        if length == 0:
            continue
        nblk = -(-length // bs)
        ids = block_tables[s, :nblk].to(device=k_cache.device, dtype=torch.long)
        kk = kv_rows_as(k_cache.index_select(0, ids).reshape(nblk * bs, Hkv, row)[:length], torch.float32)
        vv = kv_rows_as(v_cache.index_select(0, ids).reshape(nblk * bs, Hkv, row)[:length], torch.float32)
        idx = torch.tensor(rows, device=q.device)
        qs = q.index_select(0, idx).float().view(len(rows), Hkv, G, D)                  # [n, Hkv, G, D]
        scores = torch.einsum("nkgd,lkd->nkgl", qs, kk) * scale                       # [n, Hkv, G, L]
        lens = torch.tensor([ctx_cpu[t] for t in rows], device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] < lens[:, None]        # [n, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)                                        # ctx_len 0 rows -> zeros
        o = torch.einsum("nkgl,lkd->nkgd", probs, vv).reshape(len(rows), H, D)
        out.index_copy_(0, idx, o)
    return out.to(q.dtype)


_qlinear, QLINEAR_UNAVAILABLE_REASON = _load_native("_qlinear")


def has_qlinear() -> bool:
    """True when the compiled quantized-linear kernel (csrc/qlinear.h) runs on this CPU."""
    return _qlinear is not None


# Three routes by row count, measured with every kernel threaded (2 threads, AVX2; SmolLM2's q/k/v, gate_up, down and
# int8 LM-head shapes; GFLOPS in the closing note of issue 8):
# - below PANEL_MIN_ROWS (a decode step of a few sequences): activations quantized to int8 per block of 32, the
#   weight read directly (memory-bound; 1.3-4x faster than the others at 4 rows);
# - from PANEL_MIN_ROWS (decode batches): the weight expanded to float32 a panel of 48 rows at a time in L2 and
#   multiplied by a register-blocked kernel: 135-158 GFLOPS at 32-64 rows, 1.5-2x either alternative;
# - from DENSE_MIN_ROWS (long prefill chunks): expanded in 8 MiB tiles and multiplied by torch's float32 GEMM,
#   which wins (1.1-1.2x) once the rows no longer stay in cache.
# The two float32 routes are exact (full-precision activations); the int8-activation one rounds activations.
# On CPUs with AMX-BF16 tiles (qlinear_isa() "amx-bf16") the panel route runs on the tiles in bfloat16 and takes
# every row count from PANEL_MIN_ROWS (2.2-4x the float32 GEMM at 256-512 rows, ~3x the float32 panels at 32):
# weights and activations rounded to bfloat16, float32 sums, so outputs are within bfloat16 rounding, not exact.
# On AVX-512 VNNI without AMX (the AVX-512 EPYCs; an AMX Xeon held at "avx512-vnni") the int8-activation route
# (vpdpbusd, 64 weights an instruction, no expansion of the weight) beats the float32 panels further up: at 8-32
# rows 1.3-2.2x (int8 weights) and 1.0-1.7x (int4); at 48-128 rows still 1.04-1.3x for int8 weights, while int4's
# (its codes unpacked again for every 4 rows) fell to 0.8-1.0x (2 threads, SmolLM2's shapes incl. the LM head;
# issue 8's closing notes). So there int8 weights keep it up to DENSE_MIN_ROWS and int4 up to VNNI_INT4_PANEL_ROWS.
PANEL_MIN_ROWS = 8
DENSE_MIN_ROWS = 256
VNNI_INT4_PANEL_ROWS = 40


def panel_threshold(int4: bool) -> int:
    """The row count from which the panel route runs, for the kernels in force (qlinear_isa()) and weight kind."""
    if qlinear_isa() == "avx512-vnni":
        return VNNI_INT4_PANEL_ROWS if int4 else DENSE_MIN_ROWS
    return PANEL_MIN_ROWS


def paged_int8_lanes(head_dim: int) -> int | None:
    """8 or 16: the lanes of the paged-attention kernel's int8-cache tile step at this head_dim under the ISA in force
    (16 where the CPU has AVX-512 VNNI, set_qlinear_isa allows it and head_dim is a multiple of 32); None without
    the compiled kernel."""
    return _native.int8_lanes(head_dim) if _native is not None else None


def qlinear_isa() -> str | None:
    """The kernels in force: "amx-bf16" (AVX-512 VNNI integer kernels, and the panel route on AMX-BF16 tiles, where
    the CPU and Linux give them), "avx512-vnni" (vpdpbusd, 64 weights per instruction; float32 panels), "avx2", or
    None without the compiled kernel. Chosen at run time; WARMSTART_KERNEL_ISA=avx512-vnni or avx2 holds it lower."""
    return _qlinear.isa() if _qlinear is not None else None


def set_qlinear_isa(name: str) -> str | None:
    """Holds the kernels at "avx2" or "avx512-vnni", or allows "amx-bf16" (at most what the CPU has), for A/B runs
    and tests; returns the level in force. One setting per process (all four modules share it; paged attention's
    int8-cache step follows it too)."""
    return _qlinear.set_isa(name) if _qlinear is not None else None


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
            dense_min_rows: int = DENSE_MIN_ROWS, panel_min_rows: int | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) times a quantized weight, float32 [M, N] out. int4: qweight uint8 [N, K/2],
    scales and mins float32 [N, K/32]; int8: qweight int8 [N, K], scales float32 [N, K/32]. Routes by M (see
    above; a threshold of 0 turns its route off): int8 activations below panel_min_rows, the float32 panel kernel
    from there, the float32 GEMM over expanded tiles from dense_min_rows. panel_min_rows None: panel_threshold()
    for the kernels in force and this weight's kind."""
    if panel_min_rows is None:
        panel_min_rows = panel_threshold(mins is not None)
    return _qlinear.qlinear(x, qweight, scales, mins, dense_min_rows, panel_min_rows)


# Float linears at a few rows (csrc/dense_linear.h): a decode step's float32 or bfloat16 matmuls stream their weight,
# and torch's CPU GEMM did so at about a third of the memory bandwidth: float32 2.5-2.9x slower at 1-4 rows and
# 1.2-1.6x at 8, bfloat16 1.3-1.7x and 1.1x (SmolLM2's shapes, 30 layers and the LM head cold from memory, 2 threads,
# AVX-512 EPYC: benchmarks/dense_linear.py).
DENSE_GEMV_MAX_ROWS = _qlinear.dense_max_rows if _qlinear is not None else 0


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); for [M, K] CPU rows (M <= DENSE_GEMV_MAX_ROWS) whose x, weight and bias are all
    float32 or all bfloat16, contiguous, on the compiled GEMV (float32 sums, one rounding to the dtype at the end).
    Anything else runs F.linear. Under torch.compile a CPU call is the opaque op warmstart::dense_linear, which
    makes the same choice at run time, so a compiled step multiplies exactly as the eager one."""
    if _qlinear is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.warmstart.dense_linear(x, weight, bias) if x.is_cpu else F.linear(x, weight, bias)
    if x.dim() == 2 and x.shape[0] <= DENSE_GEMV_MAX_ROWS and x.is_cpu:
        return _qlinear.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


if _qlinear is not None:
    @torch.library.custom_op("warmstart::dense_linear", mutates_args=())
    def _dense_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _qlinear.dense_linear(x, weight, bias)

    @_dense_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ------------------------------------------------------------------------------------------------ fused glue
# The decode step's small ops, one call each (csrc/fused.h): at batch 1 their dispatch cost rivals the matmuls.
# Each function takes the compiled path for float32 or bfloat16 CPU tensors (all of one dtype; argmax float32 only)
# and a pure-torch path with the same semantics otherwise (float16 activations, CUDA, torch.compile tracing, no
# compiler at install time).
_fused, FUSED_UNAVAILABLE_REASON = _load_native("_fused")


def has_fused() -> bool:
    return _fused is not None


def _use_fused(*tensors: torch.Tensor) -> bool:
    if _fused is None or torch.compiler.is_compiling():
        return False
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for t in tensors:                      # a plain loop: this check runs ~10 times per layer per step
        if t.dtype is not dtype or not t.is_cpu:
            return False
    return True


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h) * weight, h) where h = x + residual, or h = x without a residual. x, residual [T, D]; the
    compiled path updates `residual` in place. Normalisation is in float32 (as transformers does), cast back."""
    if (_use_fused(x, weight) if residual is None else _use_fused(x, weight, residual)) and x.dim() == 2 \
            and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1):
        return _fused.add_rms_norm(x, residual, weight, eps), (x if residual is None else residual)
    h = x if residual is None else x + residual
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype), h


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, n, D] by cos, sin [T, 1, D] (or [T, D]); the compiled path rotates x in place and
    returns it, the torch path returns a new tensor: use the result."""
    if _use_fused(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        _fused.rotary_(x, cos.reshape(x.shape[0], x.shape[2]), sin.reshape(x.shape[0], x.shape[2]))
        return x
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Slot s's rows of k_cache and v_cache (block s // block_size, offset s % block_size) = k, v, converted to the
    cache dtype (int8: quantized rows, see quantize_kv_rows). k, v [T, Hkv, D]; caches one layer's [blocks,
    block_size, Hkv, D] (D + 4 int8), any strides with contiguous rows."""
    if _use_fused(k, v) and k_cache.device.type == "cpu" and k.stride(2) == 1 and v.stride(2) == 1 \
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] and slots.dtype == torch.long:
        _fused.write_kv(k, v, k_cache, v_cache, slots)
        return
    conv = quantize_kv_rows if k_cache.dtype is torch.int8 else (lambda t: t.to(k_cache.dtype))
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, offsets] = conv(k)
    v_cache[blocks, offsets] = conv(v)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding (gate | up) -> silu(gate) * up, [T, I]."""
    if _use_fused(x) and x.dim() == 2 and x.stride(1) == 1:
        return _fused.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> list[int]:
    """The index of each row's maximum of x [B, V], as torch.argmax picks it (the first maximum; a NaN counts as
    the maximum). The compiled path runs on this thread and the kernels' pool, not on the OpenMP team (csrc/fused.h
    says why)."""
    if _use_fused(x) and x.dtype is torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0:
        return _fused.argmax_rows(x).tolist()
    return x.max(dim=-1).indices.tolist()


def _pool_module():
    """Any loaded compiled module: they share one thread pool (csrc/pool.h), so one of them answers for all."""
    return next((m for m in (_native, _qlinear, _fused, _stack) if m is not None and hasattr(m, "pool_stats")), None)


def pool_stats() -> dict | None:
    """The kernels' thread pool so far (csrc/pool.h): loops it ran, chunks the calling thread ran, chunks its
    workers ran, and seconds the caller waited for a worker's chunk. None without compiled kernels."""
    m = _pool_module()
    if m is None:
        return None
    loops, caller, workers, wait_ns = m.pool_stats()
    return {"loops": loops, "caller_chunks": caller, "worker_chunks": workers, "caller_wait_s": wait_ns / 1e9}


def set_pool_enabled(on: bool) -> None:
    """Run the kernels' parallel loops on their own pool (the default) or on torch's OpenMP team from the next loop
    on (what WARMSTART_THREAD_POOL=0 chooses at start): for tests and A/B measurements."""
    m = _pool_module()
    if m is not None:
        m.set_pool_enabled(bool(on))


def pin_workers(cpus: list[int]) -> int:
    """Pin team thread t >= 1 of the calling thread's OpenMP pool to cpus[t] (csrc/affinity.h), and worker t of the
    kernels' own pool (csrc/pool.h) to the same CPU from its next loop on; the caller pins itself. Returns how many
    OpenMP workers were pinned: 0 without the compiled glue (nothing pinned, nothing breaks)."""
    pool = _pool_module()
    if pool is not None:
        pool.set_pool_cpus(list(cpus))
    return _fused.pin_workers(list(cpus)) if _fused is not None else 0


def spread_workers(cpus: list[int]) -> int:
    """Undo pin_workers(cpus) until it is called again: team threads t >= 1 of the calling thread's OpenMP pool, and
    the kernels' pool's workers from their next loop on, may run on any of `cpus` (runner/affinity.py: while the
    host is busy). Returns how many OpenMP workers were set: 0 without the compiled glue."""
    pool = _pool_module()
    if pool is not None:
        pool.set_pool_spread(True)
    return _fused.spread_workers(list(cpus)) if _fused is not None else 0


# ------------------------------------------------------------------------------------------------ decoder stack
# The decoder's layer loop over the kernels above, in one call (csrc/decoder_stack.cpp); warmstart/models/native.py
# decides when a model and a step may use it.
_stack, STACK_UNAVAILABLE_REASON = _load_native("_stack")


def native_stack():
    """The compiled decoder-stack module (its Stack, Layer and Linear classes), or None."""
    return _stack
