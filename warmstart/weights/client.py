"""The engine's side of the weight daemon: find the socket, handshake, validate, map or copy, and say why not.

Every way an attach can fail raises AttachFailure with a reason code (daemon_absent, socket_untrusted,
daemon_unreachable, peer_uid, protocol_version, protocol_error, key_mismatch, manifest_invalid, ipc_error,
digest_mismatch); source.py decides between a disk fallback and a UserError. Nothing here touches the memory ledger: the caller
charges the bytes the daemon reports in its hello, before any mapping.

Liveness: memfd mappings outlive the daemon, so a CPU engine needs no watchdog. Legacy CUDA IPC mappings do not:
when the exporter dies its allocations are freed under us, so DaemonWatchdog (pidfd on the daemon's PID, taken from
SO_PEERCRED, started before any handle is opened) fail-stops the engine instead of letting it read freed memory."""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from warmstart.weights import protocol as P
from warmstart.weights import transport as T
from warmstart.weights.manifest import CacheKey, Manifest

log = logging.getLogger("warmstart.weights")

CONNECT_TIMEOUT = 2.0        # a hung daemon delays a boot by at most this, then the boot falls back
IO_TIMEOUT = 5.0
EXIT_DAEMON_LOST = 75        # exit status of an engine whose CUDA weights died with their daemon
_LIVE: list[object] = []     # zero-copy sessions and watchdogs: they must live as long as the process


class AttachFailure(Exception):
    """Why the daemon's weights cannot be used. `code` is the machine-readable reason."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail

    @property
    def reason(self) -> str:
        return f"{self.code}: {self.detail}"


@dataclass(frozen=True)
class Hello:
    pid: int                 # from SO_PEERCRED, not from the message
    key: CacheKey
    weight_bytes: int
    manifest_digest: str
    transport: str


@dataclass
class Attached:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    lease: int
    mode: str


def resolve_socket(explicit: str | None, device: torch.device, role: str, rank: int = 0,
                   world_size: int = 1) -> Path:
    """--weight-socket as given, else `<default socket dir>/<device>-<role>.sock`; under tensor parallelism, the
    rank's own socket next to it (protocol.rank_socket)."""
    if explicit:
        return P.rank_socket(Path(os.path.abspath(os.path.expanduser(explicit))), rank, world_size)
    return P.socket_path(P.default_socket_dir(), T.device_id(device), role, rank, world_size)


class DaemonSession:
    """One connection to one daemon. Use as a context manager; a zero-copy attach hands the connection to the
    process (the daemon reads its EOF as the end of our lease), so closing it afterwards is a no-op."""

    def __init__(self, path: Path, connect_timeout: float = CONNECT_TIMEOUT, io_timeout: float = IO_TIMEOUT):
        self.path, self.connect_timeout, self.io_timeout = Path(path), connect_timeout, io_timeout
        self.sock: socket.socket | None = None
        self.hello: Hello | None = None
        self._kept = False

    def __enter__(self) -> "DaemonSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None and not self._kept:
            self.sock.close()
            self.sock = None

    def open(self) -> Hello:
        """Connect, check the daemon's uid, exchange versioned hellos."""
        # The socket itself must be ours and not a symlink; SO_PEERCRED then checks who listens behind it. The
        # directory is the daemon's to secure (0700); an explicit --weight-socket may live anywhere we can reach.
        problem = P.socket_problem(self.path)
        if problem == "absent":
            raise AttachFailure("daemon_absent", f"no socket at {self.path}")
        if problem:
            raise AttachFailure("socket_untrusted", f"{self.path} {problem}")
        try:
            self.sock = P.connect(self.path, self.connect_timeout)
        except OSError as e:
            code = "daemon_absent" if isinstance(e, FileNotFoundError) else "daemon_unreachable"
            raise AttachFailure(code, f"cannot connect to {self.path} ({e.strerror or e})") from None
        self.sock.settimeout(self.io_timeout)
        try:
            pid = P.check_peer_uid(self.sock)
        except P.ProtocolError as e:
            raise AttachFailure("peer_uid", str(e)) from None
        reply = self._request(P.hello())
        if reply.get("type") == "error" and reply.get("code") == "proto_mismatch":
            raise AttachFailure("protocol_version", str(reply.get("message")))
        if reply.get("type") != "hello" or reply.get("proto") != P.PROTO_VERSION:
            raise AttachFailure("protocol_version", f"daemon answered {reply.get('type')!r} with protocol "
                                                    f"{reply.get('proto')!r}; this engine speaks "
                                                    f"{P.PROTO_VERSION}")
        try:
            key = CacheKey.from_dict(reply.get("key"))
            wb, digest, transport = reply["weight_bytes"], reply["manifest_digest"], reply["transport"]
            if type(wb) is not int or wb < 0 or not isinstance(digest, str) or \
                    transport not in ("memfd", "cuda_ipc"):
                raise ValueError("bad field types")
        except (KeyError, ValueError) as e:
            raise AttachFailure("protocol_error", f"malformed hello from the daemon ({e})") from None
        self.hello = Hello(pid, key, wb, digest, transport)
        return self.hello

    def request(self, msg: dict) -> dict:
        """One request/reply on an open session (status, stop)."""
        return self._request(msg)

    def _request(self, msg: dict, max_fds: int = 0) -> dict:
        reply, fds = self._exchange(msg, max_fds)
        P._close_all(fds)
        return reply

    def _exchange(self, msg: dict, max_fds: int = 0) -> tuple[dict, list[int]]:
        assert self.sock is not None
        try:
            P.send_message(self.sock, msg)
            return P.recv_message(self.sock, max_fds)
        except P.ProtocolError as e:
            raise AttachFailure("protocol_error", f"{e.code}: {e}") from None
        except OSError as e:
            raise AttachFailure("protocol_error", f"connection to {self.path} failed mid-exchange ({e})") from None

    def attach(self, key: CacheKey, mode: str, device: torch.device, verify: bool = False) -> Attached:
        """Ask for the weights under `key`; map them (zero_copy) or copy them and release the lease (copy)."""
        assert self.hello is not None
        reply, fds = self._exchange({"type": "attach", "key": key.to_dict(), "mode": mode}, P.MAX_FDS)
        watchdog = None
        try:
            try:
                if reply.get("type") == "mismatch":
                    fields = [str(f) for f in reply.get("fields") or []]
                    theirs = reply.get("key") if isinstance(reply.get("key"), dict) else {}
                    detail = ", ".join(f"{f} (daemon {theirs.get(f)!r}, engine {getattr(key, f, None)!r})"
                                       for f in fields)
                    raise AttachFailure("key_mismatch", detail or "unspecified")
                if reply.get("type") == "error":
                    raise AttachFailure("protocol_error",
                                        f"daemon error {reply.get('code')}: {reply.get('message')}")
                manifest, lease = self._check_manifest(reply, key, fds, device)
                if device.type == "cuda":
                    # Watch the exporter before opening a handle: from then on its death frees our weights.
                    watchdog = DaemonWatchdog(self.hello.pid, self.path)
                tensors = self._map(reply, manifest, fds, device)
            finally:
                P._close_all(fds)   # the mappings (or IPC storages) hold the memory; the descriptors are spare
            if verify:
                bad = T.verify_digests(tensors, manifest.entries)
                if bad:
                    raise AttachFailure("digest_mismatch", f"{len(bad)} tensor(s) differ from their digest, "
                                                           f"first {bad[0]}")
            if mode == "copy":
                tensors = {name: t.clone() for name, t in tensors.items()}
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.release()
        except BaseException:
            if watchdog is not None:
                watchdog.stop()           # we will not use the daemon's memory: its exit no longer concerns us
            raise
        if mode == "copy":
            if watchdog is not None:
                watchdog.stop()           # our copy is private: the daemon may now exit without harm
        else:
            self._kept = True
            _LIVE.extend(x for x in (self.sock, watchdog) if x is not None)
        return Attached(tensors, manifest, lease, mode)

    def detach(self) -> None:
        """End a zero-copy lease early (tools and benchmarks that attach repeatedly). On CPU the mapped tensors stay
        valid after this; on CUDA the daemon may now exit and free them, so engines never call it."""
        if self._kept and self.sock is not None:
            _LIVE[:] = [x for x in _LIVE if x is not self.sock]
            self._kept = False
            self.close()

    def release(self) -> None:
        """End our lease: the daemon no longer holds these bytes on our behalf."""
        reply = self._request({"type": "release"})
        if reply.get("type") != "ok":
            raise AttachFailure("protocol_error", f"release was answered with {reply.get('type')!r}")

    def _check_manifest(self, reply: dict, key: CacheKey, fds: list[int],
                        device: torch.device) -> tuple[Manifest, int]:
        assert self.hello is not None
        if reply.get("type") != "manifest" or type(reply.get("lease")) is not int:
            raise AttachFailure("protocol_error", f"unexpected reply {reply.get('type')!r} to attach")
        try:
            manifest = Manifest.from_dict(reply.get("manifest"))
        except ValueError as e:
            raise AttachFailure("manifest_invalid", str(e)) from None
        if manifest.key != key or manifest.digest != self.hello.manifest_digest or \
                manifest.weight_bytes != self.hello.weight_bytes:
            raise AttachFailure("manifest_invalid", "the manifest disagrees with the key or the hello "
                                                    "(digest or byte count)")
        want = "memfd" if device.type == "cpu" else "cuda_ipc"
        if reply.get("transport") != want or self.hello.transport != want:
            raise AttachFailure("manifest_invalid", f"daemon serves over {reply.get('transport')!r}, a "
                                                    f"{device.type} engine needs {want}")
        if want == "memfd":
            if len(fds) != len(manifest.region_sizes):
                raise AttachFailure("manifest_invalid", f"{len(fds)} descriptors for "
                                                        f"{len(manifest.region_sizes)} regions")
            for fd, size in zip(fds, manifest.region_sizes):
                problem = T.check_sealed(fd, size)
                if problem:
                    raise AttachFailure("manifest_invalid", f"a region {problem}")
        elif not isinstance(reply.get("cuda"), list) or len(reply["cuda"]) != len(manifest.region_sizes):
            raise AttachFailure("manifest_invalid", "CUDA handles do not match the regions")
        return manifest, reply["lease"]

    def _map(self, reply: dict, manifest: Manifest, fds: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        try:
            if device.type == "cpu":
                bases = [T.region_tensor(T.map_readonly(fd, size))
                         for fd, size in zip(fds, manifest.region_sizes)]
            else:
                if not all(isinstance(f, dict) for f in reply["cuda"]):
                    raise AttachFailure("manifest_invalid", "malformed CUDA handle")
                bases = [T.import_cuda(f, device.index or 0, size)
                         for f, size in zip(reply["cuda"], manifest.region_sizes)]
            return T.view_entries(bases, manifest.entries)
        except (OSError, RuntimeError, KeyError, TypeError) as e:
            raise AttachFailure("ipc_error", f"cannot map the daemon's regions ({e})") from None


class DaemonWatchdog:
    """Fail-stop the engine when the daemon that exported its CUDA weights exits.

    A pidfd becomes readable when its process exits (zombies included: no reaping needed), and cannot be fooled by
    PID reuse once opened. We open it while the daemon's socket is connected, so the PID is still the daemon's.
    Where pidfd_open is missing (Linux < 5.3) we poll /proc/<pid>/stat for the start time and zombie state."""

    POLL_S = 0.1

    def __init__(self, pid: int, socket_path: Path):
        self.pid, self.socket_path = pid, socket_path
        self._stopped = threading.Event()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._start = _start_ticks(pid)
        threading.Thread(target=self._run, daemon=True, name="weights-watchdog").start()

    def _run(self) -> None:
        if self._pidfd is not None:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            try:
                while not poller.poll(1000):
                    if self._stopped.is_set():
                        return
            finally:
                os.close(self._pidfd)
        else:
            while _start_ticks(self.pid) == self._start:
                if self._stopped.wait(self.POLL_S):
                    return
        if not self._stopped.is_set():
            self.fail_stop()

    def stop(self) -> None:
        """Stop watching (the weights no longer live in the daemon's memory)."""
        self._stopped.set()

    def fail_stop(self) -> None:
        os.write(2, (f"FATAL: the weight daemon (PID {self.pid}, {self.socket_path}) exited. This engine's "
                     "weights were mapped from its GPU memory over CUDA IPC and are now freed; stopping now "
                     "rather than computing with freed memory. Restart the daemon and then the engine, or boot "
                     "with --weight-mode copy to keep a private copy.\n").encode())
        os._exit(EXIT_DAEMON_LOST)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks, or None if it is gone or a zombie (dead for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if rest[0] in ("Z", "X") else int(rest[19])
