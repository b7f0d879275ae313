"""Thread count and OpenMP wait policy (threads.py), and the CPU dtype choice (runner/dtype_probe.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmstart.runner import dtype_probe

ROOT = Path(__file__).resolve().parents[2]


def run_py(code: str, env: dict | None = None, affinity: set[int] | None = None) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    e.update({"PYTHONPATH": str(ROOT), **(env or {})})
    pre = (lambda: os.sched_setaffinity(0, affinity)) if affinity else None
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, preexec_fn=pre,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


PROBE = ("import json; from warmstart import threads; s = threads.configure(); import torch; "
         "print(json.dumps([s.to_dict(), torch.get_num_threads(), __import__('os').environ.get('OMP_WAIT_POLICY')]))")


def test_default_threads_follow_the_affinity_mask_and_wait_passively():
    settings, torch_threads, env_policy = json.loads(run_py(PROBE, affinity={0}))
    assert settings["available_cpus"] == 1 and settings["threads"] == 1 and torch_threads == 1
    assert settings["wait_policy"] == "PASSIVE" == env_policy and settings["policy_source"] == "warmstart default"
    assert settings["spin_count"] == "0"               # OpenMP workers sleep at once: the kernels' pool spins
    assert settings["kernel_pool"] is True


def test_the_users_environment_wins():
    settings, torch_threads, env_policy = json.loads(run_py(PROBE, env={"OMP_WAIT_POLICY": "active",
                                                                        "OMP_NUM_THREADS": "1"}))
    assert settings["wait_policy"] == "ACTIVE" and settings["policy_source"] == "environment"
    assert settings["spin_count"] is None             # the user's policy: libgomp's own spin for it
    assert settings["threads"] == torch_threads == 1
    settings, _, _ = json.loads(run_py(PROBE, env={"GOMP_SPINCOUNT": "100000", "WARMSTART_THREAD_POOL": "0"}))
    assert settings["wait_policy"] == "PASSIVE" and settings["spin_count"] == "100000"
    assert settings["kernel_pool"] is False           # the kernels' loops back on the OpenMP team


def test_importing_the_offline_api_sets_the_policy_before_torch():
    code = "import warmstart.llm, os, json; print(json.dumps(os.environ.get('OMP_WAIT_POLICY')))"
    assert json.loads(run_py(code)) == "PASSIVE"


def test_torch_loaded_first_is_reported_not_hidden():
    code = ("import torch, json; from warmstart import threads; s = threads.configure(1); "
            "print(json.dumps(s.to_dict()))")
    settings = json.loads(run_py(code))
    assert settings["policy_source"] == "set after torch loaded (no effect)" and settings["threads"] == 1


def test_pinning_needs_one_thread_per_cpu_and_yields_to_the_users_placement():
    settings, _, _ = json.loads(run_py(PROBE, affinity={0}))
    assert settings["pin_cpus"] is None and settings["pinning"] == "off (one thread)"
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    settings, _, _ = json.loads(run_py(PROBE, affinity=set(cpus)))
    assert settings["pin_cpus"] == cpus and settings["pinning"] == "one thread per CPU"
    settings, _, _ = json.loads(run_py(PROBE, env={"OMP_NUM_THREADS": "1"}, affinity=set(cpus)))
    assert settings["pin_cpus"] is None
    settings, _, _ = json.loads(run_py(PROBE, env={"WARMSTART_PIN_THREADS": "0"}, affinity=set(cpus)))
    assert settings["pin_cpus"] is None and settings["pinning"] == "off (WARMSTART_PIN_THREADS=0)"
    settings, _, _ = json.loads(run_py(PROBE, env={"OMP_PLACES": "cores"}, affinity=set(cpus)))
    assert settings["pin_cpus"] is None and "OMP_PLACES" in settings["pinning"]


# a process's thread masks (Cpus_allowed_list per task) around a StepPinning of its configured threads
PINNING = """
import json, os, threading, time
from warmstart import threads
s = threads.configure()
import torch
from warmstart import kernels
from warmstart.runner.affinity import StepPinning
def masks():
    out = {}
    for t in os.listdir('/proc/self/task'):
        line = [l for l in open(f'/proc/self/task/{t}/status') if l.startswith('Cpus_allowed_list')][0]
        out[int(t)] = line.split()[-1]
    return out
a = torch.randn(512, 512)
pin = StepPinning(s.pin_cpus)
"""

STEP = PINNING + """
with pin():
    inside = sorted(os.sched_getaffinity(0)); a @ a
    during = masks()
after = sorted(os.sched_getaffinity(0))
print(json.dumps([s.pin_cpus, inside, after, during, threading.get_native_id()]))
"""


def test_a_step_runs_one_thread_per_cpu_and_the_caller_gets_its_mask_back():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pin_cpus, inside, after, during, me = json.loads(run_py(STEP, affinity=set(cpus)))
    assert pin_cpus == cpus
    assert inside == [cpus[0]] and after == cpus         # the caller: pinned for the step only
    assert during[str(me)] == str(cpus[0])
    # the OpenMP worker that ran half of the matmul is pinned to the other CPU
    assert str(cpus[1]) in during.values()


SPREAD = PINNING + """
seen = []
for spread in (False, True, False):
    pin.spread(spread)
    with pin():
        inside = sorted(os.sched_getaffinity(0)); a @ a
        kernels.silu_mul(torch.randn(64, 4096))  # a loop on the kernels' pool: its worker takes its new mask
        time.sleep(0.1)                          # when it wakes for it
        seen.append([inside, masks()])
print(json.dumps([s.pin_cpus, threading.get_native_id(), seen]))
"""


def test_a_busy_host_unpins_the_team_and_a_quiet_one_pins_it_again():
    """StepPinning.spread(True) (runner/step_threads.py says it when the host turns busy): the stepping thread keeps
    its mask during steps and every worker may run on any of the CPUs; spread(False) pins them one per CPU again."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    both = f"{cpus[0]}-{cpus[1]}" if cpus[1] == cpus[0] + 1 else f"{cpus[0]},{cpus[1]}"
    pin_cpus, me, seen = json.loads(run_py(SPREAD, affinity=set(cpus)))
    assert pin_cpus == cpus
    (inside0, m0), (inside1, m1), (inside2, m2) = seen
    others = lambda m: sorted(v for t, v in m.items() if t != str(me))  # noqa: E731
    assert inside0 == [cpus[0]] and str(cpus[1]) in others(m0)         # pinned: one thread per CPU
    assert inside1 == cpus and str(cpus[1]) not in others(m1)          # spread: nobody holds the second CPU alone
    assert others(m1).count(both) >= 2                                 # the OpenMP worker and the pool's worker
    assert inside2 == [cpus[0]] and str(cpus[1]) in others(m2)         # quiet again: pinned again


def test_dtype_rule_that_needs_no_measurement(tmp_path):
    choice = dtype_probe.choose_cpu_dtype("cpu", "avx2,fma", [(64, 32)], tmp_path)
    assert choice.dtype == "float32" and choice.fp32_us is None
    assert not (tmp_path / "probes").exists()


def test_amx_is_measured_not_assumed(tmp_path):
    """AMX used to mean bfloat16 unmeasured; at batch 1 it measured slower than float32 on an AMX Xeon."""
    choice = dtype_probe.choose_cpu_dtype("cpu", "avx512f,avx512_bf16,amx_bf16,amx_tile", [(256, 128)], tmp_path)
    assert choice.reason == "measured" and choice.fp32_us > 0 and choice.bf16_us > 0


def test_quantized_linears_on_the_native_kernels_take_float32(tmp_path, monkeypatch):
    """Whatever the probe says about float linears: the integer kernels and the compiled decode step take float32
    activations. Without those kernels (torch's int8/int4 mm) the probe decides, as for float weights."""
    import torch
    from safetensors.torch import save_file
    from warmstart import dtypes
    from warmstart.models import quant
    from warmstart.startup.device import DeviceFacts
    monkeypatch.setattr(dtype_probe, "choose_cpu_dtype",
                        lambda *a, **k: dtype_probe.DtypeChoice("bfloat16", "stub: the probe's verdict"))
    facts = DeviceFacts(kind="cpu", name="cpu", total_bytes=2**34, capability="avx512f,avx512_bf16")
    monkeypatch.setattr(quant, "native_kernel", lambda: True)
    assert dtypes.resolve_dtype("auto", facts, cache_dir=tmp_path, quantized=True) is torch.float32
    assert dtypes.resolve_dtype("auto", facts, cache_dir=tmp_path, quantized=False) is torch.bfloat16
    assert dtypes.resolve_dtype("bfloat16", facts, cache_dir=tmp_path, quantized=True) is torch.bfloat16
    monkeypatch.setattr(quant, "native_kernel", lambda: False)
    assert dtypes.resolve_dtype("auto", facts, cache_dir=tmp_path, quantized=True) is torch.bfloat16
    # which loads keep quantized linears: read from the checkpoint's tensor names
    floats, gguf = tmp_path / "float", tmp_path / "gguf"
    floats.mkdir(), gguf.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}, str(floats / "model.safetensors"))
    save_file({"model.layers.0.mlp.up_proj.qweight": torch.zeros(4, 4, dtype=torch.int8)},
              str(gguf / "model.safetensors"))
    assert not dtypes.quantized_load("auto", floats) and dtypes.quantized_load("auto", gguf)
    assert dtypes.quantized_load("int4", floats) and not dtypes.quantized_load("none", gguf)


def test_avx512_bf16_is_measured_once_and_cached(tmp_path, monkeypatch):
    first = dtype_probe.choose_cpu_dtype("cpu", "avx512f,avx512_bf16", [(256, 128)], tmp_path)
    assert first.reason == "measured" and first.fp32_us > 0 and first.bf16_us > 0
    assert first.dtype == ("bfloat16" if first.ratio >= dtype_probe.MARGIN else "float32")
    monkeypatch.setattr(dtype_probe, "_measure", lambda shapes: pytest.fail("measured twice"))
    assert dtype_probe.choose_cpu_dtype("cpu", "avx512f,avx512_bf16", [(256, 128)], tmp_path) == first
