"""The runners of a tensor-parallel engine: rank 0's broadcasts each batch, the others only run the forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from warmstart.parallel.launcher import RankFailure, RankGroup
from warmstart.runner.attention import AttentionMeta
from warmstart.runner.batch import Batch, ItemResult
from warmstart.runner.runner import ModelRunner


@dataclass(frozen=True)
class ShardItem:
    """What a rank other than 0 needs of a BatchItem: where the tokens go. Sampling parameters, histories and
    grammars stay on rank 0 (they are neither needed nor cheap to send, and a compiled grammar does not pickle)."""
    token_ids: list[int]
    start: int
    block_table: list[int]


def shard_items(batch: Batch) -> list[ShardItem]:
    return [ShardItem(it.token_ids, it.start, it.block_table) for it in batch.items]


class DistributedRunner(ModelRunner):
    """Rank 0: the engine's runner. execute() sends the batch to every rank, then runs its own shard and samples;
    the other ranks return nothing (their logits are never computed). The base's execute runs the step; rank 0
    sends the batch between preparing the inputs and its forward (_run_forward).

    Once the ranks have the batch they are committed to its forward, and its collectives must pair up step by
    step. So rank 0 prepares the step's inputs before it sends anything: a failure there (one request's input)
    leaves the ranks untouched, and the engine retries the items one by one as it does on one device. A failure
    inside rank 0's forward leaves the ranks waiting at a collective rank 0 will not reach; going on would pair
    that step's collectives with the next one's, so it stops the whole group, with the reason. Sampling runs
    after the forward's last collective, on rank 0 alone: its failures stay per request."""
    group: RankGroup

    def execute(self, batch: Batch) -> list[ItemResult]:
        if self.group.failure:
            raise RankFailure(self.group.failure)
        return super().execute(batch)

    def _run_forward(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMeta) -> torch.Tensor:
        self.group.send(("batch", shard_items(batch)))
        try:
            return super()._run_forward(batch, input_ids, positions, meta)
        except Exception as e:
            # A collective that failed (torch's DistBackendError) almost always means a rank died: give its exit
            # a moment to show, so the reason names it. Any other failure is rank 0's own.
            import torch.distributed as dist
            self.group._poll(wait=2.0 if isinstance(e, dist.DistBackendError) else 0.0)
            raise self.group.fail(f"rank 0's forward failed ({type(e).__name__}: {e})") from e


class ShardRunner(ModelRunner):
    """Ranks 1..N-1: the forward only (KV writes and the row-parallel all-reduces)."""

    @torch.inference_mode()
    def execute_shard(self, items: list[ShardItem]) -> None:
        if not items:
            return
        input_ids, positions, meta = self._prepare(items)
        self.forward(input_ids, positions, self._attention(meta))
