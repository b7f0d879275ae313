"""Prometheus metrics on the server's own registry (never the global one, so two apps in a process never collide).

Request counts and latencies, tokens, KV usage, the prefix cache (cached prompt tokens, hit rate, blocks), and the
boot: startup step durations, plan status, weight source and prefix blocks restored. The engine thread updates the
engine gauges after each step; everything else is updated on the loop.

Beside warmstart's own names, the vLLM names (vllm:*, with a model_name label) that the vLLM Grafana dashboard,
KEDA/HPA rules and gateways already scrape. Same meanings as vLLM's: kv_cache_usage_perc is a ratio in [0, 1]."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

if TYPE_CHECKING:
    from warmstart.engine.engine import Engine, RequestOutput
    from warmstart.startup.report import StartupReport

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/ready", "/startup",
          "/metrics", "/tokenize", "/detokenize", "/tokenizer_info", "/version")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

# A *_created sample per counter and histogram doubles the series for nothing a dashboard reads. The switch is
# process-wide in prometheus_client; the server process owns its metrics, so that is the scope wanted.
disable_created_metrics()


class VllmMetrics:
    """vLLM-compatible series, each with the model_name label."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        m = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests being decoded or prefilled", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for admission", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 means full", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", m, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute)", m, registry=r)
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)             # exported as 0 from the start, as a dashboard expects
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("warmstart_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.request_latency = Histogram("warmstart_request_latency_seconds",
                                         "Generation requests, arrival to last byte", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("warmstart_time_to_first_token_seconds", "Arrival to the first generated token",
                              ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests_finished = Counter("warmstart_requests_finished", "Generation requests by outcome",
                                         ["route", "outcome"], registry=r)
        self.prompt_tokens = Counter("warmstart_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("warmstart_generation_tokens", "Tokens generated", registry=r)
        self.kv_blocks_used = Gauge("warmstart_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_allocated = Gauge("warmstart_kv_blocks_allocated", "KV cache blocks allocated at boot",
                                         registry=r)
        self.kv_usage = Gauge("warmstart_kv_usage_ratio", "KV cache blocks in use / allocated", registry=r)
        self.running = Gauge("warmstart_requests_running", "Sequences being decoded or prefilled", registry=r)
        self.waiting = Gauge("warmstart_requests_waiting", "Sequences queued for admission", registry=r)
        self.ready = Gauge("warmstart_ready", "1 once boot has finished and requests are served", registry=r)
        self.startup_seconds = Gauge("warmstart_startup_seconds", "Process start to ready", registry=r)
        self.startup_step = Gauge("warmstart_startup_step_seconds", "Duration of each boot step", ["step"],
                                  registry=r)
        self.plan_status = Gauge("warmstart_startup_plan", "1 for this boot's startup plan status", ["status"],
                                 registry=r)
        self.weights_source = Gauge("warmstart_weights_source", "1 for where this boot's weights came from",
                                    ["source"], registry=r)
        self.kv_cache_bytes = Gauge("warmstart_kv_cache_bytes", "KV cache bytes allocated at boot", registry=r)
        self.step_threads = Gauge("warmstart_step_threads", "Threads the last engine step ran on (fewer while the "
                                  "host is busy: runner/step_threads.py)", registry=r)
        self.cached_prompt_tokens = Counter("warmstart_cached_prompt_tokens",
                                            "Prompt tokens whose K/V came from the prefix cache", registry=r)
        self.prefix_queried_tokens = Counter("warmstart_prefix_cache_queried_tokens",
                                             "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge("warmstart_prefix_cache_hit_rate",
                                     "Cached / looked-up prompt tokens since boot", registry=r)
        self.prefix_blocks = Gauge("warmstart_prefix_cache_blocks", "KV blocks registered in the prefix cache",
                                   registry=r)
        self.prefix_restored_blocks = Gauge("warmstart_prefix_cache_restored_blocks",
                                            "Prefix cache blocks restored from disk at boot", registry=r)
        self._prefix_seen = (0, 0)                 # (queried, hit) tokens already added to the counters
        self.vllm = VllmMetrics(r, model_name)
        self._preemptions_seen = 0
        # speculative decoding (zero when it is off)
        self.spec_proposed = Counter("warmstart_spec_proposed_tokens", "Tokens proposed for verification",
                                     registry=r)
        self.spec_accepted = Counter("warmstart_spec_accepted_tokens", "Proposed tokens the target accepted",
                                     registry=r)
        self.spec_acceptance = Gauge("warmstart_spec_acceptance_rate", "Accepted / proposed tokens", registry=r)
        self.spec_tokens_per_forward = Gauge("warmstart_spec_tokens_per_forward",
                                             "Mean tokens committed per sequence per target forward that verified "
                                             "proposals", registry=r)
        self._spec_seen = (0, 0)

    def record_boot(self, report: "StartupReport", num_blocks: int) -> None:
        self.startup_seconds.set(report.wall_seconds)
        for step in report.steps:
            self.startup_step.labels(step=step["name"]).set(step["seconds"])
        self.plan_status.labels(status=report.plan.status).set(1)
        self.weights_source.labels(source=report.weights.source).set(1)
        self.kv_blocks_allocated.set(num_blocks)
        self.kv_cache_bytes.set(report.memory.kv_cache_bytes)
        self.prefix_restored_blocks.set(report.extra.get("prefix_restore", {}).get("blocks", 0))
        self.ready.set(1)

    def on_step(self, engine: "Engine", outputs: list["RequestOutput"]) -> None:
        """Called on the engine thread after every step (prometheus_client metrics are thread-safe)."""
        used, total = engine.blocks.num_used, engine.blocks.num_blocks
        self.kv_blocks_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        team = getattr(engine.step_threads, "team", None)
        if team is not None:
            self.step_threads.set(team)
        v, name = self.vllm, self.vllm.model_name
        v.running.labels(name).set(len(engine.scheduler.running))
        v.waiting.labels(name).set(len(engine.scheduler.waiting))
        v.kv_usage.labels(name).set(used / total if total else 0.0)
        preemptions = getattr(engine, "num_preemptions", 0)
        if preemptions > self._preemptions_seen:
            v.preemptions.labels(name).inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        if outputs:
            n = sum(len(o.new_token_ids) for o in outputs)
            self.generation_tokens.inc(n)
            v.generation_tokens.labels(name).inc(n)
        stats = engine.scheduler.prefix_stats
        queried, hit = self._prefix_seen
        if stats.queried_tokens != queried:
            self.prefix_queried_tokens.inc(stats.queried_tokens - queried)
            self.cached_prompt_tokens.inc(stats.hit_tokens - hit)
            self._prefix_seen = (stats.queried_tokens, stats.hit_tokens)
            self.prefix_hit_rate.set(stats.hit_rate)
        self.prefix_blocks.set(engine.blocks.num_cached)
        spec = getattr(engine, "spec_stats", None)
        if spec is not None and (spec.proposals, spec.accepted) != self._spec_seen:
            proposed, accepted = self._spec_seen
            self.spec_proposed.inc(max(0, spec.proposals - proposed))
            self.spec_accepted.inc(max(0, spec.accepted - accepted))
            self._spec_seen = (spec.proposals, spec.accepted)
            self.spec_acceptance.set(spec.acceptance_rate)
            self.spec_tokens_per_forward.set(spec.mean_tokens_per_forward)

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)
        self.vllm.prompt_tokens.labels(self.vllm.model_name).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency, time to first token and outcome of one generation request."""

    def __init__(self, metrics: Metrics, route: str):
        self.metrics, self.route = metrics, route
        self.start = time.perf_counter()
        self._last: dict[int, float] = {}          # choice -> when its previous tokens arrived
        self._vllm = metrics.vllm

    def token(self, count: int = 1, choice: int = 0) -> None:
        """count new tokens of one choice arrived now. Inter-token gaps are per choice, so n > 1 choices decoded
        side by side do not read as gaps of zero."""
        now = time.perf_counter()
        name = self._vllm.model_name
        if not self._last:
            self.metrics.ttft.labels(route=self.route).observe(now - self.start)
            self._vllm.ttft.labels(name).observe(now - self.start)
        last = self._last.get(choice)
        if last is not None:
            gap = (now - last) / max(count, 1)
            for _ in range(max(count, 1)):
                self._vllm.itl.labels(name).observe(gap)
        self._last[choice] = now

    def finished(self, reason: str | None) -> None:
        """One choice finished with this finish_reason (aborts are not successes)."""
        if reason in ("stop", "length"):
            self._vllm.success.labels(self._vllm.model_name, reason).inc()

    def done(self, outcome: str) -> None:
        elapsed = time.perf_counter() - self.start
        self.metrics.request_latency.labels(route=self.route).observe(elapsed)
        self.metrics.requests_finished.labels(route=self.route, outcome=outcome).inc()
        if outcome == "finished":
            self._vllm.e2e.labels(self._vllm.model_name).observe(elapsed)
