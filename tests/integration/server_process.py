"""A real `python -m warmstart serve` subprocess on a free 127.0.0.1 port, for the server tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str | Path, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "warmstart", "serve", *map(str, args),
                                      "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=e, cwd=ROOT)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll /ready until 200; returns seconds waited. Fails with the log if the process dies or times out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics, e.g. metric("warmstart_kv_blocks_used")."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
        m = re.search(pattern, text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
