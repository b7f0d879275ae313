"""The daemon's wire protocol and where its sockets live.

Framing: a 4-byte big-endian length, then one msgpack map with a str "type". Lengths above MAX_MESSAGE are refused
before a byte of the body is read, and nothing is ever unpickled: a peer's bytes are only ever parsed as msgpack
(no extension types, str map keys). File descriptors travel as SCM_RIGHTS ancillary data on the first byte of the
frame that needs them. Every connection starts with a versioned hello; both sides check the peer's uid with
SO_PEERCRED.

Sockets: `<dir>/<device>-<role>.sock` in a per-user 0700 directory ($XDG_RUNTIME_DIR/warmstart, else
/tmp/warmstart-<uid>); the daemon holds an flock on `<socket>.lock` for its whole life."""
from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

import msgpack

from warmstart.errors import UserError

PROTO_VERSION = 1
MAX_MESSAGE = 16 * 2**20          # a 10k-tensor manifest is ~2 MiB; anything near this cap is not ours
MAX_FDS = 64                       # regions per daemon; the daemon packs a model into a handful
SUN_PATH_MAX = 107                 # Linux sun_path is 108 bytes including the terminating NUL
ROLES = ("target", "draft")
_HEADER = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")    # struct ucred: pid, uid, gid


class ProtocolError(Exception):
    """The peer broke the protocol (bad frame, oversized, not msgpack, wrong schema, wrong uid)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------------ framing
def encode(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise ProtocolError("too_large", f"message of {len(body)} bytes exceeds the {MAX_MESSAGE}-byte cap")
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    """Send one frame; fds (if any) ride on its first byte as SCM_RIGHTS."""
    data = encode(msg)
    if fds:
        sent = socket.send_fds(sock, [data[:1]], fds)
        if sent != 1:
            raise ProtocolError("io", "could not send the descriptor frame")
        data = data[1:]
    sock.sendall(data)


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """Receive one frame. With max_fds > 0 the header is read with recvmsg so that descriptors sent with it are
    received (and returned, owned by the caller); otherwise the kernel discards any descriptors a peer sends."""
    fds: list[int] = []
    if max_fds:
        first, fds, flags, _ = socket.recv_fds(sock, 1, max_fds)
        if not first:
            _close_all(fds)
            raise ProtocolError("eof", "the peer closed the connection")
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise ProtocolError("bad_fds", "descriptor data was truncated")
        header = first + _recv_exact(sock, _HEADER.size - 1)
    else:
        header = _recv_exact(sock, _HEADER.size, eof_ok=True)
    try:
        (n,) = _HEADER.unpack(header)
        if n > MAX_MESSAGE:
            raise ProtocolError("too_large", f"peer announced a {n}-byte message; the cap is {MAX_MESSAGE}")
        return decode(_recv_exact(sock, n)), fds
    except BaseException:
        _close_all(fds)
        raise


def decode(body: bytes) -> dict:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("bad_message", f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("bad_message", "a message must be a map with a string 'type'")
    return msg


def _no_ext(code: int, data: bytes):
    raise ProtocolError("bad_message", "msgpack extension types are not accepted")


def _recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("eof", "the peer closed the connection" if got == 0 and eof_ok else
                                "the peer closed the connection mid-message")
        got += k
    return bytes(buf)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def hello(role: str | None = None) -> dict:
    import warmstart
    return {"type": "hello", "proto": PROTO_VERSION, "warmstart": warmstart.__version__, "role": role}


def error(code: str, message: str) -> dict:
    return {"type": "error", "code": code, "message": message}


# ------------------------------------------------------------------------------------------------ identity
def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it at connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)


def check_peer_uid(sock: socket.socket, uid: int | None = None) -> int:
    """The peer's pid, if it runs as `uid` (default: ours); ProtocolError otherwise. Fails closed."""
    want = os.getuid() if uid is None else uid
    try:
        pid, peer_uid, _ = peer_credentials(sock)
    except OSError as e:
        raise ProtocolError("peer_uid", f"cannot read the peer's credentials ({e})") from None
    if peer_uid != want:
        raise ProtocolError("peer_uid", f"peer runs as uid {peer_uid}, not {want}")
    return pid


# ------------------------------------------------------------------------------------------------ paths
def default_socket_dir() -> Path:
    """Per-user runtime dir: $XDG_RUNTIME_DIR/warmstart (tmpfs, private), else /tmp/warmstart-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "warmstart" if xdg else Path(f"/tmp/warmstart-{os.getuid()}")


def ensure_socket_dir(path: Path | None) -> Path:
    """Create (mode 0700) or verify the daemon's socket dir: a real directory, owned by us, private."""
    path = Path(path) if path is not None else default_socket_dir()
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    problem = socket_dir_problem(path)
    if problem:
        raise UserError(f"The weight socket directory {path} {problem}. Remove it, or pass --socket-dir with a "
                        "directory you own.")
    if stat.S_IMODE(os.lstat(path).st_mode) & 0o077:
        os.chmod(path, 0o700)   # ours but too open (e.g. created by hand): tighten rather than refuse
    return path


def socket_dir_problem(path: Path) -> str | None:
    """None if path is a directory we own and not a symlink; else what is wrong with it."""
    return _ownership_problem(path, stat.S_ISDIR, "a directory", "does not exist")


def socket_path(socket_dir: Path, device_id: str, role: str, rank: int = 0, world_size: int = 1) -> Path:
    """The one socket for this device and role (and tensor-parallel rank); UserError if it would not fit in
    sun_path."""
    if role not in ROLES:
        raise UserError(f"--role {role!r} is not one of {', '.join(ROLES)}.")
    path = rank_socket(Path(os.path.abspath(socket_dir)) / f"{device_id}-{role}.sock", rank, world_size)
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise UserError(f"The weight socket path {path} is longer than {SUN_PATH_MAX} bytes, the Unix socket "
                        "limit. Pass a shorter --socket-dir (or set XDG_RUNTIME_DIR to a short directory).")
    return path


def rank_socket(path: Path, rank: int, world_size: int) -> Path:
    """Under tensor parallelism each rank's shard has its own socket: `<name>.tp<N>r<rank>.sock`."""
    if world_size == 1:
        return Path(path)
    path = Path(path)
    return path.with_name(f"{path.name.removesuffix('.sock')}.tp{world_size}r{rank}.sock")


def socket_problem(path: Path) -> str | None:
    """Before connecting: None if path is a socket owned by us and not a symlink; else what is wrong with it."""
    return _ownership_problem(path, stat.S_ISSOCK, "a socket", "absent")


def _ownership_problem(path: Path, is_kind, kind: str, absent: str) -> str | None:
    # lstat, never stat: a symlink planted in a shared directory must not redirect us to someone else's file.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return absent
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not is_kind(st.st_mode):
        return f"is not {kind}"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not {os.getuid()}"
    return None


def connect(path: Path, timeout: float) -> socket.socket:
    """A connected socket with `timeout` on connect and every later read/write. OSError as the kernel says."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    return sock

