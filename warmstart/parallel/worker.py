"""Ranks 1..N-1 of a tensor-parallel engine: `python -m warmstart.parallel.worker`, launched by rank 0 (or, on
another host, by `warmstart tp-join`: parallel/node.py).

Reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the engine config rank 0 passed
(WARMSTART_TP_CONFIG, JSON; a rank on another host reads it from rank 0's rendezvous store). Boots its shard through the same pipeline as rank 0 (its own plan, its own ledger),
agrees the KV block count, then loops: receive a message from rank 0, run it, repeat until ("stop",).
The OpenMP wait policy and thread count are set before torch loads (threads.configure), as the CLI does."""
from __future__ import annotations

import json
import logging
import os
import sys


def main() -> int:
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO if os.environ.get("WARMSTART_TP_QUIET") is None else logging.WARNING,
                        stream=sys.stderr, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    from warmstart import threads
    threads.configure(int(os.environ.get("OMP_NUM_THREADS", "1")))    # before torch
    from warmstart.parallel import launcher
    launcher.install_signal_handlers()
    launcher.watch_parent()
    from warmstart.config import EngineConfig
    from warmstart.errors import UserError, user_error
    try:
        if launcher.ENV_CONFIG in os.environ:           # launched by rank 0 on its own host
            d = json.loads(os.environ[launcher.ENV_CONFIG])
        else:                                           # launched by `warmstart tp-join` on another host
            d = launcher.fetch_config(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      int(os.environ["WORLD_SIZE"]), float(os.environ.get("WARMSTART_TP_TIMEOUT",
                                                                                            "600")))
            d.update(master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
        d.update(rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        config = EngineConfig(**d)
        return serve_rank(config)
    except UserError as e:
        print(f"error: rank {rank}: {user_error(e)}", file=sys.stderr, flush=True)
        return 2
    except launcher.RankFailure as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:                  # rank 0 went away mid-collective, or a bug
        import torch.distributed as dist
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1 if dist.is_initialized() else 2


def serve_rank(config) -> int:
    from warmstart.boot import boot_shard, finish_shard
    from warmstart.parallel import launcher
    from warmstart.startup.steps import StepTimer
    timer = StepTimer.from_process_start()
    with timer.step("rendezvous"):
        group = launcher.join(config)
    shard = boot_shard(config, timer, group)
    runner = shard.runner
    while True:
        msg = group.recv()
        kind = msg[0]
        if kind == "batch":
            runner.execute_shard(msg[1])
        elif kind == "report":
            report = finish_shard(shard, timer)
            group.all_gather(report.to_dict())
        elif kind == "stop":
            group.closed = True
            return 0


def _exit(code: int) -> None:
    """End the rank without the interpreter's teardown. A rank has nothing to clean up (rank 0 owns the engine; the
    OS frees the shard), and torch's process group torn down at exit, after rank 0 has closed its side, could abort
    the process (SIGABRT, "terminate called without an active exception"): a rank joined with `warmstart tp-join`
    ends on its own after ("stop",) and hit it in 1-2 of 6 runs of test_ranks_of_a_second_host_join_with_tp_join
    (ranks on rank 0's host end by os._exit already, on its SIGTERM)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
