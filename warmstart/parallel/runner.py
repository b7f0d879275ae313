"""The runners of a tensor-parallel engine: rank 0's broadcasts each batch, the others only run the forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from warmstart.parallel.launcher import RankFailure, RankGroup
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
    the other ranks return nothing (their logits are never computed)."""
    group: RankGroup

    def execute(self, batch: Batch) -> list[ItemResult]:
        if self.group.failure:
            raise RankFailure(self.group.failure)
        if batch.items:
            self.group.send(("batch", shard_items(batch)))
        try:
            return super().execute(batch)
        except RankFailure:
            raise
        except RuntimeError as e:
            # A collective inside the forward failed (torch raises DistBackendError, a RuntimeError), or a rank
            # died meanwhile: either way this engine cannot go on. Anything else is the ordinary error it was.
            import torch.distributed as dist
            self.group._poll()
            if self.group.failure or isinstance(e, dist.DistBackendError):
                raise self.group._failed(e) from None
            raise


class ShardRunner(ModelRunner):
    """Ranks 1..N-1: the forward only (KV writes and the row-parallel all-reduces)."""

    @torch.inference_mode()
    def execute_shard(self, items: list[ShardItem]) -> None:
        if not items:
            return
        input_ids, positions, meta = self._prepare(items)
        self.forward(input_ids, positions, self._attention(meta))
