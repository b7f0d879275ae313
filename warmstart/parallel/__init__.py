"""Tensor parallelism below the engine: one runner per rank behind the same execute(batch) boundary.

sharding.py  what each rank holds (Megatron-style column/row split, replicated embedding and LM head) and the
             row-parallel linear that all-reduces; launcher.py  rank processes, the process group, the rank-0
             runner that broadcasts each batch; worker.py  the loop ranks 1..N-1 run."""
