"""/metrics with vLLM's names, types, labels and buckets, so vLLM dashboards work unchanged.

Two sources:
* per-request observations (TTFT, inter-token latency, phase times, finish
  reasons) made by the server as outputs stream past, from the engine's own
  step times (``RequestOutput.time``) and phase timings (``RequestMetrics``);
* engine state (running, waiting, KV usage) and the engine's cumulative
  counters (preemptions, prefix cache, tokens), read at scrape time by a
  collector, so they are never stale and cost nothing between scrapes.

Each app has its own registry: several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.engine.client import EngineClient, EngineStats, ReplicaSet
from tandem.outputs import RequestMetrics

LABELS = ["model_name", "engine"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        # No *_created series (process-wide): vLLM's dashboards do not use them and
        # they double the scrape.
        disable_created_metrics()
        self.engine = engine
        self.registry = CollectorRegistry()
        self.label_values = (model_name, "0")
        r, lv = self.registry, self.label_values

        def hist(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        max_len = engine.model_info.max_model_len
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds. "
                         "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens",
                                  "Number of prefill tokens processed.",
                                  build_1_2_5_buckets(max_len))
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.",
                                      build_1_2_5_buckets(max_len))
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.rejections = Counter(
            "tandem:queue_rejections", "Requests answered 503 because the waiting queue "
            "(--max-queue) was full.", LABELS, registry=r).labels(*lv)
        self.aborts = Counter(
            "tandem:request_aborts", "Engine requests aborted before they finished "
            "(client disconnected or the server gave up on them).", LABELS, registry=r,
        ).labels(*lv)
        self.kv_transfer_time = hist(
            "tandem:kv_transfer_time_seconds", "Disaggregated prefill: moving a request's "
            "prompt KV from its prefill replica into its decode replica's pool.", TTFT_BUCKETS)
        self.kv_transfer_bytes = Counter(
            "tandem:kv_transfer_bytes", "Disaggregated prefill: KV bytes moved from prefill "
            "to decode replicas.", LABELS, registry=r).labels(*lv)
        r.register(_EngineCollector(engine, lv))

    # ------------------------------------------------------------ observations
    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def next_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)
        self.tpot.observe(itl_s)

    def finished(self, reason: str, m: RequestMetrics | None) -> None:
        self.success[reason if reason in self.success else "stop"].inc()
        if m is None:
            return
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)
        self.queue.observe(m.queued_s)
        self.prefill.observe(m.prefill_s)
        self.decode.observe(m.decode_s)
        self.inference.observe(m.prefill_s + m.decode_s)
        self.prompt_tokens.observe(m.num_prompt_tokens)
        self.generation_tokens.observe(m.num_output_tokens)
        if m.kv_transfer_s is not None:
            self.kv_transfer_time.observe(m.kv_transfer_s)
            self.kv_transfer_bytes.inc(m.kv_transfer_bytes)

    def aborted(self) -> None:
        self.aborts.inc()
        self.success["abort"].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and cumulative counters read from the engine at scrape time.

    The engine thread writes these ints; reading them from the event loop is
    safe (a scrape sees a value at most one step old). Over several replicas
    (a ReplicaSet) each sample is one replica's, labelled with its index
    (``engine``, as vLLM's data parallel ranks) and its name (``replica``).
    """

    def __init__(self, engine: EngineClient, label_values: tuple[str, str]) -> None:
        self.engine = engine
        self.lv = list(label_values)

    def describe(self):
        return []  # collected lazily; nothing to check for duplicates at registration

    def collect(self):
        labels, rows = LABELS, [(self.lv, self.engine.stats())]
        if isinstance(self.engine, ReplicaSet):
            labels = LABELS + ["replica"]
            rows = [([self.lv[0], str(i), name], s) for i, (name, s)
                    in enumerate(self.engine.replica_stats().items()) if s is not None]

        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]
                  ) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for lv, s in rows:
                g.add_metric(lv, value(s))
            return g

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]
                    ) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            for lv, s in rows:
                c.add_metric(lv, value(s))
            return c

        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", lambda s: s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    lambda s: s.num_waiting + s.num_pending)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    lambda s: s.kv_cache_usage)
        yield counter("vllm:num_preemptions",
                      "Cumulative number of preemption from the engine.",
                      lambda s: s.num_preemptions)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      lambda s: s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      lambda s: s.prefix_cache_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      lambda s: s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      lambda s: s.generation_tokens_total)
