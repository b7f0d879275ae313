"""The weight daemon: load one model once, keep its post-processed tensors resident, hand them to engines.

Lifecycle, in order: take the flock on `<socket>.lock` (a second daemon for the same socket fails here, naming the
holder's PID, before loading anything); remove a stale socket (only the lock owner may); load the tensors through
the disk path's own `load_tensors`, so served bytes equal disk-loaded bytes; pack them into sealed memfds (CPU) or
one CUDA block per region; build and digest the manifest; drop load-time transients; bind the socket under a
temporary name and rename it into place (readiness is atomic: a socket that exists is ready); write READY to fd 2.
SIGTERM/SIGINT (or a `stop` request) unlink the socket and exit; the lock goes with the process.

One thread per connection, so engines attach concurrently; every read has a timeout until a lease is delivered.
A zero-copy engine keeps its connection open as its lease; its exit (even a crash) closes it, and the daemon
forgets the lease. Errors in one connection are answered on that connection and never stop the daemon."""
from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import torch

from warmstart.errors import UserError, from_os_error
from warmstart.weights import protocol as P
from warmstart.weights import transport as T
from warmstart.weights.loader import load_tensors, weights_nbytes
from warmstart.weights.manifest import CacheKey, Manifest, build_cache_key

log = logging.getLogger("warmstart.weights.daemon")

IO_TIMEOUT = 5.0              # seconds per message before a lease exists: a hung peer cannot hold a thread
MAX_CONNECTIONS = 128


class _Stop(Exception):
    pass


def acquire_lock(sock_path: Path) -> int:
    """Hold `<socket>.lock` exclusively for this process's life; UserError naming the holder if taken."""
    import fcntl
    lock_path = f"{sock_path}.lock"
    try:
        # O_NOFOLLOW: a symlink planted at the lock path must not make us create or truncate its target.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise from_os_error(e, f"taking the daemon lock {lock_path}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{lock_path} is not a regular file, so it cannot be the daemon's lock. Remove it (it may "
                        "have been planted by another user), or serve on another --socket-dir.")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"Another weight daemon (PID {holder}) already owns {sock_path}. Stop it with "
                        f"`warmstart weights stop --socket {sock_path}`, or serve on another --socket-dir or "
                        "--role.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class WeightDaemon:
    """One model, one device, one role, one socket."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, role: str,
                 socket_dir: Path | None = None, *, rank: int = 0, world_size: int = 1,
                 quantization: str = "auto"):
        self.quantization = quantization
        self.model_dir, self.dtype, self.device, self.role = model_dir, dtype, torch.device(device), role
        self.socket_dir = P.ensure_socket_dir(socket_dir)
        self.device_id = T.device_id(self.device)
        self.rank, self.world_size = rank, world_size
        self.socket_path = P.socket_path(self.socket_dir, self.device_id, role, rank, world_size)
        self.key: CacheKey = build_cache_key(model_dir, dtype, role, self.device_id, rank=rank,
                                             world_size=world_size, quantization=quantization)
        self._lock_fd = -1
        self._listener: socket.socket | None = None
        self._bound_ino = 0
        self._fds: list[int] = []                 # memfd regions (CPU)
        self._cuda_regions: list[torch.Tensor] = []
        self.manifest: Manifest | None = None
        self._mutex = threading.Lock()
        self._connections = 0
        self._leases: dict[int, dict] = {}
        self._deliveries = 0
        self._started = time.monotonic()
        self._ready_s = 0.0

    # -------------------------------------------------------------------------------------------- start-up
    def prepare(self) -> None:
        """Lock, clear a stale socket, load, pack, digest. After this the daemon only has to bind."""
        self._lock_fd = acquire_lock(self.socket_path)
        if os.path.lexists(self.socket_path):
            # We hold the lock, so whoever made this socket is gone: it is stale, and it is ours to remove.
            log.info("removing stale socket %s", self.socket_path)
            os.unlink(self.socket_path)
        # Load on the CPU even for a CUDA daemon: load_tensors converts dtype on the CPU before moving anyway, so the
        # bytes are the disk path's, and the GPU never holds the weights twice while they are packed.
        shard = None
        if self.world_size > 1:
            # This rank's shard, cut exactly as the engine's disk path cuts it (weights/shard.py).
            from warmstart.models.spec import ModelSpec
            from warmstart.weights.shard import ShardCut, check_divisible
            spec = ModelSpec.from_dir(self.model_dir)
            check_divisible(spec, self.world_size)
            shard = ShardCut(spec, self.rank, self.world_size)
        tensors = load_tensors(self.model_dir, self.dtype, "cpu", progress=False, quantization=self.quantization,
                               shard=shard)
        weight_bytes = weights_nbytes(tensors)
        if self.device.type == "cpu":
            self._fds, sizes, entries = T.build_memfd_regions(tensors, self.key.role)
        else:
            self._cuda_regions, sizes, entries = T.build_cuda_regions(tensors, self.device)
        self.manifest = Manifest(self.key, tuple(sizes), tuple(entries), weight_bytes).sealed()
        # Release the loader's transients before READY, so nothing but the regions stays resident.
        del tensors
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def bind(self) -> None:
        """Listen under a temporary name, then rename into place: a socket that exists is ready to serve."""
        tmp = self.socket_dir / f".{os.getpid()}.tmp.sock"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(os.fspath(tmp))
        os.chmod(tmp, 0o600)
        listener.listen(64)
        os.rename(tmp, self.socket_path)
        self._bound_ino = os.lstat(self.socket_path).st_ino
        self._listener = listener

    def run(self) -> int:
        """prepare, bind, print READY, serve until SIGTERM/SIGINT or a stop request. Returns the exit code."""
        def stop(signum, frame):
            raise _Stop()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            self.prepare()
            self.bind()
            self._ready_s = time.monotonic() - self._started
            m = self.manifest
            # Straight to fd 2: a supervisor waits for this line, and no logging configuration may swallow it.
            os.write(2, (f"READY pid={os.getpid()} socket={self.socket_path} weight_bytes={m.weight_bytes} "
                         f"tensors={len(m.entries)} seconds={self._ready_s:.3f}\n").encode())
            self._accept_loop()
        except _Stop:
            pass
        finally:
            self.shutdown()
        return 0

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True,
                             name="weights-conn").start()

    def shutdown(self) -> None:
        """Unlink our socket (only if it is still the one we bound), close the listener. Idempotent."""
        if self._listener is not None:
            try:
                if os.lstat(self.socket_path).st_ino == self._bound_ino:
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            self._listener.close()
            self._listener = None

    # -------------------------------------------------------------------------------------------- serving
    def _serve_connection(self, conn: socket.socket) -> None:
        lease: int | None = None
        with self._mutex:
            self._connections += 1
            busy = self._connections > MAX_CONNECTIONS
        try:
            conn.settimeout(IO_TIMEOUT)
            peer_pid = P.check_peer_uid(conn)
            if busy:
                raise P.ProtocolError("busy", f"more than {MAX_CONNECTIONS} connections")
            msg, _ = P.recv_message(conn)
            if msg["type"] != "hello":
                raise P.ProtocolError("bad_message", "the first message must be hello")
            if msg.get("proto") != P.PROTO_VERSION:
                raise P.ProtocolError("proto_mismatch", f"daemon speaks protocol {P.PROTO_VERSION}, "
                                                        f"the peer {msg.get('proto')!r}")
            P.send_message(conn, self._hello())
            while True:
                msg, _ = P.recv_message(conn)
                kind = msg["type"]
                if kind == "attach":
                    lease = self._attach(conn, msg, peer_pid, lease)
                    if lease is not None:
                        conn.settimeout(None)      # the connection is now the lease; EOF ends it
                elif kind == "release":
                    self._drop_lease(lease)
                    lease = None
                    P.send_message(conn, {"type": "ok"})
                    conn.settimeout(IO_TIMEOUT)
                elif kind == "status":
                    P.send_message(conn, self.status())
                elif kind == "stop":
                    P.send_message(conn, {"type": "ok", "pid": os.getpid()})
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                elif kind == "bye":
                    return
                else:
                    raise P.ProtocolError("bad_message", f"unknown message type {kind!r}")
        except P.ProtocolError as e:
            if e.code != "eof":
                log.warning("connection error (%s): %s", e.code, e)
                _try_send(conn, P.error(e.code, str(e)))
        except OSError:
            pass                                   # timeout, reset: the peer is gone; nothing to clean but ours
        finally:
            self._drop_lease(lease)
            conn.close()
            with self._mutex:
                self._connections -= 1

    def _hello(self) -> dict:
        m = self.manifest
        assert m is not None
        return {**P.hello(self.role), "pid": os.getpid(), "key": self.key.to_dict(), "weight_bytes": m.weight_bytes,
                "manifest_digest": m.digest, "transport": "memfd" if self._fds else "cuda_ipc"}

    def _attach(self, conn: socket.socket, msg: dict, peer_pid: int, lease: int | None) -> int | None:
        """Validate the engine's key; on a match send the manifest with the regions (fds or IPC handles)."""
        if lease is not None:
            raise P.ProtocolError("bad_message", "this connection already holds a lease")
        try:
            theirs = CacheKey.from_dict(msg.get("key"))
        except ValueError as e:
            raise P.ProtocolError("bad_message", f"attach: {e}") from None
        mode = msg.get("mode")
        if mode not in ("zero_copy", "copy"):
            raise P.ProtocolError("bad_message", f"attach: mode {mode!r} is not zero_copy or copy")
        fields = self.key.mismatched_fields(theirs)
        if fields:
            P.send_message(conn, {"type": "mismatch", "fields": fields, "key": self.key.to_dict()})
            return None
        assert self.manifest is not None
        with self._mutex:
            self._deliveries += 1
            lease = self._deliveries
            self._leases[lease] = {"pid": peer_pid, "mode": mode, "since": time.time()}
        reply = {"type": "manifest", "lease": lease, "manifest": self.manifest.to_dict(),
                 "transport": "memfd" if self._fds else "cuda_ipc",
                 "cuda": [T.export_cuda(r) for r in self._cuda_regions] or None}
        P.send_message(conn, reply, fds=self._fds or None)
        return lease

    def _drop_lease(self, lease: int | None) -> None:
        if lease is not None:
            with self._mutex:
                self._leases.pop(lease, None)

    def status(self) -> dict:
        m = self.manifest
        assert m is not None
        with self._mutex:
            leases = [{"lease": k, **v} for k, v in sorted(self._leases.items())]
            return {"type": "status", "pid": os.getpid(), "socket": os.fspath(self.socket_path),
                    "model_dir": os.fspath(self.model_dir), "key": self.key.to_dict(),
                    "manifest_digest": m.digest, "weight_bytes": m.weight_bytes,
                    "region_bytes": sum(m.region_sizes), "tensors": len(m.entries),
                    "transport": "memfd" if self._fds else "cuda_ipc", "connections": self._connections - 1,
                    "leases": leases, "deliveries": self._deliveries,
                    "uptime_s": round(time.monotonic() - self._started, 3), "ready_s": round(self._ready_s, 3)}


def _try_send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.settimeout(1.0)
        P.send_message(conn, msg)
    except (OSError, P.ProtocolError):
        pass
