"""ModelRunner: owns the bound model and the KV tensor, turns a Batch into one forward pass and sampled tokens."""
from __future__ import annotations

import mmap

import torch
from torch import nn

from warmstart.runner.attention import AttentionMeta, PagedAttentionBackend, SeqSlice
from warmstart.runner.batch import Batch, BatchItem, ItemResult
from warmstart.runner.logits_processors import LogitsProcessors
from warmstart.runner.sampler import sample, token_logprobs
from warmstart.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, kv_dtype: torch.dtype):
        self.model, self.device, self.kv_dtype = model, device, kv_dtype
        self.spec = model.spec
        self.kv: torch.Tensor | None = None
        self.block_size = 0
        self._generators: dict[int, torch.Generator] = {}
        self.processors = LogitsProcessors()
        self.forward = model.forward      # replaced by the compiled forward in compile mode

    # -- memory ---------------------------------------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        return self.spec.kv_bytes_per_token * block_size * torch.empty((), dtype=self.kv_dtype).element_size()

    def allocate_kv(self, num_blocks: int, block_size: int) -> int:
        """Allocate the zeroed KV cache, returning its bytes. On CPU it is an anonymous mapping: the kernel hands
        out zero pages on first touch, so a 4 GiB cache costs microseconds at boot instead of seconds of memset
        (torch.zeros writes every page). The ledger has reserved the bytes either way. Zeros matter: padded
        decode reads masked slots, and 0 x garbage could be NaN."""
        s = self.spec
        shape = (2, s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        if self.device.type == "cpu":
            nbytes = self.kv_block_bytes(block_size) * num_blocks
            self._kv_mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.kv = torch.frombuffer(self._kv_mapping, dtype=self.kv_dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.block_size = block_size
        return self.kv.numel() * self.kv.element_size()

    # -- execution ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[ItemResult]:
        for seq_id in batch.finished_seq_ids:
            self._generators.pop(seq_id, None)
        self.processors.drop(batch.finished_seq_ids)
        if not batch.items:
            return []
        input_ids, positions, meta = self._prepare(batch.items)
        attn = PagedAttentionBackend(self.kv, self.block_size)
        attn.meta = meta
        hidden = self.forward(input_ids, positions, attn)
        return self._postprocess(batch.items, hidden)

    def _prepare(self, items: list[BatchItem]) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
        bs = self.block_size
        tokens, positions, slots, seqs = [], [], [], []
        for it in items:
            n, ctx = len(it.token_ids), it.start + len(it.token_ids)
            table = torch.tensor(it.block_table, dtype=torch.long)
            ctx_slots = (table[:, None] * bs + torch.arange(bs)[None, :]).flatten()[:ctx]
            seqs.append(SeqSlice(len(tokens), n, ctx, ctx_slots.to(self.device)))
            tokens.extend(it.token_ids)
            positions.extend(range(it.start, ctx))
            slots.append(ctx_slots[it.start:])
        meta = AttentionMeta(torch.cat(slots).to(self.device), seqs)
        if all(len(it.token_ids) == 1 for it in items):
            # Pad every context to the longest with slot 0 (masked out), so one SDPA call serves the batch.
            width = max(s.ctx_len for s in seqs)
            padded = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                padded[i, :s.ctx_len] = s.slots
            meta.decode_slots = padded.to(self.device)
            if any(s.ctx_len != width for s in seqs):
                lens = torch.tensor([s.ctx_len for s in seqs])
                meta.decode_mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :].to(self.device)
        return (torch.tensor(tokens, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta)

    def _postprocess(self, items: list[BatchItem], hidden: torch.Tensor) -> list[ItemResult]:
        # Rows that need logits: the last row of each sampling item, and every prompt row whose successor is a
        # prompt token for items that asked for prompt logprobs. One lm_head call covers them all.
        rows, row = [], 0
        sample_row: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int]] = {}
        for i, it in enumerate(items):
            n = len(it.token_ids)
            if it.params.prompt_logprobs is not None and it.start < it.prompt_len - 1:
                count = min(n, it.prompt_len - 1 - it.start)
                prompt_rows[i] = (len(rows), count)
                rows.extend(range(row, row + count))
            if it.sample:
                sample_row[i] = len(rows)
                rows.append(row + n - 1)
            row += n
        if not rows:
            return [ItemResult(None) for _ in items]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        sampled_idx = list(sample_row.values())
        params = [items[i].params for i in sample_row]
        gens = [self._generator(items[i]) for i in sample_row]
        sampled_items = [items[i] for i in sample_row]
        tokens = sample(self.processors.apply(logits[sampled_idx], sampled_items), params, gens) if sampled_idx else []
        self.processors.accept(sampled_items, tokens)
        want_lp = any(it.params.logprobs is not None for it in items) or prompt_rows
        logprobs = logits.log_softmax(dim=-1) if want_lp else None
        results = []
        token_of = dict(zip(sample_row, tokens))
        for i, it in enumerate(items):
            lp = None
            if i in token_of and it.params.logprobs is not None:
                lp = token_logprobs(logprobs[sample_row[i]], token_of[i], it.params.logprobs)
            plp = None
            if i in prompt_rows:
                first, count = prompt_rows[i]
                nexts = it.token_ids[1:] + ([it.next_prompt_token] if it.next_prompt_token is not None else [])
                plp = [token_logprobs(logprobs[first + j], nexts[j], it.params.prompt_logprobs)
                       for j in range(count)]
            results.append(ItemResult(token_of.get(i), lp, plp))
        return results

    def _generator(self, item: BatchItem) -> torch.Generator | None:
        if item.params.seed is None or item.params.greedy:
            return None
        gen = self._generators.get(item.seq_id)
        if gen is None:
            gen = self._generators[item.seq_id] = torch.Generator(device=self.device).manual_seed(item.params.seed)
        return gen

    # -- profiling ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, max_model_len: int, max_num_seqs: int) -> None:
        """The worst step the scheduler can build: num_tokens packed into sequences of at most max_model_len,
        without a KV cache, then logits and sampling for up to max_num_seqs rows."""
        lens, left = [], num_tokens
        while left > 0:
            lens.append(min(left, max_model_len))
            left -= lens[-1]
        seqs, start = [], 0
        for n in lens:
            seqs.append(SeqSlice(start, n, n, torch.empty(0)))
            start += n
        attn = PagedAttentionBackend(None, 0)
        attn.meta = AttentionMeta(torch.empty(0), seqs)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        hidden = self.forward(ids, positions, attn)
        rows = min(max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        sample(logits, [p] * rows, [None] * rows)
        logits.log_softmax(dim=-1)
