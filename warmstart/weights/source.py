"""Where a boot's weights come from: disk, or a weight daemon (zero-copy or copy), with a disk fallback.

Every path returns the same LoadedWeights, and the ledger reads only `owned_bytes` and `charges`, so for W bytes
of post-processed weights the KV cache is the same whichever way they came:

    disk              owned W   charged 0
    zero-copy attach  owned 0   charged W (the daemon's reported bytes, checked against its manifest)
    copy attach       owned W   charged 0 (charged W during the copy, removed once the lease is released)
    disk fallback     owned W   charged 0 (charged W when the daemon said hello, removed once, after the disk load
                                           succeeded; never charged at all if no daemon answered)

`--load-format auto` tries a daemon only when the socket for this device and role exists, else loads from disk
without a word; `daemon` expects one, so its absence is a reported fallback (or an error with fallback off);
`disk` never looks."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from warmstart.errors import UserError
from warmstart.weights.charges import ExternalCharges
from warmstart.weights.loader import load_tensors, weights_nbytes
from warmstart.weights.shard import ShardCut

log = logging.getLogger("warmstart.weights")


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    owned_bytes: int                 # weight bytes this process holds itself (disk load or copy attach)
    charges: ExternalCharges         # bytes a daemon holds for us (zero-copy attach)
    source: str                      # "disk" | "daemon-zero-copy" | "daemon-copy"
    fallback_reason: str | None = None


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, *, role: str = "target",
                 config=None, charges: ExternalCharges | None = None, shard: ShardCut | None = None) -> LoadedWeights:
    """Post-processed tensors for one model (role "target" or "draft"), per config's load_format, weight_socket,
    weight_mode and weight_fallback (no config: disk). Pass the boot's one `charges` object for every role, so
    that a daemon serving two roles is charged once. Under tensor parallelism `shard` is this rank's cut: a disk
    load applies it, and the rank's own daemon socket serves the same cut."""
    charges = ExternalCharges() if charges is None else charges
    fmt = "disk" if config is None else config.load_format
    if fmt == "disk":
        return _from_disk(model_dir, dtype, device, charges, _quantization(config), shard)
    from warmstart.weights import client     # only a boot that may use a daemon pays for its imports
    path = client.resolve_socket(config.weight_socket, torch.device(device), role, config.rank, config.world_size)
    if fmt == "auto" and not os.path.lexists(path):
        return _from_disk(model_dir, dtype, device, charges, config.quantization, shard)
    return _from_daemon(model_dir, dtype, torch.device(device), role, config, charges, path, shard)


def _quantization(config) -> str:
    return "auto" if config is None else config.quantization


def _from_disk(model_dir: Path, dtype: torch.dtype, device, charges: ExternalCharges,
               quantization: str = "auto", shard: ShardCut | None = None) -> LoadedWeights:
    tensors = load_tensors(model_dir, dtype, device, quantization=quantization, shard=shard)
    return LoadedWeights(tensors, weights_nbytes(tensors), charges, "disk")


def _from_daemon(model_dir: Path, dtype: torch.dtype, device: torch.device, role: str, config,
                 charges: ExternalCharges, path: Path, shard: ShardCut | None) -> LoadedWeights:
    from warmstart.weights import client
    from warmstart.weights.manifest import build_cache_key
    from warmstart.weights.transport import device_id
    socket_id = os.fspath(path)
    charged = False
    t0 = time.perf_counter()
    try:
        key = build_cache_key(model_dir, dtype, role, device_id(device), rank=config.rank,
                              world_size=config.world_size, quantization=config.quantization)
        with client.DaemonSession(path) as session:
            hello = session.open()
            # The daemon's bytes are charged as soon as it reports them: before anything is mapped, and so
            # before memory profiling. False if another role already charged this daemon: its memory exists once.
            charged = charges.charge(socket_id, role, hello.weight_bytes)
            attached = session.attach(key, config.weight_mode, device)
    except client.AttachFailure as failure:
        return _fall_back(failure, model_dir, dtype, device, role, config, charges, socket_id, charged, shard)
    ms = (time.perf_counter() - t0) * 1e3
    if attached.mode == "copy":
        # The lease is released: the daemon no longer holds anything on our behalf, and we own a copy.
        charges.remove(socket_id, role)
        log.info("weights: copied %d tensors from the daemon at %s (pid %d) in %.1f ms", len(attached.tensors),
                 path, hello.pid, ms)
        return LoadedWeights(attached.tensors, weights_nbytes(attached.tensors), charges, "daemon-copy")
    log.info("weights: attached %d tensors (%d bytes) zero-copy from the daemon at %s (pid %d) in %.1f ms",
             len(attached.tensors), hello.weight_bytes, path, hello.pid, ms)
    return LoadedWeights(attached.tensors, 0, charges, "daemon-zero-copy")


def _fall_back(failure, model_dir: Path, dtype: torch.dtype, device: torch.device, role: str, config,
               charges: ExternalCharges, socket_id: str, charged: bool, shard: ShardCut | None) -> LoadedWeights:
    if not config.weight_fallback:
        raise UserError(_explain(failure, model_dir, dtype, role, socket_id)) from None
    log.warning("weights: not using the daemon at %s for the %s model (%s); loading from disk", socket_id, role,
                failure.reason)
    loaded = _from_disk(model_dir, dtype, device, charges, config.quantization, shard)
    if charged:
        # Only now that our own copy exists: remove exactly this source's charge, once. Leaving it would charge
        # the same weights twice (ours and the daemon's) and shrink the KV cache for nothing.
        charges.remove(socket_id, role)
    loaded.fallback_reason = failure.reason
    return loaded


def _explain(failure, model_dir: Path, dtype: torch.dtype, role: str, socket_id: str) -> str:
    from warmstart.weights.manifest import dtype_name
    serve = f"`warmstart weights serve {model_dir} --dtype {dtype_name(dtype)} --role {role}`"
    fixes = {
        "daemon_absent": f"No daemon is serving; start one with {serve}.",
        "daemon_unreachable": f"The socket exists but no daemon answers (it died or is still loading); start one "
                              f"with {serve}, or wait for its READY line.",
        "key_mismatch": f"The daemon serves a different configuration; stop it (`warmstart weights stop --socket "
                        f"{socket_id}`) and start {serve}, or boot the engine with the daemon's settings.",
        "protocol_version": f"The daemon runs another warmstart version; restart it from this installation with "
                            f"{serve}.",
        "socket_untrusted": "The path is not a socket owned by you; remove it, or point --weight-socket at your "
                            "own daemon.",
        "peer_uid": "The daemon runs as another user; run it as yourself.",
    }
    fix = fixes.get(failure.code, f"Restart the daemon (`warmstart weights stop --socket {socket_id}`, then "
                                  f"{serve}).")
    return (f"The {role} model's weights could not come from the weight daemon at {socket_id} "
            f"({failure.reason}), and --weight-fallback is off. {fix} To load from disk instead, pass "
            "--weight-fallback on, or --load-format disk.")
