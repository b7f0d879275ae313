"""Tensor parallelism below the engine: one runner per rank behind the same execute(batch) boundary.

launcher.py  rank processes, the process group, the KV block agreement; runner.py  rank 0's runner that broadcasts
each batch and the other ranks' forward-only runner; sharding.py  the row-parallel all-reduce; worker.py  the loop
ranks 1..N-1 run. What each rank holds (the checkpoint cut, float or quantized) is weights/shard.py."""
