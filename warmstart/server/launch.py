"""`warmstart serve`: the HTTP server first, the engine behind a ready barrier.

Threads: the main thread runs uvicorn's event loop (HTTP, SSE, signals). A boot thread runs boot() so /health
answers from the first second; when it finishes it starts the engine thread (async_engine.py) and flips the app to
ready on the loop. A boot UserError prints one paragraph and exits 2. SIGTERM/SIGINT: uvicorn stops accepting,
in-flight requests get --shutdown-timeout seconds to finish, then the engine aborts the rest (their clients get
finish_reason "abort" and the end of the stream), the engine thread frees every block and stops, the most recently
used cached prefix blocks are saved for the next boot (--prefix-cache-persist), and the process exits 0."""
from __future__ import annotations

import argparse
import asyncio
import gc
import errno
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from warmstart.errors import UserError, user_error

log = logging.getLogger("warmstart.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def register_cli(subparsers) -> None:
    from warmstart.cli import add_engine_args, byte_size
    from warmstart.server.limits import DEFAULT_MAX_REQUEST_BYTES
    from warmstart.server.options import add_cli_args
    p = subparsers.add_parser("serve", help="boot and serve the OpenAI-compatible HTTP API",
                              description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                          "/v1/completions, /v1/models) plus /health, /ready, /startup, /metrics.")
    p.add_argument("model", nargs="?", default="default",
                   help="a Hugging Face model folder or a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    add_engine_args(p, model_required=False)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--served-model-name", default=None,
                   help=f"the model id clients send (default: the model folder's name, {DEFAULT_MODEL_NAME} for "
                        "the default model)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are aborted (default 10)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--max-request-bytes", type=byte_size, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="larger request bodies are refused with 413 before they are parsed "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES // 2**20}MiB)")
    add_cli_args(g)
    p.set_defaults(func=cmd_serve)


def served_model_name(model: str) -> str:
    if model in ("", "default"):
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.resolve().name or model)


class _Launch:
    """The boot thread and the engine it leaves behind, owned by the serve command."""

    def __init__(self, config, timer, state):
        self.config, self.timer, self.state = config, timer, state
        self.server = None                 # the uvicorn server, set once it exists
        self.engine = None
        self.booted = None
        self.exit_code = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def on_startup(self, loop: asyncio.AbstractEventLoop) -> None:
        self.boot_thread = threading.Thread(target=self._boot, args=(loop,), name="warmstart-boot", daemon=True)
        self.boot_thread.start()

    @property
    def booting(self) -> bool:
        thread = getattr(self, "boot_thread", None)
        return thread is not None and thread.is_alive()

    def _boot(self, loop: asyncio.AbstractEventLoop) -> None:
        from warmstart.boot import boot
        from warmstart.server.async_engine import AsyncEngine
        from warmstart.server.serving import ServingContext
        try:
            booted = boot(self.config, self.timer)
        except (UserError, OSError) as e:       # worded by errors.py, as the CLI's own commands are
            print(f"error: {user_error(e)}", file=sys.stderr, flush=True)
            self._fail(2)
            return
        except BaseException:
            log.exception("boot failed")
            self._fail(1)
            return
        with self._lock:
            if self.stopping.is_set():
                return
            self.engine = AsyncEngine(booted.engine, loop, on_step=self.state.metrics.on_step)
            self.booted = booted
        group = getattr(booted.runner, "group", None)
        if group is not None:                   # tensor parallel: a dead rank ends the server, non-zero
            group.on_failure.append(lambda message: loop.call_soon_threadsafe(self._rank_failed, message))
        parsers = self.state.options.parsers(booted.tokenizer.chat_template, booted.model_dir)
        serving = ServingContext(booted, self.engine, self.state.model_name, self.state.metrics, **parsers)
        loop.call_soon_threadsafe(self._ready, serving)

    def _ready(self, serving) -> None:
        self.state.set_ready(serving)
        host, port = self.server.config.host, self.server.config.port
        url_host = f"[{host}]" if ":" in host else host
        msg = (f"warmstart ready on http://{url_host}:{port} (model {self.state.model_name!r}, "
               f"startup {serving.booted.report.wall_seconds:.2f} s)")
        log.info("%s", msg)
        print(msg, flush=True)

    def _rank_failed(self, message: str) -> None:
        print(f"error: {message}; the server stops", file=sys.stderr, flush=True)
        self._fail(1)

    def _fail(self, code: int) -> None:
        self.exit_code = code
        self.server.should_exit = True

    def on_drain_timeout(self) -> None:
        """The grace period after SIGTERM is over: abort what is still running. Streams end with finish_reason
        "abort" and [DONE], so connections close normally instead of being cancelled."""
        with self._lock:
            engine = self.engine
        if engine is not None:
            log.info("shutdown: aborting the requests still in flight")
            engine.abort_all()

    def on_shutdown(self) -> None:
        with self._lock:
            self.stopping.set()
            engine = self.engine
        if engine is not None:
            if not engine.shutdown():
                log.warning("engine thread did not stop in time; the prefix cache is not saved")
                return
            log.info("engine stopped; KV blocks in use: %d", engine.engine.blocks.num_used)
            if self.booted.prefix is not None:
                self.booted.prefix.save(self.booted.runner, self.booted.engine.blocks)


def cmd_serve(args: argparse.Namespace) -> int:
    from warmstart.interrupts import exit_at_once_on_signals
    with exit_at_once_on_signals():                  # the web stack and torch import here (see interrupts.py)
        import uvicorn

        from warmstart.cli import config_from_args
        from warmstart.server.api import ServerState, create_app
        from warmstart.startup.steps import StepTimer

    # Until uvicorn installs its own handlers, SIGTERM means "stop now, cleanly": exit 0, as it does later.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    timer = StepTimer.from_process_start()
    from warmstart.server.options import ServerOptions
    config = config_from_args(args)
    state = ServerState(args.served_model_name or served_model_name(args.model),
                        options=ServerOptions.from_args(args))
    launch = _Launch(config, timer, state)
    app = create_app(state, on_startup=launch.on_startup, on_shutdown=launch.on_shutdown,
                     max_request_bytes=args.max_request_bytes)
    # uvicorn's own timeout (cancel the request tasks) is only the backstop for a handler that ignores the abort.
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on")
    # Bind before anything boots: a port in use is a one-paragraph UserError (exit 2) instead of uvicorn's log
    # line and exit 3 with a boot thread already running.
    sockets = listen_sockets(args.host, args.port)
    server = launch.server = _make_server(uv_config, args.shutdown_timeout, launch.on_drain_timeout)
    log.info("serving %s as %r on http://%s:%d; /health answers now, /ready once the engine has booted",
             args.model, state.model_name, args.host, args.port)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default handlers that would
    # turn a graceful SIGTERM into death by signal. These handlers make it a normal exit instead.
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if launch.booting:
        # Stopped (SIGTERM, Ctrl-C, a failed bind) while the boot thread is still inside torch: interpreter
        # teardown would race it (finalizers, C++ static destructors under a running thread: SIGABRT). Nothing
        # of the boot needs keeping (a plan is written atomically), so leave at once.
        log.info("stopped while booting; exiting without waiting for the boot")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(launch.exit_code)
    # Everything is released by now. Interpreter teardown would spend seconds garbage-collecting torch's and the
    # web stack's object graphs; frozen objects are skipped by those collections, so SIGTERM -> exit stays fast.
    gc.freeze()
    return launch.exit_code


def _port(text: str) -> int:
    import argparse
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return port


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address host resolves to, as uvicorn would make them."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host!r} is not an address this machine can listen on ({e}). Pass an IP address "
                        "such as 127.0.0.1 or 0.0.0.0, or a resolvable host name.") from None
    sockets, seen = [], set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as e:
        for sock in sockets:
            sock.close()
        hint = ("another process is using the port: stop it or pick another with --port"
                if e.errno == errno.EADDRINUSE else "check --host and --port")
        raise UserError(f"Cannot listen on {host}:{port}: {e.strerror or e}; {hint}.") from None
    return sockets


def _make_server(config, drain_timeout: float, on_drain_timeout):
    """uvicorn's Server plus a drain deadline: after SIGTERM, in-flight requests get drain_timeout seconds to finish,
    then on_drain_timeout aborts them. (uvicorn is imported here, not at module level: every CLI command imports
    this module to register `serve`.)"""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            asyncio.get_running_loop().call_later(drain_timeout, on_drain_timeout)
            await super().shutdown(sockets)

    return Server(config)


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(0)


def _note_signal(signum: int, frame) -> None:
    log.info("received %s after shutdown", signal.Signals(signum).name)
