"""The engine's Prometheus metrics, read from the scheduler and server at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    """Exposes `refengine_*` metrics from a snapshot function.

    Example::

        registry = CollectorRegistry()
        registry.register(EngineCollector(app.metrics_snapshot))
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        req = CounterMetricFamily(
            "refengine_requests", "HTTP requests answered, by endpoint and status code",
            labels=["endpoint", "code"],
        )
        for (endpoint, code), n in sorted(s["requests"].items()):
            req.add_metric([endpoint, str(code)], n)
        yield req
        fin = CounterMetricFamily(
            "refengine_requests_finished", "Generations finished, by finish reason",
            labels=["finish_reason"],
        )
        for reason, n in sorted(s["finished"].items()):
            fin.add_metric([reason], n)
        yield fin
        yield CounterMetricFamily(
            "refengine_prompt_tokens", "Prompt tokens admitted", value=s["prompt_tokens"]
        )
        yield CounterMetricFamily(
            "refengine_generation_tokens", "Tokens generated", value=s["generation_tokens"]
        )
        yield CounterMetricFamily(
            "refengine_prefill_tokens",
            "Prompt tokens run through the model (a resume with kept KV skips most)",
            value=s["prefill_tokens"])
        gauges = [
            ("refengine_requests_running", "Requests holding a KV slot", "running"),
            ("refengine_requests_waiting", "Requests waiting for a KV slot", "waiting"),
            ("refengine_kv_slots_used", "KV slots in use", "kv_slots_used"),
            ("refengine_kv_slots_total", "KV slots in the pool", "kv_slots_total"),
            ("refengine_kv_pool_bytes", "Bytes held by the KV pool (0 when freed)",
             "kv_pool_bytes"),
            ("refengine_weight_bytes", "Bytes of model weights", "weight_bytes"),
        ]
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=s[key])
