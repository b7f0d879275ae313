"""The boot pipeline: config -> tokenizer -> weights -> memory (plan or profile) -> KV -> warm-up -> ready.

Each stage is a named, timed step (startup/steps.py). Measured facts come out as new objects (ModelSpec,
MemoryLedger, StartupReport); the EngineConfig that went in is never changed."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from warmstart import threads
from warmstart.config import EngineConfig, format_bytes
from warmstart.engine.engine import Engine
from warmstart.engine.scheduler import PrefixStats, SchedulerLimits
from warmstart.errors import UserError
from warmstart.models.registry import build_model
from warmstart.models.spec import ModelSpec
from warmstart.runner.affinity import StepPinning
from warmstart.runner.runner import ModelRunner
from warmstart.runner.step_threads import StepThreads
from warmstart.sampling_params import SamplingParams
from warmstart.spec import SpecStats
from warmstart.spec.proposer import DraftProposer, NgramProposer
from warmstart.weights.charges import ExternalCharges
from warmstart.keys import compile_key, plan_key
from warmstart.planning import MemoryPlanner, ResidentCheck
from warmstart.prefix_store import PrefixOutcome, PrefixStore
from warmstart.startup.device import DeviceFacts, get_device
from warmstart.startup.ledger import OVERHEAD_QUANTUM, MemoryLedger, round_up
from warmstart.startup.plan import PlanStore
from warmstart.startup.report import StartupReport, WeightsOutcome
from warmstart.startup.steps import StepTimer
from warmstart.tokenizer import Tokenizer
from warmstart.dtypes import quantized_load, resolve_dtype, resolve_kv_dtype
from warmstart.weights.loader import bind_weights, materialize_buffers
from warmstart.weights.source import LoadedWeights, load_weights

log = logging.getLogger("warmstart")


@dataclass
class Booted:
    """A ready engine and everything the boot learned on the way."""
    config: EngineConfig
    model_dir: Path
    spec: ModelSpec
    tokenizer: Tokenizer
    runner: ModelRunner
    engine: Engine
    ledger: MemoryLedger
    report: StartupReport
    max_model_len: int
    prefix: PrefixStore | None = None        # saves the prefix cache at a graceful shutdown (None: off)


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """A model folder as given, a .gguf file imported once into the cache, or the bundled default model."""
    if model in ("", "default"):
        from warmstart.weights.gguf import default_model_dir
        return default_model_dir(cache_dir=cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from warmstart.weights.gguf import import_gguf
        return import_gguf(path, cache_dir=cache_dir)
    if not path.exists():
        raise UserError(f"Model {model!r} was not found. Pass a local Hugging Face folder (config.json, "
                        "*.safetensors, tokenizer.json) or a .gguf file; warmstart never downloads models.")
    if not path.is_dir():
        raise UserError(f"{model} is a file, not a model folder. Pass the folder that holds config.json, or a "
                        ".gguf file to import.")
    return path


@dataclass
class Shard:
    """One rank's boot up to its allocated KV cache (a single-device boot is rank 0 of 1)."""
    model_dir: Path
    spec: ModelSpec
    tokenizer: Tokenizer
    device: object
    facts: DeviceFacts
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    planner: MemoryPlanner
    runner: ModelRunner
    own_ledger: MemoryLedger            # what this rank measured (saved in its plan)
    ledger: MemoryLedger                # what it allocated (under TP: the minimum over ranks)
    loaded_tensors: dict
    weights_outcome: WeightsOutcome
    thread_settings: object
    draft_runner: ModelRunner | None = None   # speculative decoding's draft model (single device only)
    draft_loaded: LoadedWeights | None = None
    group: object = None                # parallel.launcher.RankGroup under TP
    blocks_per_rank: list | None = None


def boot(config: EngineConfig, timer: StepTimer | None = None) -> Booted:
    timer = timer or StepTimer.starting_now()
    try:
        return _boot_engine(config, timer, boot_shard(config, timer))
    except BaseException:
        _close_group(config)
        raise


def boot_shard(config: EngineConfig, timer: StepTimer, group=None) -> Shard:
    """config -> tokenizer -> weights -> memory -> KV allocation, for one rank. Under TP (world_size > 1) rank 0
    launches the other ranks here (group None) and every rank binds its shard; the KV block count is agreed."""
    tp = config.world_size > 1
    if tp and group is None and config.rank != 0:
        raise UserError(f"rank {config.rank} of {config.world_size} is started by rank 0 (`--tensor-parallel-size "
                        f"{config.world_size}` launches every rank), or by hand as `python -m "
                        "warmstart.parallel.worker` with torchrun's environment; not by booting it directly.")
    with timer.step("config"):
        if tp:
            from warmstart.parallel.launcher import threads_per_rank
            thread_settings = threads.configure(threads_per_rank(config))
        else:
            thread_settings = threads.configure(config.threads)
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        spec = ModelSpec.from_dir(model_dir)
        shard_cut = None
        if tp:
            from warmstart.weights.shard import ShardCut, check_divisible
            check_divisible(spec, config.world_size)
            shard_cut = ShardCut(spec, config.rank, config.world_size)
        device_index = config.rank if tp and config.device_kind == "cuda" else _device_index(config.device)
        device = get_device(config.device_kind, device_index)
        facts = device.facts()
        free_at_boot = device.free_bytes()
        dtype = resolve_dtype(config.dtype, facts, spec, config.cache_dir,
                              quantized=quantized_load(config.quantization, model_dir))
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, config.device_kind)
        max_model_len = _max_model_len(config, spec)
        torch.manual_seed(config.seed)
        draft_dir = draft_spec = None
        if config.spec_method == "draft":
            draft_dir = resolve_model_dir(config.draft_model, config.cache_dir)
            draft_spec = ModelSpec.from_dir(draft_dir)
            if draft_spec.vocab_size != spec.vocab_size:
                raise UserError(f"The speculative model {config.draft_model} has a vocabulary of "
                                f"{draft_spec.vocab_size} tokens but the target {config.model or 'default'} has "
                                f"{spec.vocab_size}: a draft must share the target's tokenizer vocabulary.")
        # The plan key is built here, from the user's config and device facts, before anything is derived.
        planner = MemoryPlanner(config, device, facts, plan_key(config, model_dir, spec, facts, draft_dir),
                                PlanStore(config.cache_dir / "plans"), free_at_boot)
    if tp and group is None:
        with timer.step("ranks"):
            from warmstart.parallel import launcher
            group = launcher.start(config)
    with timer.step("tokenizer"):
        tokenizer = Tokenizer(model_dir)
        # Runtime overhead: what the process holds before any weight arrives (interpreter, torch, tokenizer).
        overhead = round_up(device.process_bytes(), OVERHEAD_QUANTUM) if device.kind == "cpu" else 0
    with timer.step("weights"):
        charges = ExternalCharges()           # one for every role: a daemon serving both is charged once
        # A rank's daemon (its own socket) serves its shard already; a disk load is cut the same way.
        loaded = load_weights(model_dir, dtype, device.torch_device(), role="target", config=config,
                              charges=charges, shard=shard_cut)
        model = _bind_model(spec, loaded.tensors, device, config.world_size)
        runner = _runner_class(config)(model, device.torch_device(), kv_dtype)
        if tp:
            runner.group = group
        draft_runner = draft_loaded = None
        if draft_dir is not None:
            # Its own daemon socket (role draft); load format, mode and fallback policy as for the target.
            draft_loaded = load_weights(draft_dir, dtype, device.torch_device(), role="draft",
                                        config=config.replace(weight_socket=config.draft_weight_socket),
                                        charges=charges)
            draft_runner = ModelRunner(_bind_model(draft_spec, draft_loaded.tensors, device),
                                       device.torch_device(), kv_dtype)
        weights_outcome = WeightsOutcome(loaded.source, loaded.fallback_reason, tuple(charges.entries()))
    with timer.step("memory profile"):
        owned = loaded.owned_bytes + (draft_loaded.owned_bytes if draft_loaded else 0)
        if draft_runner is not None:
            planner.extra_kv_block_bytes = draft_runner.kv_block_bytes(config.block_size)
        if tp:
            # Each rank profiles its own shard, alone: the all-reduces are skipped (a plan may hit on one rank
            # and miss on another, and an in-place all-reduce allocates nothing the profile must count).
            from warmstart.parallel.sharding import no_collectives
            with no_collectives():
                own = planner.plan(runner, owned, charges.total_bytes, overhead, max_model_len)
        else:
            own = planner.plan(runner, owned, charges.total_bytes, overhead, max_model_len)
        if draft_runner is not None:
            draft_charged = sum(e["bytes"] for e in charges.entries() if e["role"] == "draft")
            own = replace(own, draft_weights_bytes=draft_loaded.owned_bytes + draft_charged,
                          draft_kv_cache_bytes=own.num_kv_blocks * planner.extra_kv_block_bytes)
    ledger, blocks = own, None
    if tp:
        # Waits for the slowest rank: every rank's block tables come from rank 0's scheduler.
        with timer.step("rank agreement"):
            from warmstart.parallel.launcher import agree_blocks
            ledger, blocks = agree_blocks(group, own)
    with timer.step("kv allocation"):
        _check_fits(ledger, max_model_len, config)
        runner.allocate_kv(ledger.num_kv_blocks, ledger.block_size)
        if draft_runner is not None:
            draft_runner.allocate_kv(ledger.num_kv_blocks, ledger.block_size)
    return Shard(model_dir, spec, tokenizer, device, facts, dtype, kv_dtype, max_model_len, planner, runner, own,
                 ledger, loaded.tensors, weights_outcome, thread_settings, draft_runner, draft_loaded, group, blocks)


def finish_shard(shard: Shard, timer: StepTimer) -> StartupReport:
    """After warm-up: verify or save this rank's plan and build its report."""
    resident = ResidentCheck.measure(shard.device, shard.own_ledger)
    plan = shard.planner.finish(shard.runner, shard.own_ledger, shard.max_model_len, resident)
    log.info("%s\n  %s", shard.ledger.table(), resident.describe())
    extra = {"resident": resident.to_dict(), "threads": shard.thread_settings.to_dict(),
             "dtype": str(shard.dtype).removeprefix("torch."),
             "quantization": _quantization_summary(shard.loaded_tensors, shard.planner.config.quantization)}
    return StartupReport(timer.wall_seconds, timer.to_list(), plan, shard.ledger, shard.weights_outcome,
                         extra=extra)


def _boot_engine(config: EngineConfig, timer: StepTimer, shard: Shard) -> Booted:
    """Rank 0 (or the single device): the engine over the booted shard, prefix restore, warm-up, report."""
    runner, ledger, spec, max_model_len = shard.runner, shard.ledger, shard.spec, shard.max_model_len
    proposer = None
    if shard.draft_runner is not None:
        proposer = DraftProposer(shard.draft_runner)
    elif config.spec_method == "ngram":
        proposer = NgramProposer()
    settings = threads.current()
    pinning = StepPinning(settings.pin_cpus)
    engine = Engine(runner, SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
                    ledger.num_kv_blocks, ledger.block_size, spec.vocab_size, spec.eos_token_ids,
                    shard.tokenizer.decode, enable_prefix_caching=config.enable_prefix_caching, proposer=proposer,
                    num_speculative_tokens=config.num_speculative_tokens,
                    step_threads=StepThreads(settings.threads, pinning, settings.adaptive, spread=pinning.spread))
    with timer.step("prefix restore"):
        # Under TP the cache is split over ranks and the store holds one process's blocks: not persisted (the
        # in-memory prefix cache works as on one device).
        prefix = None if config.world_size > 1 else PrefixStore.for_boot(config, shard.model_dir, spec, shard.facts,
                                                                          shard.dtype, shard.kv_dtype)
        restored = prefix.restore(runner, engine.blocks) if prefix else PrefixOutcome("off")
    with timer.step("warm-up"):
        compile_info = None
        if config.compile:
            # After profiling: Dynamo skipped frames it first saw under the peak tracker (a torch mode), and the
            # eager peak bounds the compiled one (fusion only removes intermediates).
            from warmstart.runner.compile import compile_model
            compile_info = compile_model(runner.model,
                                         config.cache_dir / "compile" / compile_key(config, spec, shard.facts))
        _warm_up(engine)
    with timer.step("ready"):
        if shard.group is not None:
            shard.group.send(("report",))
        report = finish_shard(shard, timer)
        if shard.group is not None:
            ranks = shard.group.all_gather(report.to_dict())
            report.extra["tensor_parallel"] = {"world_size": config.world_size,
                                               "kv_blocks_per_rank": shard.blocks_per_rank,
                                               "kv_blocks": ledger.num_kv_blocks,
                                               "worker_pids": [p.pid for p in shard.group.procs.values()],
                                               "ranks": ranks}
    report.extra["prefix_restore"] = restored.to_dict()
    report.extra["speculative"] = _speculative_summary(engine, shard.draft_loaded)
    if compile_info:
        report.extra["compile"] = compile_info.snapshot()
    # The report again, now that the ready step has ended: its steps tile the wall clock.
    report = StartupReport(timer.wall_seconds, timer.to_list(), report.plan, report.memory, report.weights,
                           extra=report.extra)
    log.info("startup steps:\n%s", timer.table())
    return Booted(config, shard.model_dir, spec, shard.tokenizer, runner, engine, ledger, report, max_model_len,
                  prefix)


def _runner_class(config: EngineConfig) -> type[ModelRunner]:
    if config.world_size == 1:
        return ModelRunner
    from warmstart.parallel.runner import DistributedRunner, ShardRunner
    return DistributedRunner if config.rank == 0 else ShardRunner


def _close_group(config: EngineConfig) -> None:
    if config.world_size > 1:
        from warmstart.parallel import launcher
        group = launcher.current()
        if group is not None:
            group.close()


def _bind_model(spec: ModelSpec, tensors: dict[str, torch.Tensor], device, world_size: int = 1):
    """Build on meta, bind the (this rank's) tensors; under TP the model has this rank's shape and its o_proj and
    down_proj all-reduce."""
    if world_size > 1:
        from warmstart.weights.shard import local_spec
        spec = local_spec(spec, world_size)
    with torch.device("meta"):
        model = build_model(spec)
    bind_weights(model, tensors, model.tied_weights())
    if world_size > 1:
        from warmstart.parallel.sharding import make_row_parallel
        make_row_parallel(model)
    materialize_buffers(model, device.torch_device())
    return model.eval()


def _speculative_summary(engine: Engine, draft_loaded) -> dict:
    """The startup report's speculative section: method, K, the draft's weight source; counters live on
    engine.spec_stats (the warm-up is excluded) and are read by /startup and /metrics at request time."""
    d = {"method": engine.spec_stats.method, "num_speculative_tokens": engine.spec_stats.num_speculative_tokens}
    if draft_loaded is not None:
        d["draft_weights"] = {"source": draft_loaded.source, "fallback_reason": draft_loaded.fallback_reason,
                              "owned_bytes": draft_loaded.owned_bytes}
    return d


def _quantization_summary(tensors: dict[str, torch.Tensor], requested: str) -> dict:
    """How the bound weights are stored: linears per format, and the bytes of each."""
    from warmstart.weights.loader import weights_nbytes
    kinds: dict[str, int] = {}
    for name in tensors:
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            kind = "int4" if f"{prefix}.mins" in tensors or f"{prefix}.scales_zeros" in tensors else "int8"
            kinds[kind] = kinds.get(kind, 0) + 1
    from warmstart.models.quant import native_kernel
    from warmstart import kernels
    kernel = None
    if kinds:
        kernel = f"warmstart {kernels.qlinear_isa()}" if native_kernel() else "torch (aten weight-only int8/int4 mm)"
    return {"requested": requested, "linears": kinds, "weight_bytes": weights_nbytes(tensors), "kernel": kernel}


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def _max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position_embeddings
    if config.max_model_len > spec.max_position_embeddings:
        raise UserError(f"--max-model-len {config.max_model_len} exceeds the model's "
                        f"max_position_embeddings ({spec.max_position_embeddings}). Lower it.")
    return config.max_model_len


def _check_fits(ledger: MemoryLedger, max_model_len: int, config: EngineConfig) -> None:
    if ledger.token_capacity >= max_model_len:
        return
    if config.kv_cache_memory is not None:
        source = f"--kv-cache-memory {format_bytes(config.kv_cache_memory)}"
    else:
        source = (f"--memory-utilization {config.utilization} (budget {format_bytes(ledger.budget_bytes)}, of "
                  f"which {format_bytes(ledger.non_kv_bytes)} is weights, activations and runtime)")
    raise UserError(f"The KV cache is too small for one sequence: {source} leaves room for "
                    f"{ledger.token_capacity} tokens but max_model_len is {max_model_len} "
                    f"(one token needs {format_bytes(ledger.kv_block_bytes / ledger.block_size)}). Raise "
                    "--memory-utilization or --kv-cache-memory, or lower --max-model-len.")


def _warm_up(engine: Engine) -> None:
    """One prefill and one decode through the real engine, so the first request pays no first-call costs."""
    engine.add("__warmup__", [0] * min(8, engine.limits.max_model_len - 2), SamplingParams(max_tokens=2,
                                                                                          temperature=0))
    while engine.has_unfinished:
        engine.step()
    engine.step()                                  # flushes the finished id to the runner
    engine.scheduler.prefix_stats = PrefixStats()  # the warm-up is not traffic: hit rates start at the first request
    engine.spec_stats = SpecStats(engine.spec_stats.method, engine.spec_stats.num_speculative_tokens)
