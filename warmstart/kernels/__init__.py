"""warmstart's compiled CPU kernels (built by `make venv` via setup.py), each with a pure-torch path of the same
semantics where it cannot run. One module per idea, all re-exported here:

- `attention`: paged attention over the KV cache in place, the cache's layout (`kv_blocks`, head-major) and its
  int8 rows;
- `linear`: quantized (int4/int8) and float linears, and the ISA they run on;
- `fused`: the decode step's small ops (RMSNorm, RoPE, the KV write, SiLU, argmax);
- `pool`: the kernels' own thread pool and where its workers run;
- `stack`: the decoder's layer loop in one call;
- `loader`: how each compiled module is loaded, or why it is not."""
from __future__ import annotations

from warmstart.kernels.attention import (KV_SCALE_BYTES, NATIVE_UNAVAILABLE_REASON, _native, has_native,
                                         head_major_copy, kv_blocks, kv_row_width, kv_rows_as, kv_slot_rows,
                                         paged_attention, paged_attention_torch, paged_int8_lanes, quantize_kv_rows)
from warmstart.kernels.fused import (FUSED_UNAVAILABLE_REASON, _fused, add_rms_norm, argmax, has_fused, rotary_,
                                     silu_mul, write_kv)
from warmstart.kernels.linear import (DENSE_GEMV_MAX_ROWS, DENSE_MIN_ROWS, PANEL_MIN_ROWS, QLINEAR_UNAVAILABLE_REASON,
                                      VNNI_INT4_PANEL_ROWS, _qlinear, dense_linear, has_qlinear, panel_threshold,
                                      qlinear, qlinear_isa, set_qlinear_isa)
from warmstart.kernels.pool import pin_workers, pool_stats, set_pool_enabled, spread_workers
from warmstart.kernels.stack import STACK_UNAVAILABLE_REASON, native_stack

__all__ = ["paged_attention", "paged_attention_torch", "has_native", "NATIVE_UNAVAILABLE_REASON", "qlinear",
           "has_qlinear", "QLINEAR_UNAVAILABLE_REASON", "dense_linear", "DENSE_GEMV_MAX_ROWS", "qlinear_isa",
           "set_qlinear_isa", "panel_threshold", "PANEL_MIN_ROWS", "DENSE_MIN_ROWS", "VNNI_INT4_PANEL_ROWS",
           "add_rms_norm", "rotary_", "write_kv", "kv_blocks", "head_major_copy", "kv_slot_rows",
           "kv_row_width", "kv_rows_as",
           "quantize_kv_rows", "KV_SCALE_BYTES", "paged_int8_lanes", "silu_mul", "argmax",
           "has_fused", "FUSED_UNAVAILABLE_REASON", "native_stack", "STACK_UNAVAILABLE_REASON",
           "pool_stats", "set_pool_enabled", "pin_workers", "spread_workers",
           "_native", "_qlinear", "_fused"]
