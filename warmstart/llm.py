"""Offline API: LLM(path).generate(prompts, params) and LLM(path).chat(messages, params), in-process."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from warmstart import threads

threads.prepare_env()   # before boot imports torch: its OpenMP runtime reads the wait policy once, at load

from warmstart.boot import Booted, boot  # noqa: E402
from warmstart.config import EngineConfig
from warmstart.prefix_store import PrefixOutcome
from warmstart.runner.batch import TokenLogprobs
from warmstart.sampling_params import SamplingParams
from warmstart.startup.steps import StepTimer

if TYPE_CHECKING:
    from warmstart.runner.grammar import Grammar


@dataclass(frozen=True)
class GenerationOutput:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs]
    num_cached_tokens: int = 0              # prompt tokens whose K/V came from the prefix cache


class LLM:
    """A booted engine in this process. Keyword arguments are EngineConfig fields (dtype, max_model_len, ...)."""

    def __init__(self, model: str, *, timer: StepTimer | None = None, tensor_parallel_size: int | None = None,
                 threads_per_rank: int | None = None, **engine_args):
        """tensor_parallel_size=N launches N-1 rank processes (warmstart/parallel/); close() stops them."""
        if "speculative_model" in engine_args:          # the CLI's name for EngineConfig.draft_model
            engine_args["draft_model"] = engine_args.pop("speculative_model")
        if tensor_parallel_size is not None:
            engine_args["world_size"] = tensor_parallel_size
        if threads_per_rank is not None:
            engine_args["threads"] = threads_per_rank
        self._attach(boot(EngineConfig(model=model, **engine_args), timer))

    @classmethod
    def from_config(cls, config: EngineConfig, timer: StepTimer | None = None) -> "LLM":
        llm = cls.__new__(cls)
        llm._attach(boot(config, timer))
        return llm

    def _attach(self, booted: Booted) -> None:
        self.booted = booted
        self.tokenizer = booted.tokenizer
        self._next_id = 0
        self._closed = False
        self._grammars = None

    def close(self) -> PrefixOutcome | None:
        """Save the most recently used cached prefix blocks (up to prefix_cache_persist bytes) for the next boot
        of this model. Idempotent; None when there was nothing to do (closed already, or persistence off)."""
        if self._closed:
            return None
        self._closed = True
        b = self.booted
        try:
            return b.prefix.save(b.runner, b.engine.blocks) if b.prefix else None
        finally:
            group = getattr(b.runner, "group", None)
            if group is not None:
                group.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile_grammar(self, kind: str, spec) -> "Grammar":
        """A grammar for SamplingParams(grammar=...): kind "json" (a JSON schema), "regex", "choice" or "grammar"
        (Lark)."""
        if self._grammars is None:
            from warmstart.runner.grammar import GrammarCompiler
            engine = self.booted.engine
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), engine.vocab_size,
                                             tuple(sorted(engine.eos_token_ids)))
        return self._grammars.compile(kind, spec)

    @property
    def report(self):
        return self.booted.report

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Prompts are text (tokenized with special tokens) or lists of token ids. Runs them as one batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        return self.generate_ids(ids, params)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """One conversation (a list of {"role", "content"}) or several, formatted with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate_ids([self.tokenizer.encode_chat(c) for c in conversations], params)

    def generate_ids(self, prompts: list[list[int]],
                     params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        engine = self.booted.engine
        for ids in prompts:
            engine.check_prompt(ids)          # all-or-nothing: validate every prompt before queueing any
        seqs = []
        for ids, p in zip(prompts, plist):
            seqs.append(engine.add(f"llm-{self._next_id}", ids, p))
            self._next_id += 1
        while engine.has_unfinished:
            engine.step()
        engine.step()                         # let the runner drop finished requests' state
        return [GenerationOutput(s.prompt_token_ids, s.output_token_ids, s.output_text, s.finish_reason,
                                 list(s.logprobs), list(s.prompt_logprobs), s.num_cached_tokens) for s in seqs]
