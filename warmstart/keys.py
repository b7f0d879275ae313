"""The two cache keys of a boot, side by side so their disjointness is visible.

plan key:    everything the KV allowance depends on — budget knobs included (SEEDS.md §1: a key without the
             memory utilization let a plan outlive its budget).
compile key: only what changes compiled code — never a budget knob, so a budget change re-profiles but reuses
             the compiler cache.
Both are computed once from the user's config and the device facts, before anything is derived."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from warmstart import __version__
from warmstart.config import EngineConfig
from warmstart.models.spec import ModelSpec
from warmstart.startup.device import DeviceFacts
from warmstart.startup.plan import PLAN_SCHEMA, PlanKey, canonical
from warmstart.weights.loader import checkpoint_identity


def _torch_build() -> dict:
    return {"version": torch.__version__, "cuda": torch.version.cuda, "git": (torch.version.git_version or "")[:12],
            "debug": bool(torch.version.debug)}


def plan_key(config: EngineConfig, model_dir: Path, spec: ModelSpec, facts: DeviceFacts,
             draft_dir: Path | None = None) -> PlanKey:
    return PlanKey({
        "schema": PLAN_SCHEMA,
        "warmstart_version": __version__,
        "model.architecture": spec.architecture,
        "model.weights": checkpoint_identity(model_dir),
        "dtype": config.dtype,
        "kv_cache_dtype": config.kv_cache_dtype,
        "quantization": config.quantization,
        "max_model_len": config.max_model_len if config.max_model_len is not None else "auto",
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "memory_utilization": config.utilization,
        "compile": config.compile,
        "draft_model": checkpoint_identity(draft_dir) if draft_dir else None,
        "speculative.method": config.spec_method,
        "speculative.num_tokens": config.num_speculative_tokens,
        "device.kind": facts.kind,
        "device.name": facts.name,
        "device.total_bytes": facts.total_bytes,
        "device.capability": facts.capability,
        "torch": _torch_build(),
        "rank": config.rank,
        "world_size": config.world_size,
    })


def compile_key(config: EngineConfig, spec: ModelSpec, facts: DeviceFacts) -> str:
    """Shapes, dtypes, code versions and the ISA — what inductor's output depends on. Not the weights' values,
    not the memory budget, not the KV size."""
    parts = {
        "warmstart_version": __version__,
        "torch": _torch_build(),
        "model": {k: v for k, v in spec.__dict__.items() if k not in ("eos_token_ids", "bos_token_id")},
        "dtype": config.dtype,
        "kv_cache_dtype": config.kv_cache_dtype,
        "quantization": config.quantization,
        "device": [facts.kind, facts.capability],
    }
    return hashlib.sha256(canonical(parts).encode()).hexdigest()[:24]
