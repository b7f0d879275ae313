"""`warmstart weights serve | status | stop`: run and inspect weight daemons."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from warmstart.errors import UserError


def cmd_serve(args: argparse.Namespace) -> int:
    if args.tensor_parallel_size > 1:
        return _serve_ranks(args)
    from warmstart.interrupts import exit_at_once_on_signals
    with exit_at_once_on_signals():                  # see interrupts.py
        import torch

    # The CLI is a composition root: it resolves the model and dtype with the boot's own functions, so that a
    # daemon started with the same flags as an engine computes the same cache key.
    from warmstart.boot import resolve_model_dir
    from warmstart.dtypes import quantized_load, resolve_dtype
    from warmstart.paths import warmstart_cache_dir
    from warmstart.startup.device import get_device
    from warmstart.weights.daemon import WeightDaemon
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else warmstart_cache_dir()
    model_dir = resolve_model_dir(args.model, cache_dir)
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = kind.partition(":")
    if kind not in ("cpu", "cuda"):
        raise UserError(f"--device {args.device!r} is not supported; use auto, cpu or cuda[:N].")
    device = get_device(kind, int(index or 0))
    from warmstart.models.spec import ModelSpec
    # resolved exactly as an engine's boot does, so the daemon's cache key names the dtype the engine asks for
    dtype = resolve_dtype(args.dtype, device.facts(), ModelSpec.from_dir(model_dir), cache_dir,
                          quantized=quantized_load(args.quantization, model_dir))
    daemon = WeightDaemon(model_dir, dtype, device.torch_device(), args.role,
                          Path(args.socket_dir) if args.socket_dir else None, rank=args.rank,
                          world_size=args.world_size, quantization=args.quantization)
    return daemon.run()


def _serve_ranks(args: argparse.Namespace) -> int:
    """`--tensor-parallel-size N`: one daemon per rank (`--rank r --world-size N`), each serving its shard on its
    own socket (`<device>-<role>.tp<N>r<r>.sock`). This process supervises them: SIGTERM/SIGINT is passed on; a daemon
    that is stopped (`weights stop`) leaves the others serving (that rank's engines fall back to disk), one that
    fails stops them all; it exits when they all have, with the first non-zero code."""
    import signal
    import subprocess
    import time
    n = args.tensor_parallel_size
    argv = [sys.executable, "-m", "warmstart", "weights", "serve", args.model, "--dtype", args.dtype,
            "--quantization", args.quantization, "--role", args.role, "--world-size", str(n)]
    for flag, value in (("--socket-dir", args.socket_dir), ("--cache-dir", args.cache_dir)):
        if value:
            argv += [flag, value]
    procs = []
    for r in range(n):
        device = args.device
        if device.startswith("cuda") and ":" not in device:
            device = f"cuda:{r}"
        procs.append(subprocess.Popen(argv + ["--rank", str(r), "--device", device]))
    stopping = []

    def forward(signum, frame):
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0) and not stopping:
                code = code or p.returncode
                print(f"weight daemon for rank {r} exited ({p.returncode}); stopping the others", file=sys.stderr)
                forward(signal.SIGTERM, None)
        time.sleep(0.2)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _sockets(args: argparse.Namespace) -> list[Path]:
    from warmstart.weights import protocol as P
    if args.socket:
        return [Path(os.path.abspath(args.socket))]
    d = Path(args.socket_dir) if args.socket_dir else P.default_socket_dir()
    return sorted(d.glob("*.sock")) if d.is_dir() else []


def cmd_status(args: argparse.Namespace) -> int:
    from warmstart.weights.client import AttachFailure, DaemonSession
    paths = _sockets(args)
    if not paths:
        print("no weight daemon sockets found", file=sys.stderr)
        return 1
    running = 0
    for path in paths:
        try:
            with DaemonSession(path) as s:
                s.open()
                status = s.request({"type": "status"})
            running += 1
            print(json.dumps(status, indent=None if args.json else 2, sort_keys=True))
        except AttachFailure as e:
            print(f"{path}: not serving ({e.reason})")
    return 0 if running else 1


def cmd_stop(args: argparse.Namespace) -> int:
    from warmstart.weights import protocol as P
    from warmstart.weights.client import AttachFailure, DaemonSession
    if args.socket:
        path = Path(os.path.abspath(args.socket))
    else:
        import torch

        from warmstart.weights.transport import device_id
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        socket_dir = Path(args.socket_dir) if args.socket_dir else P.default_socket_dir()
        path = P.socket_path(socket_dir, device_id(torch.device(device)), args.role)
    try:
        with DaemonSession(path) as s:
            s.open()
            reply = s.request({"type": "stop"})
    except AttachFailure as e:
        raise UserError(f"No weight daemon answers at {path} ({e.reason}). `warmstart weights status` lists "
                        "the sockets that do.") from None
    pid = reply.get("pid")
    deadline = time.monotonic() + args.timeout
    while os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.lexists(path):
        raise UserError(f"The weight daemon (PID {pid}) acknowledged stop but {path} is still there after "
                        f"{args.timeout:g} s. Send it SIGTERM (`kill {pid}`).")
    print(f"stopped weight daemon PID {pid} ({path})")
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("weights", help="the weight cache daemon: serve a model's weights to restarting engines",
                       description="Keep a model's post-processed weights resident in a daemon so that engines "
                                   "attach to them (zero-copy or copy) instead of loading the checkpoint.")
    wsub = p.add_subparsers(dest="weights_command", required=True, metavar="ACTION")

    s = wsub.add_parser("serve", help="load MODEL once and serve it until stopped (prints READY on stderr)")
    s.add_argument("model", help="a Hugging Face model folder, a .gguf file, or 'default'")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="served dtype; must equal the engines' (auto resolves exactly as the engine does)")
    s.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="served quantization; must equal the engines' --quantization (default auto)")
    s.add_argument("--role", default="target", choices=["target", "draft"], help="default: target")
    s.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: auto)")
    s.add_argument("--socket-dir", default=None,
                   help="directory for the socket (default $XDG_RUNTIME_DIR/warmstart or /tmp/warmstart-<uid>)")
    s.add_argument("--rank", type=int, default=0, help="parallel rank these weights are for (default 0)")
    s.add_argument("--world-size", type=int, default=1, help="parallel world size (default 1)")
    s.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="serve each of N tensor-parallel ranks' shards from its own daemon and socket (the same "
                        "cut as the engine's, quantized included); engines started with --tensor-parallel-size N "
                        "attach rank by rank")
    s.add_argument("--cache-dir", default=None, help="where .gguf imports are cached")
    s.set_defaults(func=cmd_serve)

    for name, func, text in (("status", cmd_status, "show running daemons (key, bytes, leases, uptime)"),
                             ("stop", cmd_stop, "stop a daemon; it removes its socket")):
        c = wsub.add_parser(name, help=text)
        c.add_argument("--socket", default=None, help="the daemon's socket (default: found in --socket-dir)")
        c.add_argument("--socket-dir", default=None, help="where to look (default: the per-user socket dir)")
        if name == "stop":
            c.add_argument("--role", default="target", choices=["target", "draft"])
            c.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
            c.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the socket to go")
        else:
            c.add_argument("--json", action="store_true", help="one JSON object per line")
        c.set_defaults(func=func)
