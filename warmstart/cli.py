"""`warmstart generate | serve | import-gguf | plan | weights` — the command line.

Every behaviour-changing knob is a flag here with the EngineConfig default; user errors print one paragraph and
exit 2, without a traceback."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from warmstart.config import DEFAULT_UTILIZATION, EngineConfig, parse_bytes
from warmstart.errors import UserError, user_error
from warmstart.paths import warmstart_cache_dir

_D = {f.name: f.default for f in fields(EngineConfig) if f.default is not f.default_factory}


def byte_size(text: str) -> int:
    """argparse type for sizes: argparse reports ArgumentTypeError as a usage error (exit 2), not a traceback."""
    try:
        return parse_bytes(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    if model_required:
        p.add_argument("model", help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) "
                                     "or a .gguf file, which is imported once into the cache")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=_D["dtype"], choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = bfloat16 on GPUs (sm_80+), float16 on older GPUs; "
                        "on CPU float32 for quantized linears (the default model) and where bf16 is emulated, "
                        "else measured once per machine (bf16 only if >= 10%% faster at batch 1)")
    g.add_argument("--device", default=_D["device"], help="auto, cpu or cuda[:N] (default: auto)")
    g.add_argument("--memory-utilization", type=float, default=None,
                   help=f"fraction of device memory this engine may use (default {DEFAULT_UTILIZATION['cuda']} "
                        f"on GPU, {DEFAULT_UTILIZATION['cpu']} of host RAM on CPU)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="BYTES",
                   help="explicit KV cache size such as 256MiB or 2GiB; wins over --memory-utilization and "
                        "neither reads nor writes startup plans")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=_D["max_num_seqs"],
                   help=f"sequences running at once (default {_D['max_num_seqs']})")
    g.add_argument("--max-num-batched-tokens", type=int, default=_D["max_num_batched_tokens"],
                   help=f"tokens per step; long prompts are prefilled in chunks of this size "
                        f"(default {_D['max_num_batched_tokens']})")
    g.add_argument("--block-size", type=int, default=_D["block_size"],
                   help=f"tokens per KV block (default {_D['block_size']})")
    g.add_argument("--kv-cache-dtype", default=_D["kv_cache_dtype"],
                   choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="auto (default): float16 for a float32 model on CPU (as llama.cpp's F16 cache: it halves the "
                        "bytes a long context reads per step, the paged-attention kernel runs it about 1.5x faster "
                        "than float32 at 2,048 tokens, benchmarks/paged_attention.py, and a budget holds twice the "
                        "blocks), the model dtype otherwise. float32 keeps the cache exact. int8 (CPU): each token's "
                        "K/V row per head as int8 codes with a float32 scale, 68 bytes per 64 values, about half of "
                        "float16's reads and 1.9x its blocks, at a small accuracy cost")
    g.add_argument("--quantization", default=_D["quantization"], choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization on CPU. auto: an imported GGUF keeps its own formats (Q4_0/Q4_1/"
                        "Q4_K as int4 in groups of 32, Q5/Q6_K/Q8_0 as int8 per row), a float checkpoint stays float; "
                        "none: float in --dtype; int8: every linear int8 per output row; int4: linears int4 in "
                        "groups of 32, the LM head int8 (default auto)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model, with a persistent "
                                                         "compiler cache under --cache-dir")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: the cores this process may use, from its affinity "
                        "mask and cgroup quota). The compiled kernels run their loops on their own pool, whose workers "
                        "spin briefly, then sleep, and whose loops never wait for a thread that lost its core "
                        "(WARMSTART_THREAD_POOL=0: torch's OpenMP team instead); idle OpenMP threads sleep at once "
                        "(OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0) unless the environment sets those. When the "
                        "threads match the CPUs one to one, "
                        "each thread is pinned to its own CPU while a step runs (WARMSTART_PIN_THREADS=0 turns that "
                        "off; OMP_PROC_BIND/OMP_PLACES in the environment win). While other processes keep the "
                        "cores busy (this thread waits for a CPU a quarter of its step time or more) a step runs on "
                        "fewer threads, not pinned, and on all of them, pinned, again once the host is quiet "
                        "(WARMSTART_ADAPTIVE_THREADS=0 keeps them fixed); the startup report shows all of it")
    g = p.add_argument_group("tensor parallel")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N ranks (processes this command launches; gloo on CPU, NCCL on "
                        "CUDA with one GPU per rank); quantized weights are cut per rank before fusion (default 1)")
    g.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU threads of each rank (default: the available cores split evenly over the ranks)")
    g.add_argument("--master-addr", default=_D["master_addr"],
                   help="address rank 0 listens on for the rendezvous (torchrun's MASTER_ADDR; default 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=_D["master_port"],
                   help="rendezvous port (torchrun's MASTER_PORT; default: a free port)")
    g.add_argument("--nnodes", type=int, default=_D["nnodes"],
                   help="hosts the ranks span (default 1). This command runs rank 0 and the first "
                        "N/nnodes ranks; on each other host run `warmstart tp-join --master-addr A --master-port P "
                        "-tp N --nnodes H --node-rank K` (the model path must exist there too)"),
    g = p.add_argument_group("engine")
    g.add_argument("--cache-dir", default=None,
                   help=f"plans, imported models and the compiler cache (default {warmstart_cache_dir()}, "
                        "or $WARMSTART_CACHE_DIR)")
    g.add_argument("--seed", type=int, default=_D["seed"], help="global seed for unseeded sampling")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse cached KV blocks of earlier prompts (prefix caching is on by default)")
    g.add_argument("--prefix-cache-persist", type=byte_size, default=_D["prefix_cache_persist"], metavar="BYTES",
                   help="on graceful shutdown, save up to this much of the most recently used cached KV to the cache "
                        "dir and restore it at the next boot (default 64MiB; 0 disables)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-model", dest="draft_model", default=None, metavar="PATH",
                   help="draft model (same vocabulary as the target); its weights may come from a daemon serving "
                        "role draft")
    g.add_argument("--num-speculative-tokens", type=int, default=_D["num_speculative_tokens"], metavar="K",
                   help="tokens proposed per decoding sequence and step, verified in one target forward")
    g.add_argument("--draft-weight-socket", default=None,
                   help="the draft model's daemon socket (`warmstart weights serve DRAFT --role draft`; default: "
                        "discovered in the socket dir)")
    g.add_argument("--speculative-method", default=None, choices=["draft", "ngram"],
                   help="draft (default with --speculative-model) or ngram (prompt lookup, no second model)")
    g = p.add_argument_group("startup plans")
    g.add_argument("--startup-plan", default=_D["startup_plan"],
                   choices=["auto", "off", "read", "write", "require"],
                   help="auto: reuse a matching plan and save new ones; require: fail unless a plan matches")
    g.add_argument("--plan-free-tolerance", type=byte_size, default=None, metavar="BYTES",
                   help="GPU: how much less free memory than the plan recorded is still a hit (default 0). "
                        "CPU plans are gated instead on their remaining allocation fitting in free memory")
    g = p.add_argument_group("weight cache daemon")
    g.add_argument("--load-format", default=_D["load_format"], choices=["auto", "disk", "daemon"],
                   help="auto: attach to a running weight daemon if one serves this model, else load from disk")
    g.add_argument("--weight-socket", default=None, help="daemon socket (default: discovered in the socket dir)")
    g.add_argument("--weight-mode", default=_D["weight_mode"], choices=["zero_copy", "copy"],
                   help="zero_copy maps the daemon's memory; copy copies it and releases the daemon's lease")
    g.add_argument("--weight-fallback", default="on", choices=["on", "off"],
                   help="on: load from disk when the daemon is absent or incompatible; off: fail instead")


def config_from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    kw = dict(model=model if model is not None else args.model, dtype=args.dtype, device=args.device,
              memory_utilization=args.memory_utilization, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, compile=args.compile, seed=args.seed, threads=args.threads,
              startup_plan=args.startup_plan, plan_free_tolerance=args.plan_free_tolerance,
              load_format=args.load_format, weight_socket=args.weight_socket, weight_mode=args.weight_mode,
              weight_fallback=args.weight_fallback == "on", enable_prefix_caching=args.enable_prefix_caching,
              prefix_cache_persist=args.prefix_cache_persist, draft_model=args.draft_model,
              num_speculative_tokens=args.num_speculative_tokens, speculative_method=args.speculative_method,
              draft_weight_socket=args.draft_weight_socket, world_size=args.tensor_parallel_size,
              master_addr=args.master_addr, master_port=args.master_port, nnodes=args.nnodes)
    if args.tensor_parallel_size > 1 and args.threads_per_rank is not None:
        kw["threads"] = args.threads_per_rank
    if args.cache_dir:
        kw["cache_dir"] = args.cache_dir
    return EngineConfig(**kw)


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from warmstart.interrupts import exit_at_once_on_signals
    with exit_at_once_on_signals():                  # torch imports here (see interrupts.py)
        from warmstart.llm import LLM
        from warmstart.sampling_params import SamplingParams
        from warmstart.startup.steps import StepTimer
    timer = StepTimer.from_process_start()
    # Validate the request before paying for a boot.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed_request,
                            top_p=args.top_p, top_k=args.top_k)
    llm = LLM.from_config(config_from_args(args), timer)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    if args.report:
        llm.report.write(Path(args.report), outputs=[{"prompt_token_ids": out.prompt_token_ids,
                                                          "output_token_ids": out.output_token_ids}])
    return 0


def build_parser() -> argparse.ArgumentParser:
    from warmstart import __version__
    p = argparse.ArgumentParser(prog="warmstart", description="An LLM inference engine whose edge is the restart: "
                                "startup plans, a weight cache daemon, and every byte and second measured.")
    p.add_argument("--version", action="version", version=f"warmstart {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="boot, generate for one prompt, print the text")
    add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-request", type=int, default=None, help="seed for this request's sampling")
    g.add_argument("--report", default=None, metavar="PATH", help="write the JSON startup report here")
    g.set_defaults(func=cmd_generate)

    for register in _extensions():
        register(sub)
    return p


def _extensions():
    """Subcommands that live beside their features (server, plans, weights, GGUF import)."""
    regs = []
    for mod, attr in (("warmstart.server.launch", "register_cli"), ("warmstart.plan_cli", "register_cli"),
                      ("warmstart.weights.cli", "register_cli"), ("warmstart.weights.gguf_cli", "register_cli"),
                      ("warmstart.parallel.node", "register_cli")):
        try:
            module = __import__(mod, fromlist=[attr])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        regs.append(getattr(module, attr))
    return regs


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return 130
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything imports torch: its OpenMP runtime reads the wait policy once, when it loads.
    from warmstart import threads
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    threads.configure(getattr(args, "threads_per_rank", None) if tp > 1 else getattr(args, "threads", None))
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (UserError, OSError) as e:          # errors.py words environment errors; any other is a bug
        print(f"error: {user_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
