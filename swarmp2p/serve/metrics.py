"""What the HTTP API counts, rendered in the Prometheus text format (version 0.0.4) for
``GET /metrics``: requests by status, prompt and generated tokens, time-to-first-token and
inter-token histograms, and per served model its queue depth, running sessions, the prefix
cache's lookups, hits, hit rate and reused prompt tokens, the batch size of the latest decode
step at each stage, and its speculative decoding's acceptance rate and mean tokens per lap.

Written here rather than with ``prometheus_client``: it is a few counters and two histograms
with fixed buckets, the daemon (which will mount this API) takes no new dependency for it, and
each app keeps its own numbers (``prometheus_client`` defaults to one process-wide registry).
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Iterable, Sequence
from typing import Any

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Time to first token: a loopback ring of a small model answers in ~0.05-0.5 s."""
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
"""Between two tokens of one request: tens of ms for a small model on CPUs."""


class Histogram:
    """Cumulative buckets, sum and count of observed values (one label set)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            yield f'{name}_bucket{{{labels}{"," if labels else ""}le="{le}"}} {running}'
        yield f"{name}_sum{{{labels}}} {self.sum!r}"
        yield f"{name}_count{{{labels}}} {self.count}"


def _labels(**values: Any) -> str:
    def escape(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{k}="{escape(v)}"' for k, v in values.items())


class ServeMetrics:
    """The API's counters; safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()
        """(model, endpoint, status) -> requests answered."""
        self.prompt_tokens: collections.Counter = collections.Counter()
        self.generation_tokens: collections.Counter = collections.Counter()
        self.ttft: dict[str, Histogram] = {}
        self.itl: dict[str, Histogram] = {}

    def request(self, model: str, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[model, endpoint, status] += 1

    def tokens(self, model: str, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens[model] += prompt
            self.generation_tokens[model] += generated

    def first_token(self, model: str, seconds: float) -> None:
        with self._lock:
            self.ttft.setdefault(model, Histogram(TTFT_BUCKETS_S)).observe(seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        with self._lock:
            self.itl.setdefault(model, Histogram(ITL_BUCKETS_S)).observe(seconds)

    def render(self, models: Iterable[Any]) -> str:
        """The exposition text; ``models`` are the ServedModels whose rings are reported."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            family("swarm_requests_total", "counter", "HTTP generation requests answered")
            for (model, endpoint, status), n in sorted(self.requests.items()):
                out.append(
                    f"swarm_requests_total{{{_labels(model=model, endpoint=endpoint, status=status)}}} {n}"
                )
            per_model = (
                (
                    "swarm_prompt_tokens_total",
                    "counter",
                    "prompt tokens of answered requests",
                    self.prompt_tokens,
                ),
                (
                    "swarm_generation_tokens_total",
                    "counter",
                    "tokens generated",
                    self.generation_tokens,
                ),
                (
                    "swarm_time_to_first_token_seconds",
                    "histogram",
                    "from a request's arrival to its first token",
                    self.ttft,
                ),
                (
                    "swarm_inter_token_latency_seconds",
                    "histogram",
                    "between two consecutive tokens of one request",
                    self.itl,
                ),
            )
            for name, kind, help_, values in per_model:
                family(name, kind, help_)
                for model, value in sorted(values.items()):
                    labels = _labels(model=model)
                    if kind == "histogram":
                        out.extend(value.lines(name, labels))
                    else:
                        out.append(f"{name}{{{labels}}} {value}")
        models = list(models)
        gauges = (
            ("swarm_queue_depth", "requests waiting for a session slot", "queue_depth"),
            ("swarm_active_sessions", "sessions in the ring", "active"),
            ("swarm_max_sessions", "the batch bound (session slots)", "max_sessions"),
        )
        for name, help_, attr in gauges:
            family(name, "gauge", help_)
            for m in models:
                out.append(f"{name}{{{_labels(model=m.name)}}} {getattr(m.client, attr)}")
        speculation = (
            (
                "swarm_speculative_acceptance_ratio",
                "gauge",
                "share of drafted tokens the last stage accepted (speculative decoding)",
                "acceptance",
            ),
            (
                "swarm_speculative_tokens_per_lap",
                "gauge",
                "mean tokens a decode lap of the ring gave a session (1 without speculation)",
                "tokens_per_lap",
            ),
            (
                "swarm_speculative_drafted_tokens_total",
                "counter",
                "tokens drafted for verification",
                "drafted",
            ),
        )
        stats = {m.name: m.client.spec_stats() for m in models}
        for name, kind, help_, key in speculation:
            family(name, kind, help_)
            for m in models:
                out.append(f"{name}{{{_labels(model=m.name)}}} {stats[m.name][key]}")
        prefix = (
            ("swarm_prefix_cache_lookups_total", "counter", "prompts looked up", "lookups"),
            ("swarm_prefix_cache_hits_total", "counter", "prompts reusing cached blocks", "hits"),
            ("swarm_prefix_cache_hit_rate", "gauge", "hits over lookups", "hit_rate"),
            (
                "swarm_prefix_cache_reused_tokens_total",
                "counter",
                "prompt tokens not prefilled again",
                "reused_tokens",
            ),
            ("swarm_prefix_cache_blocks", "gauge", "prompt blocks every stage holds", "blocks"),
        )
        stats = {m.name: getattr(m.client, "prefix_stats", None) for m in models}
        for name, kind, help_, key in prefix:
            family(name, kind, help_)
            for model, values in stats.items():
                if values is not None:
                    out.append(f"{name}{{{_labels(model=model)}}} {values[key]}")
        family("swarm_stage_batch_size", "gauge", "rows of the latest decode step at a stage")
        for m in models:
            for stage, size in enumerate(m.client.stage_batch_sizes):
                out.append(f"swarm_stage_batch_size{{{_labels(model=m.name, stage=stage)}}} {size}")
        return "\n".join(out) + "\n"
