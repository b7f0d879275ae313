"""`warmstart tp-join`: run this host's share of a tensor-parallel engine whose rank 0 runs on another host.

Rank 0's command (`serve`/`generate` with `-tp N --nnodes H --master-addr A --master-port P`) runs ranks
0..N/H-1 and hosts the rendezvous store. On host K (1..H-1), `warmstart tp-join --master-addr A --master-port P
-tp N --nnodes H --node-rank K` starts ranks K*N/H .. (K+1)*N/H-1 as `python -m warmstart.parallel.worker`
processes with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). They take the
engine config from rank 0's store, so the model, dtype, quantization and budgets are rank 0's (the model path must
exist on this host too), and they exit when rank 0 stops the engine. This command exits with the first non-zero
exit of its ranks (stopping the others), or 0 when all of them finish; SIGTERM and Ctrl-C stop its ranks."""
from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time

log = logging.getLogger("warmstart.parallel")


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    per = world_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def run_node(master_addr: str, master_port: int, world_size: int, nnodes: int, node_rank: int,
             threads_per_rank: int | None, timeout: float) -> int:
    from warmstart import threads
    from warmstart.errors import UserError
    from warmstart.parallel.launcher import rank_env
    if nnodes < 2 or world_size % nnodes or not 1 <= node_rank < nnodes:
        raise UserError(f"tp-join needs --nnodes >= 2 dividing --tensor-parallel-size ({world_size}) and "
                        f"1 <= --node-rank < --nnodes (rank 0's host is node 0); got --nnodes {nnodes}, "
                        f"--node-rank {node_rank}.")
    ranks = node_ranks(world_size, nnodes, node_rank)
    nthreads = threads_per_rank or max(1, threads.available_cpus() // len(ranks))
    base = dict(rank_env(master_addr, master_port, world_size, nthreads), WARMSTART_TP_TIMEOUT=str(timeout))
    base.pop("WARMSTART_TP_CONFIG", None)               # the config comes from rank 0's store
    procs = {r: subprocess.Popen([sys.executable, "-m", "warmstart.parallel.worker"], stdin=subprocess.DEVNULL,
                                 env=dict(base, RANK=str(r), LOCAL_RANK=str(i)))
             for i, r in enumerate(ranks)}
    log.info("tp-join: node %d of %d runs ranks %d..%d (pids %s), %d threads each, rendezvous %s:%d", node_rank,
             nnodes, ranks[0], ranks[-1], [p.pid for p in procs.values()], nthreads, master_addr, master_port)

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
    try:
        while True:
            codes = {r: p.poll() for r, p in procs.items()}
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed:
                r, c = next(iter(failed.items()))
                log.error("tp-join: rank %d exited with %s; stopping this node's other ranks", r, c)
                stop()
                return c if c > 0 else 1
            if all(c == 0 for c in codes.values()):
                log.info("tp-join: every rank of node %d finished", node_rank)
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop()
        return 130
    finally:
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tp-join", help="run this host's ranks of a tensor-parallel engine whose rank 0 runs "
                                       "elsewhere (multi-host)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master-addr", required=True, help="rank 0's host, as given to its --master-addr")
    p.add_argument("--master-port", type=int, required=True, help="rank 0's --master-port")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, required=True, metavar="N",
                   help="the engine's total number of ranks")
    p.add_argument("--nnodes", type=int, required=True, help="hosts the ranks span (rank 0's host included)")
    p.add_argument("--node-rank", type=int, required=True, help="this host's index, 1..nnodes-1")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU threads of each rank (default: this host's available cores split evenly)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for rank 0's rendezvous and for each collective (default 600)")
    p.set_defaults(func=lambda a: run_node(a.master_addr, a.master_port, a.tensor_parallel_size, a.nnodes,
                                           a.node_rank, a.threads_per_rank, a.timeout))
