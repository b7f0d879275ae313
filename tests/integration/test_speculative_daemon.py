"""Speculative decoding's two weight roles with real daemons: (target, draft) x (daemon, disk), and both partial
fallbacks (one role's daemon serves another dtype, so that role falls back to disk after its hello was charged).
Every boot has the same KV bytes and blocks and the same tokens; charges are per (socket, role), and a fallback
removes exactly its own role's charge."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.test_weight_daemon import Daemon, generate, short_dir
from warmstart.weights.loader import load_tensors, weights_nbytes


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec-daemon")
    return write_checkpoint(tmp / "target", "llama", layers=2), \
        write_checkpoint(tmp / "draft", "llama", layers=1, hidden=64, seed=7)


def test_role_combinations_and_partial_fallbacks(ckpts, tmp_path):
    import torch
    target, draft = ckpts
    dirs = [short_dir() for _ in range(4)]
    good_t = Daemon(target, dirs[0], "--dtype", "float32")
    good_d = Daemon(draft, dirs[1], "--dtype", "float32", "--role", "draft")
    bad_t = Daemon(target, dirs[2], "--dtype", "bfloat16")
    bad_d = Daemon(draft, dirs[3], "--dtype", "bfloat16", "--role", "draft")
    daemons = [good_t, good_d, bad_t, bad_d]
    try:
        for d in daemons:
            d.wait_ready()
        t, d, tb, db = (str(x.socket) for x in daemons)
        none = str(dirs[0] / "absent.sock")
        spec = ["--speculative-model", str(draft), "--num-speculative-tokens", "3"]
        runs = {
            "disk+disk": ["--load-format", "disk"],
            "daemon+daemon": ["--load-format", "daemon", "--weight-socket", t, "--draft-weight-socket", d],
            "daemon+disk": ["--load-format", "auto", "--weight-socket", t, "--draft-weight-socket", none],
            "disk+daemon": ["--load-format", "auto", "--weight-socket", none, "--draft-weight-socket", d],
            "daemon+fallback": ["--load-format", "daemon", "--weight-socket", t, "--draft-weight-socket", db],
            "fallback+daemon": ["--load-format", "daemon", "--weight-socket", tb, "--draft-weight-socket", d],
        }
        reports = {}
        for group in (list(runs)[:3], list(runs)[3:]):          # three at a time: the host has few cores
            procs = {n: generate(target, tmp_path / f"{n}.json", *spec, *runs[n]) for n in group}
            for name, p in procs.items():
                _, err = p.communicate(timeout=300)
                assert p.returncode == 0, f"{name}: {err}"
                reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    finally:
        for x in daemons:
            x.stop()
        for x in dirs:
            shutil.rmtree(x, ignore_errors=True)
    wt = weights_nbytes(load_tensors(target, torch.float32, progress=False))
    wd = weights_nbytes(load_tensors(draft, torch.float32, progress=False))
    base = reports["disk+disk"]
    for name, r in reports.items():
        m = r["memory"]
        assert (m["kv_cache_bytes"], m["num_kv_blocks"], m["draft_kv_cache_bytes"]) == \
            (base["memory"]["kv_cache_bytes"], base["memory"]["num_kv_blocks"],
             base["memory"]["draft_kv_cache_bytes"]), name
        assert m["weights_bytes"] + m["external_weights_bytes"] == wt + wd, name
        assert m["draft_weights_bytes"] == wd, name
        assert r["outputs"] == base["outputs"], name
    charges = {n: {(c["socket"], c["role"]): c["bytes"] for c in r["weights"]["charges"]} for n, r in reports.items()}
    assert charges["disk+disk"] == {}
    assert charges["daemon+daemon"] == {(t, "target"): wt, (d, "draft"): wd}
    assert charges["daemon+disk"] == {(t, "target"): wt}
    assert charges["disk+daemon"] == {(d, "draft"): wd}
    assert charges["daemon+fallback"] == {(t, "target"): wt}          # the draft's charge, and only it, removed
    assert charges["fallback+daemon"] == {(d, "draft"): wd}           # the target's charge, and only it, removed
    src = {n: (r["weights"]["source"], r["speculative"]["draft_weights"]["source"]) for n, r in reports.items()}
    assert src == {"disk+disk": ("disk", "disk"), "daemon+daemon": ("daemon-zero-copy", "daemon-zero-copy"),
                   "daemon+disk": ("daemon-zero-copy", "disk"), "disk+daemon": ("disk", "daemon-zero-copy"),
                   "daemon+fallback": ("daemon-zero-copy", "disk"), "fallback+daemon": ("disk", "daemon-zero-copy")}
    assert reports["daemon+fallback"]["speculative"]["draft_weights"]["fallback_reason"].startswith("key_mismatch")
    assert reports["fallback+daemon"]["weights"]["fallback_reason"].startswith("key_mismatch")
