"""`warmstart plan list | show KEY | explain MODEL [engine flags] | clear [KEY|--all]`."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from warmstart.config import format_bytes
from warmstart.errors import UserError
from warmstart.paths import warmstart_cache_dir
from warmstart.startup.plan import BadPlanFile, PlanStore, read_plan_file


def _store(args) -> PlanStore:
    return PlanStore(Path(args.cache_dir or warmstart_cache_dir()) / "plans")


def cmd_list(args) -> int:
    docs = _store(args).list()          # files that are not valid plans are skipped with a warning
    if not docs:
        print(f"no startup plans under {_store(args).root}")
        return 0
    print(f"{'key':<32}  {'created':<19}  {'util':>5}  {'kv blocks':>9}  {'kv bytes':>11}  model")
    for d in docs:
        k, led = d["key"], d["ledger"]
        weights = k.get("model.weights")
        files = ",".join(str(w.get("file")) for w in weights if isinstance(w, dict)) \
            if isinstance(weights, list) else "?"
        print(f"{d['digest']:<32}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(d.get('created', 0)))}  "
              f"{str(k.get('memory_utilization', '?'))[:5]:>5}  {led['num_kv_blocks']:>9}  "
              f"{format_bytes(led['kv_cache_bytes']):>11}  {str(k.get('model.architecture'))[:60]} "
              f"({files[:200]})")
    return 0


def _find(store: PlanStore, prefix: str) -> Path:
    matches = store.find(prefix)
    if len(matches) != 1:
        raise UserError(f"{'No' if not matches else 'More than one'} plan matches {prefix!r} under {store.root}. "
                        "Run `warmstart plan list` for the keys (hex digests or a unique prefix of one).")
    return matches[0]


def cmd_show(args) -> int:
    path = _find(_store(args), args.key)
    try:
        doc = read_plan_file(path)
    except (BadPlanFile, FileNotFoundError) as e:
        raise UserError(f"{path} is not a usable startup plan ({e}); boots ignore it. Remove it with "
                        f"`warmstart plan clear {path.stem}`.") from None
    print(json.dumps(doc, indent=1, sort_keys=True))
    return 0


def cmd_clear(args) -> int:
    store = _store(args)
    if not args.all and not args.key:
        raise UserError("Say which plan to clear (a key or key prefix from `warmstart plan list`), or --all.")
    n = store.remove(None if args.all else _find(store, args.key).stem)
    print(f"removed {n} plan(s) from {store.root}")
    return 0


def cmd_explain(args) -> int:
    """Answer 'would a boot with these flags reuse a plan?' without loading weights or running the model."""
    from warmstart.boot import resolve_model_dir
    from warmstart.cli import config_from_args
    from warmstart.keys import plan_key
    from warmstart.models.spec import ModelSpec
    from warmstart.planning import MemoryPlanner
    from warmstart.startup.device import get_device
    config = config_from_args(args)
    if config.kv_cache_memory is not None:
        print("bypassed: --kv-cache-memory is explicit, so plans are neither read nor written")
        return 0
    if config.startup_plan in ("off", "write"):
        print(f"no read: --startup-plan {config.startup_plan} never reuses a plan")
        return 0
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    spec = ModelSpec.from_dir(model_dir)
    if config.world_size > 1:
        # One plan per rank (each rank profiles its own shard): a boot skips profiling only if every rank hits.
        for rank in range(config.world_size):
            print(f"rank {rank}/{config.world_size}: ", end="")
            _explain_one(config.replace(rank=rank), model_dir, spec)
        return 0
    return _explain_one(config, model_dir, spec)


def _explain_one(config, model_dir, spec) -> int:
    from warmstart.boot import resolve_model_dir
    from warmstart.keys import plan_key
    from warmstart.planning import MemoryPlanner
    from warmstart.startup.device import get_device
    index = config.rank if config.world_size > 1 and config.device_kind == "cuda" else 0
    device = get_device(config.device_kind, index)
    facts = device.facts()
    # The same key the boot builds: a draft model is part of it (boot.py resolves it the same way).
    draft_dir = resolve_model_dir(config.draft_model, config.cache_dir) if config.draft_model else None
    key = plan_key(config, model_dir, spec, facts, draft_dir)
    planner = MemoryPlanner(config, device, facts, key, PlanStore(config.cache_dir / "plans"), device.free_bytes())
    planner.external, note = _daemon_charge(config, model_dir, device, facts)
    if note:
        print(note)
    found = planner.store.lookup(key, planner.effective_free, planner.tolerance, device.kind)
    if found.plan is not None:
        led = found.plan.ledger
        why = planner.hit_problem(found.plan.ledger, None)
        if why:
            print(f"miss: {found.path}\n  {why}")
            return 0
        print(f"hit: {found.path}\n  {led.num_kv_blocks} KV blocks ({format_bytes(led.kv_cache_bytes)}); "
              f"free now {format_bytes(planner.effective_free)} passes the {device.kind} free-memory gate")
        return 0
    print(f"miss: {found.path}")
    for r in found.reasons:
        print(f"  {r}")
    return 0


def _daemon_charge(config, model_dir, device, facts) -> tuple[int, str | None]:
    """The bytes a boot would be charged by a weight daemon (they count as free for the plan gate), without
    attaching: a hello and a key comparison. 0 when the boot would load from disk."""
    if config.load_format == "disk":
        return 0, None
    import os

    from warmstart.dtypes import quantized_load, resolve_dtype
    from warmstart.weights import client
    from warmstart.weights.manifest import build_cache_key
    from warmstart.weights.transport import device_id
    path = client.resolve_socket(config.weight_socket, device.torch_device(), "target", config.rank,
                                 config.world_size)
    if not os.path.lexists(path):
        return 0, None
    try:
        from warmstart.models.spec import ModelSpec
        dtype = resolve_dtype(config.dtype, facts, ModelSpec.from_dir(model_dir), config.cache_dir,
                              quantized=quantized_load(config.quantization, model_dir))
        key = build_cache_key(model_dir, dtype, "target", device_id(device.torch_device()), rank=config.rank,
                              world_size=config.world_size, quantization=config.quantization)
        with client.DaemonSession(path) as session:
            hello = session.open()
    except client.AttachFailure as e:
        return 0, f"daemon at {path} would not be used ({e.reason}); assuming a disk load"
    if hello.key.mismatched_fields(key):
        return 0, f"daemon at {path} serves another configuration; assuming a disk load"
    if config.weight_mode == "copy":
        return 0, f"daemon at {path} would be copied from (no charge)"
    return hello.weight_bytes, f"daemon at {path} would serve {format_bytes(hello.weight_bytes)} zero-copy"


def register_cli(sub) -> None:
    p = sub.add_parser("plan", help="inspect, explain and clear startup plans",
                       description="Startup plans store a profiled boot's memory ledger under a key of everything "
                                   "the KV size depends on. These commands read them; none boots the engine.")
    ps = p.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    for name, fn, helptext in (("list", cmd_list, "one line per saved plan"),
                               ("show", cmd_show, "print one plan (key components and ledger)"),
                               ("clear", cmd_clear, "delete one plan, or all with --all")):
        q = ps.add_parser(name, help=helptext)
        q.add_argument("--cache-dir", default=None, help="cache root (default $WARMSTART_CACHE_DIR or "
                                                         "~/.cache/warmstart)")
        if name in ("show", "clear"):
            q.add_argument("key", nargs="?" if name == "clear" else None, help="plan key or a unique prefix")
        if name == "clear":
            q.add_argument("--all", action="store_true", help="delete every plan")
        q.set_defaults(func=fn)
    from warmstart.cli import add_engine_args
    q = ps.add_parser("explain", help="would a boot with these flags hit a plan? if not, why")
    add_engine_args(q)
    q.set_defaults(func=cmd_explain)
