"""Issue 9 item 8: every user error is one paragraph and exit 2, never a traceback, through the real CLI
(`python -m warmstart ...`). One case per member of each class: unusable model files, bad numbers and strings on
the command line, and OS errors the environment causes."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GEN = ["--prompt", "hi", "--max-tokens", "1", "--kv-cache-memory", "4MiB", "--startup-plan", "off"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "tiny", "llama", layers=1)


def warmstart(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmstart", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_user_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]                 # one paragraph
    for n in needles:
        assert n in errors[0], errors[0]


def _edit_json(name, fn):
    def edit(d: Path) -> None:
        p = d / name
        p.write_text(fn(json.loads(p.read_text())) if callable(fn) else fn)
    return edit


def _absurd_header(d: Path) -> None:
    f = next(d.glob("*.safetensors"))
    with open(f, "r+b") as fh:
        fh.write(struct.pack("<Q", 2**62))


BROKEN = {
    "config-is-a-list": (_edit_json("config.json", "[1, 2, 3]"), "config.json"),
    "config-missing-key": (_edit_json("config.json", lambda c: json.dumps({k: v for k, v in c.items()
                                                                           if k != "hidden_size"})), "hidden_size"),
    "config-wrong-type": (_edit_json("config.json", lambda c: json.dumps({**c, "num_hidden_layers": "2"})),
                          "num_layers"),
    "config-zero-heads": (_edit_json("config.json", lambda c: json.dumps({**c, "num_attention_heads": 0})),
                          "config.json"),
    "generation-config-corrupt": (_edit_json("generation_config.json", "{not json"), "generation_config.json"),
    "generation-config-a-list": (_edit_json("generation_config.json", "[]"), "generation_config.json"),
    "tokenizer-config-corrupt": (_edit_json("tokenizer_config.json", "{\"chat_template\": "),
                                 "tokenizer_config.json"),
    "tokenizer-config-wrong-type": (_edit_json("tokenizer_config.json", '{"chat_template": 5}'), "chat_template"),
    "safetensors-absurd-header": (_absurd_header, "header"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_unusable_model_files_are_one_paragraph(pristine, tmp_path, case):
    damage, needle = BROKEN[case]
    model = tmp_path / "model"
    shutil.copytree(pristine, model)
    damage(model)
    assert_user_error(warmstart("generate", model, *GEN, "--cache-dir", tmp_path / "c"), needle)


@pytest.mark.parametrize("flags,needle", [
    (["--seed", str(2**70)], "--seed"), (["--seed-request", str(2**70)], "seed"),
    (["--device", "cuda:abc"], "--device"), (["--device", "tpu"], "--device"),
    (["--device", "cuda:7"], "cuda:7"), (["--kv-cache-memory", "100TiB"], "--kv-cache-memory"),
    (["--top-k", str(2**63)], "top_k"),
])
def test_out_of_range_flags_are_one_paragraph(pristine, tmp_path, flags, needle):
    args = [a for a in GEN if a not in ("--kv-cache-memory", "4MiB")] if "--kv-cache-memory" in flags else GEN
    assert_user_error(warmstart("generate", pristine, *args, *flags, "--cache-dir", tmp_path / "c"), needle)


def test_unwritable_cache_dir_when_the_default_model_needs_importing(tmp_path):
    if os.getuid() == 0:
        cache = Path("/sys/warmstart-test-cache")          # root ignores modes; sysfs refuses new folders
    else:
        cache = tmp_path / "ro"
        cache.mkdir(mode=0o500)
    assert_user_error(warmstart("generate", "default", *GEN, "--cache-dir", cache), str(cache))


def test_planted_symlink_at_the_daemon_lock_is_one_paragraph(pristine, tmp_path):
    sockets = tmp_path / "s"
    sockets.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("do not truncate me")
    (sockets / "cpu-target.sock.lock").symlink_to(victim)
    r = warmstart("weights", "serve", pristine, "--device", "cpu", "--socket-dir", sockets)
    assert_user_error(r, "cpu-target.sock.lock", "symbolic link")
    assert victim.read_text() == "do not truncate me"
