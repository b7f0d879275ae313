"""ModelRunner: owns the bound model and the KV tensor, turns a Batch into one forward pass and sampled tokens."""
from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from warmstart.kernels import kv_blocks, kv_row_width
from warmstart.runner.attention import PAGED_MAX_Q, AttentionMeta, PagedAttentionBackend, PagedRows, SeqSlice
from warmstart.runner.batch import Batch, BatchItem, ItemResult
from warmstart.runner.logits_processors import LogitsProcessors
from warmstart.runner.sampler import sample, sample_isolated, token_logprobs
from warmstart.runner.verify import verify
from warmstart.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, kv_dtype: torch.dtype):
        self.model, self.device, self.kv_dtype = model, device, kv_dtype
        self.spec = model.spec
        self.kv: torch.Tensor | None = None
        self.block_size = 0
        self._generators: dict[int, torch.Generator] = {}
        # Unseeded sampled requests draw from this engine-owned generator, never the global RNG: whether a boot
        # ran the profiling forward (a plan miss) or skipped it (a hit) must not change their tokens. Seeded from
        # the boot's --seed (boot.py calls torch.manual_seed(config.seed) before building the runner).
        self._unseeded = torch.Generator(device=device).manual_seed(torch.initial_seed())
        self.processors = LogitsProcessors()
        self.forward = model.forward      # replaced by the compiled forward in compile mode
        self.attention_reference = False  # True: every sequence through gather + SDPA (tests' reference path)
        self._attn: PagedAttentionBackend | None = None   # one per KV tensor: it caches the per-layer cache views

    # -- memory ---------------------------------------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        s = self.spec
        return 2 * s.num_layers * block_size * s.num_kv_heads * kv_row_width(s.head_dim, self.kv_dtype) \
            * self.kv_dtype.itemsize

    def allocate_kv(self, num_blocks: int, block_size: int) -> int:
        """Allocate the zeroed KV cache, returning its bytes. On CPU it is an anonymous mapping: the kernel hands
        out zero pages on first touch, so a 4 GiB cache costs microseconds at boot instead of seconds of memset
        (torch.zeros writes every page). The ledger has reserved the bytes either way. Zeros matter: padded
        decode reads masked slots, and 0 x garbage could be NaN."""
        s = self.spec
        dims = (num_blocks, block_size, s.num_kv_heads, kv_row_width(s.head_dim, self.kv_dtype))
        if self.device.type == "cpu":
            nbytes = self.kv_block_bytes(block_size) * num_blocks
            self._kv_mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            storage = torch.frombuffer(self._kv_mapping, dtype=self.kv_dtype)
        else:
            storage = torch.zeros(2 * s.num_layers * math.prod(dims), dtype=self.kv_dtype, device=self.device)
        self.kv = kv_blocks(storage, (2, s.num_layers), *dims)   # [2, L, blocks, bs, Hkv, row], head-major memory
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
        hidden = self._run_forward(batch, input_ids, positions, meta)
        return self._postprocess(batch.items, hidden)

    def _run_forward(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMeta) -> torch.Tensor:
        """The step's forward, once its inputs are prepared (a tensor-parallel rank 0 sends the batch here)."""
        return self.forward(input_ids, positions, self._attention(meta))

    def _attention(self, meta: AttentionMeta) -> PagedAttentionBackend:
        """The step's attention backend: one per KV tensor (it caches the per-layer cache views), given this
        step's metadata."""
        if self._attn is None or self._attn.kv is not self.kv:
            self._attn = PagedAttentionBackend(self.kv, self.block_size)
        self._attn.meta = meta
        return self._attn

    def _prepare(self, items: list[BatchItem]) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
        """Token ids, positions and attention metadata for one step. The work is O(new tokens + block-table
        entries): no per-slot context tensors, except for the few long chunks over a cached prefix (gather)."""
        bs = self.block_size
        tokens, positions, slots, seqs = [], [], [], []
        paged_items: list[tuple[int, BatchItem]] = []
        for it in items:
            n, ctx = len(it.token_ids), it.start + len(it.token_ids)
            if n == 1:
                slots.append(it.block_table[it.start // bs] * bs + it.start % bs)
            else:
                pos = torch.arange(it.start, ctx)
                slots.extend((torch.tensor(it.block_table)[pos // bs] * bs + pos % bs).tolist())
            if it.start == 0:
                route = "fresh"
            elif n <= PAGED_MAX_Q and not self.attention_reference:
                route = "paged"
                paged_items.append((len(tokens), it))
            else:
                route = "gather"
            seq = SeqSlice(len(tokens), n, ctx, route=route)
            if route == "gather":
                table = torch.tensor(it.block_table, dtype=torch.long)
                seq.slots = (table[:, None] * bs + torch.arange(bs)[None, :]).flatten()[:ctx].to(self.device)
            seqs.append(seq)
            tokens.extend(it.token_ids)
            positions.extend(range(it.start, ctx))
        meta = AttentionMeta(torch.tensor(slots, dtype=torch.long, device=self.device), seqs)
        if paged_items:
            meta.paged = self._paged_rows(paged_items, len(tokens))
        return (torch.tensor(tokens, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta)

    def _paged_rows(self, paged: list[tuple[int, BatchItem]], total_rows: int) -> PagedRows:
        width = max(-(-(it.start + len(it.token_ids)) // self.block_size) for _, it in paged)
        tables = torch.zeros(len(paged), width, dtype=torch.int32)
        rows, seq_idx, ctx_lens = [], [], []
        for s, (first, it) in enumerate(paged):
            used = -(-(it.start + len(it.token_ids)) // self.block_size)
            tables[s, :used] = torch.tensor(it.block_table[:used], dtype=torch.int32)
            for j in range(len(it.token_ids)):
                rows.append(first + j)
                seq_idx.append(s)
                ctx_lens.append(it.start + j + 1)
        dev = self.device
        row_index = None if len(rows) == total_rows else torch.tensor(rows, dtype=torch.long, device=dev)
        return PagedRows(row_index, tables.to(dev), torch.tensor(seq_idx, dtype=torch.int32, device=dev),
                         torch.tensor(ctx_lens, dtype=torch.int32, device=dev))

    def _postprocess(self, items: list[BatchItem], hidden: torch.Tensor) -> list[ItemResult]:
        # Rows that need logits: the last row of each sampling item, and every prompt row whose successor is a
        # prompt token for items that asked for prompt logprobs. One lm_head call covers them all.
        rows, row = [], 0
        sample_row: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int]] = {}
        verify_rows: dict[int, int] = {}       # speculative items: logits at every fed row, from this row on
        for i, it in enumerate(items):
            n = len(it.token_ids)
            if it.draft_token_ids:
                verify_rows[i] = len(rows)
                rows.extend(range(row, row + n))
                row += n
                continue
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
        logits = self.model.compute_logits(_take_rows(hidden, rows))
        sampled_idx = list(sample_row.values())
        params = [items[i].params for i in sample_row]
        gens = [lambda it=items[i]: self._generator(it) for i in sample_row]
        sampled_items = [items[i] for i in sample_row]
        tokens: list = []
        if sampled_idx:
            processed, failed = self._process(_take_rows(logits, sampled_idx), sampled_items)
            tokens = [failed.get(j, t) for j, t in enumerate(sample_isolated(processed, params, gens))]
            ok = [(it, t) for it, t in zip(sampled_items, tokens) if not isinstance(t, Exception)]
            self.processors.accept([it for it, _ in ok], [t for _, t in ok])
        want_lp = any(it.params.logprobs is not None for it in items) or prompt_rows
        logprobs = logits.log_softmax(dim=-1) if want_lp else None
        results = []
        token_of = dict(zip(sample_row, tokens))
        for i, it in enumerate(items):
            # Per item, so that one request's failure (a bad value that got past validation, a bug its options
            # reach) fails that request alone.
            try:
                if i in verify_rows:
                    results.append(self._verify_item(it, logits, verify_rows[i], logprobs))
                    continue
                if isinstance(token_of.get(i), Exception):
                    raise token_of[i]
                results.append(self._item_result(it, token_of.get(i), logprobs, sample_row.get(i),
                                                 prompt_rows.get(i)))
            except Exception as e:
                results.append(ItemResult(None, error=f"sampling failed: {type(e).__name__}: {e}"))
        return results

    def _verify_item(self, it: BatchItem, logits: torch.Tensor, first: int,
                     logprobs: torch.Tensor | None) -> ItemResult:
        n = len(it.token_ids)
        tokens = verify(logits[first:first + n], list(it.draft_token_ids), it.draft_probs, it.params,
                        self._generator(it))
        lps = [token_logprobs(logprobs[first + j], t, it.params.logprobs) if it.params.logprobs is not None
               else None for j, t in enumerate(tokens)]
        return ItemResult(tokens[0], lps[0], None, token_ids=tokens, token_logprobs=lps)

    @staticmethod
    def _item_result(it: BatchItem, token: int | None, logprobs: torch.Tensor | None, row: int | None,
                     prompt_rows: tuple[int, int] | None) -> ItemResult:
        lp = None
        if token is not None and it.params.logprobs is not None:
            lp = token_logprobs(logprobs[row], token, it.params.logprobs)
        plp = None
        if prompt_rows is not None:
            first, count = prompt_rows
            nexts = it.token_ids[1:] + ([it.next_prompt_token] if it.next_prompt_token is not None else [])
            plp = [token_logprobs(logprobs[first + j], nexts[j], it.params.prompt_logprobs) for j in range(count)]
        return ItemResult(token, lp, plp)

    def _process(self, logits: torch.Tensor, items: list[BatchItem]) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Logits processors (penalties, bias, grammar masks) for the sampling rows; a processor that raises fails
        only its own row (the batch is processed at once, and row by row only if that raises)."""
        try:
            return self.processors.apply(logits, items), {}
        except Exception:
            pass
        out, failed = logits.clone(), {}
        for j, it in enumerate(items):
            try:
                out[j:j + 1] = self.processors.apply(logits[j:j + 1], [it])
            except Exception as e:
                failed[j] = e
        return out, failed

    def _generator(self, item: BatchItem) -> torch.Generator | None:
        if item.params.greedy:
            return None
        if item.params.seed is None:
            return self._unseeded
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
            seqs.append(SeqSlice(start, n, n))
            start += n
        attn = PagedAttentionBackend(None, 0)
        attn.meta = AttentionMeta(torch.empty(0), seqs)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        hidden = self.forward(ids, positions, attn)
        rows = min(max_num_seqs, num_tokens)
        if rows < num_tokens:
            # A decode-sized step too: the quantized linears pick their kernel by row count, and the panel kernel's
            # per-thread scratch (kernels.panel_threshold) must exist, and be counted, before the KV cache is sized.
            del hidden
            attn.meta = AttentionMeta(torch.empty(0), [SeqSlice(0, rows, rows)])
            hidden = self.forward(ids[:rows], positions[:rows], attn)
        logits = self.model.compute_logits(hidden[-rows:])
        p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        scratch = torch.Generator(device=self.device)          # profiling draws must not move any RNG in use
        sample(logits, [p] * rows, [scratch] * rows)
        logits.log_softmax(dim=-1)


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], or t itself when rows are all of its rows in order (a decode step: no index copy, 5-20 us at batch 1).
    Callers do not modify the result in place."""
    if rows == list(range(t.shape[0])):
        return t
    return t[torch.tensor(rows, device=t.device)]
