"""Every Prometheus metric Pitstop exports, defined here and nowhere else.

Events (recoveries, requests) are counted as they happen; states (engine up, snapshot
age) are read from the agent's status at scrape time by `StatusCollector`. docs/metrics.md
documents each one; tests check that the dashboards and rules use only names from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector, RestrictedRegistry

import agent
from agent.gpu_health import FaultKind
from agent.holder.kvledger import KeptKVOutcome
from agent.recovery import Cause, Fall
from agent.store.manifest import SnapshotKind

# Recovery times span a 1 s hybrid restore to a multi-minute cold start of a big model.
RECOVERY_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
STAGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# A first token comes in tens of milliseconds from a warm engine, seconds from a cold one.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                       60.0)

# Every rung a ladder may hold (agent/supervisor/paths/*: each class's `name`), fastest first.
RECOVERY_PATHS = ("vllm-snapshot", "standby", "hybrid", "refill", "full", "warm", "vllm-preload",
                  "cold")
RESULTS = ("success", "failure")
# What makes the supervisor walk the ladder, and the failures it did not ask for.
RECOVERY_CAUSES = tuple(c.value for c in Cause)
FAILURE_CAUSES = tuple(c.value for c in (Cause.CRASH, Cause.EXIT, Cause.HANG, Cause.GPU_FAULT,
                                         Cause.RESUME_FAILED))
FALLTHROUGH_REASONS = tuple(f.value for f in Fall)
SNAPSHOT_KINDS = get_args(SnapshotKind)
# A snapshot sent to the remote store (snapshots.publish) or taken from it before a start.
TRANSFER_DIRECTIONS = ("push", "pull")
# What a resumed stream found on the recovered engine: kept KV, or why not.
KV_RESUME_OUTCOMES = tuple(o.value for o in KeptKVOutcome)


@dataclass(frozen=True)
class NodeInfo:
    """What `pitstop_node_info` carries, to join a fleet's hosts with DCGM's labels."""

    # The engine's name on a node of several (every metric carries it: EngineLabel).
    engine: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    kernel: str = ""
    engine_kind: str = ""
    engine_version: str = ""
    weights_digest: str = ""
    gpu_name: str = ""
    # The served model name: the dashboards' `model` variable selects hosts by it.
    model: str = ""


@dataclass(frozen=True)
class StatusView:
    """The read-only slice of the agent's status that scrape-time metrics need."""

    state: str
    engine_up: bool
    engine_start_time: float | None
    states: tuple[str, ...]
    node: NodeInfo
    snapshot_created: float | None = None
    snapshot_bytes: int | None = None
    snapshot_kind: str = ""
    stale_reasons: tuple[str, ...] = ()
    holder_up: bool | None = None
    holder_bytes: int | None = None
    # None without a holder, or when it does not answer.
    holder_bypassed: bool | None = None
    front_queue_depth: int = 0
    front_inflight: int = 0
    # The GPU memory in use at its peak during the last recovery by each path (path, bytes);
    # empty without a GPU.
    recovery_gpu_peak_bytes: tuple[tuple[str, int], ...] = ()
    # Whether the engine's GPU is usable as NVML last saw it; None without a GPU watch.
    gpu_usable: bool | None = None
    # Whether a standby is armed; None with snapshots.standby off.
    standby_armed: bool | None = None


class Metrics:
    """The metric objects, registered on an injected registry.

    Example::

        m = Metrics(CollectorRegistry(), status=lambda: view)
        m.recoveries.labels(path="cold", result="success", cause="crash").inc()
    """

    def __init__(self, registry: CollectorRegistry,
                 status: Callable[[], StatusView] | None = None) -> None:
        self.registry = registry
        # --- supervisor: restarts and recoveries -------------------------------------
        self.recoveries = Counter(
            "pitstop_recoveries_total",
            "Engine (re)starts by the ladder path that served them, result and cause.",
            ["path", "result", "cause"], registry=registry)
        self.recovery_duration = Histogram(
            "pitstop_recovery_duration_seconds",
            "From the decision to (re)start the engine to its verified canary answer.",
            ["path", "result"], buckets=RECOVERY_BUCKETS, registry=registry)
        self.recovery_stage_duration = Histogram(
            "pitstop_recovery_stage_duration_seconds",
            "Duration of one stage of a recovery (spawn, criu_restore, cuda_restore, attach, "
            "health, verify, ...).",
            ["path", "stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.ladder_fallthroughs = Counter(
            "pitstop_ladder_fallthroughs_total",
            "A ladder path skipped or failed, so the next one was tried, by reason.",
            ["path", "reason"], registry=registry)
        self.engine_failures = Counter(
            "pitstop_engine_failures_total",
            "Engine failures the agent did not ask for, by cause (crash, exit, hang, "
            "gpu_fault, resume_failed).",
            ["cause"], registry=registry)
        self.gpu_faults = Counter(
            "pitstop_gpu_faults_total",
            "Faults of the engine's GPU seen through NVML, by kind (ecc_uncorrected, "
            "xid_memory, xid_fatal, gpu_lost, reset_required).",
            ["kind"], registry=registry)
        # --- snapshots and drift -----------------------------------------------------
        self.snapshots_created = Counter(
            "pitstop_snapshots_created_total",
            "Snapshots taken, by kind (full, hybrid) and result.",
            ["kind", "result"], registry=registry)
        self.snapshot_create_duration = Histogram(
            "pitstop_snapshot_create_duration_seconds",
            "Time to take and publish one snapshot.",
            ["kind"], buckets=RECOVERY_BUCKETS, registry=registry)
        self.snapshots_rejected = Counter(
            "pitstop_snapshots_rejected_total",
            "Snapshots refused at restore time, by reason (stale, corrupt, permissions, ...).",
            ["reason"], registry=registry)
        self.drift_events = Counter(
            "pitstop_drift_events_total",
            "Identity fields seen to differ from the current snapshot's, by field.",
            ["field"], registry=registry)
        self.regenerations = Counter(
            "pitstop_regenerations_total",
            "Snapshot regenerations after drift or a cold start, by result.",
            ["result"], registry=registry)
        self.snapshot_transfers = Counter(
            "pitstop_snapshot_transfers_total",
            "Pushes to and pulls from the remote snapshot store (snapshots.remote), by "
            "direction and result (ok, or the refusal code: stale, corrupt, no_snapshot, "
            "transfer_failed).",
            ["direction", "result"], registry=registry)
        # --- front -------------------------------------------------------------------
        self.front_requests = Counter(
            "pitstop_front_requests_total",
            "Requests the front answered, by endpoint and HTTP status code.",
            ["endpoint", "code"], registry=registry)
        self.front_queue_wait = Histogram(
            "pitstop_front_queue_wait_seconds",
            "Time a request waited for a ready engine before it was forwarded.",
            buckets=STALL_BUCKETS, registry=registry)
        self.front_resumed = Counter(
            "pitstop_front_resumed_requests_total",
            "Requests continued on a recovered engine after the engine died mid-answer.",
            ["endpoint"], registry=registry)
        self.front_kv_resumes = Counter(
            "pitstop_front_kv_resumes_total",
            "Resumed streams by what the recovered engine did with the dead one's KV: "
            "kept (continued from it, no re-prefill) or why it prefilled again (no_entry, "
            "torn, tokens_differ, kv_changed, slot_busy, not_held, not_reported).",
            ["outcome"], registry=registry)
        self.front_stall = Histogram(
            "pitstop_front_stall_seconds",
            "Pause seen by a client whose answer was resumed across a recovery.",
            buckets=STALL_BUCKETS, registry=registry)
        self.front_first_token = Histogram(
            "pitstop_front_time_to_first_token_seconds",
            "From forwarding a streamed request to the engine to its first token sent on, by "
            "the path that started the engine and phase (the first such request after the "
            "engine started, or a later one).",
            ["path", "phase"], buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self.front_failed = Counter(
            "pitstop_front_failed_requests_total",
            "Requests the front could not finish, by reason (deadline, queue_full, draining, "
            "resume_limit, not_resumable, engine_lost, engine_error, client_gone).",
            ["reason"], registry=registry)
        self.refill_bytes = Counter(
            "pitstop_holder_refill_bytes",
            "Bytes of weights the holder loaded from the model files for the refill rung.",
            registry=registry)
        self.refill_duration = Histogram(
            "pitstop_holder_refill_duration_seconds",
            "How long the holder took to load the weights for the refill rung, from the request "
            "to the commit: creating the regions, then every read and copy (GB/s: rate of the "
            "bytes counter over rate of this histogram's sum).",
            buckets=STAGE_BUCKETS, registry=registry)
        # (snapshot id, reason) already counted in pitstop_snapshots_rejected_total.
        self._rejected: set[tuple[str, str]] = set()
        self._initialise_known_labels()
        if status is not None:
            self.read_status(status)

    def read_status(self, status: Callable[[], StatusView]) -> None:
        """Export the state metrics read at scrape time from `status` (the status board's
        view, made after the parts that count into these metrics)."""
        self.registry.register(StatusCollector(status))

    def recovered(self, path: str, result: str, cause: str, seconds: float,
                  stages: dict[str, float]) -> None:
        """A walk of the ladder ended by `path` with `result`, in `seconds` (its stages')."""
        self.recoveries.labels(path=path, result=result, cause=cause).inc()
        self.recovery_duration.labels(path=path, result=result).observe(seconds)
        for stage, secs in stages.items():
            self.recovery_stage_duration.labels(path=path, stage=stage).observe(secs)

    def rejected(self, snapshot_id: str, reason: str) -> None:
        """Snapshot `snapshot_id` refused for `reason`: counted once. Every walk of the
        ladder, both rungs that restore a kind (hybrid, refill) and the standby pass a stale
        snapshot over again; counting each pass would grow the counter with the crashes, not
        with the snapshots refused."""
        if (snapshot_id, reason) not in self._rejected:
            self._rejected.add((snapshot_id, reason))
            self.snapshots_rejected.labels(reason=reason).inc()

    def refilled(self, nbytes: int, seconds: float) -> None:
        """The holder loaded `nbytes` of weights in `seconds` for the refill rung."""
        self.refill_bytes.inc(nbytes)
        self.refill_duration.observe(seconds)

    def _initialise_known_labels(self) -> None:
        """Export 0 for every known label set before its first event.

        A counter series that first appears at 1 has no `increase()`: without this, the
        dashboards would miss every host's first crash, first hang, first fall-through.
        """
        for path in RECOVERY_PATHS:
            for result in RESULTS:
                for cause in RECOVERY_CAUSES:
                    self.recoveries.labels(path=path, result=result, cause=cause)
            for reason in FALLTHROUGH_REASONS:
                self.ladder_fallthroughs.labels(path=path, reason=reason)
        for cause in FAILURE_CAUSES:
            self.engine_failures.labels(cause=cause)
        for outcome in KV_RESUME_OUTCOMES:
            self.front_kv_resumes.labels(outcome=outcome)
        for direction in TRANSFER_DIRECTIONS:
            self.snapshot_transfers.labels(direction=direction, result="ok")
        for result in RESULTS:
            self.regenerations.labels(result=result)
            for kind in SNAPSHOT_KINDS:
                self.snapshots_created.labels(kind=kind, result=result)

    def gpu_watched(self) -> None:
        """The GPU is watched: its fault counters start at 0 (only on hosts with a GPU)."""
        for kind in FaultKind:
            self.gpu_faults.labels(kind=kind.value)


class StatusCollector(Collector):
    """Reads the agent's status at scrape time: nothing here is updated by events."""

    def __init__(self, status: Callable[[], StatusView], clock: Callable[[], float] = time.time):
        self._status = status
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        s = self._status()
        yield from self._engine(s)
        yield from self._snapshot(s)
        yield from self._holder_and_gpu(s)
        yield from self._front(s)

    def _engine(self, s: StatusView) -> Iterable[Metric]:
        info = InfoMetricFamily("pitstop_build", "Pitstop's version.")
        info.add_metric([], {"version": agent.__version__})
        yield info
        node = InfoMetricFamily(
            "pitstop_node",
            "Driver, kernel, engine and weights this node runs; join with DCGM on the driver.")
        node.add_metric([], {k: v for k, v in s.node.__dict__.items()})
        yield node
        up = GaugeMetricFamily("pitstop_engine_up", "1 when the engine is verified and serving.")
        up.add_metric([], 1.0 if s.engine_up else 0.0)
        yield up
        state = GaugeMetricFamily(
            "pitstop_engine_state", "The supervisor's state: 1 for the current one.",
            labels=["state"])
        for name in s.states:
            state.add_metric([name], 1.0 if name == s.state else 0.0)
        yield state
        # Families whose value is unknown are still yielded, without a sample: the name is
        # always in the exposition (dashboards and rules can be checked against it), and
        # "no sample" keeps meaning "not known here" rather than a misleading zero.
        st = GaugeMetricFamily(
            "pitstop_engine_start_time_seconds",
            "Unix time at which the current engine became ready.")
        if s.engine_start_time is not None:
            st.add_metric([], s.engine_start_time)
        yield st

    def _snapshot(self, s: StatusView) -> Iterable[Metric]:
        present = GaugeMetricFamily(
            "pitstop_snapshot_present", "1 when a usable snapshot exists for this host.",
            labels=["kind"])
        present.add_metric([s.snapshot_kind or "none"], 1.0 if s.snapshot_created else 0.0)
        yield present
        age = GaugeMetricFamily(
            "pitstop_snapshot_age_seconds", "Age of the newest usable snapshot.")
        if s.snapshot_created is not None:
            age.add_metric([], max(0.0, self._clock() - s.snapshot_created))
        yield age
        size = GaugeMetricFamily(
            "pitstop_snapshot_size_bytes", "Size on disk of the newest usable snapshot.")
        if s.snapshot_bytes is not None:
            size.add_metric([], float(s.snapshot_bytes))
        yield size
        stale = GaugeMetricFamily(
            "pitstop_snapshot_stale", "1 per reason the newest snapshot cannot be restored.",
            labels=["reason"])
        for reason in s.stale_reasons:
            stale.add_metric([reason], 1.0)
        yield stale
        yield _flag("pitstop_standby_armed",
                    "1 while a stopped copy of the engine waits to answer the next crash; no "
                    "sample with snapshots.standby off.", s.standby_armed)

    @staticmethod
    def _holder_and_gpu(s: StatusView) -> Iterable[Metric]:
        yield _flag("pitstop_holder_up", "1 when the GPU memory holder answers.", s.holder_up)
        yield _flag("pitstop_holder_bypassed",
                    "1 while starts load the weights without the holder because the last start "
                    "over it failed (until the weights change or a reload); no sample without "
                    "a holder that answers.", s.holder_bypassed)
        hb = GaugeMetricFamily(
            "pitstop_holder_bytes", "Bytes of model memory held outside the engine.")
        if s.holder_bytes is not None:
            hb.add_metric([], float(s.holder_bytes))
        yield hb
        peak = GaugeMetricFamily(
            "pitstop_recovery_gpu_memory_peak_bytes",
            "GPU memory in use (every process, the holder's included) at its peak during the "
            "last recovery by each path; no sample without a GPU.", labels=["path"])
        for path, value in s.recovery_gpu_peak_bytes:
            peak.add_metric([path], float(value))
        yield peak
        yield _flag("pitstop_gpu_usable",
                    "1 while NVML reports the engine's GPU usable, 0 once it is lost or needs a "
                    "reset; no sample without a GPU.", s.gpu_usable)

    @staticmethod
    def _front(s: StatusView) -> Iterable[Metric]:
        qd = GaugeMetricFamily(
            "pitstop_front_queue_depth", "Requests waiting in the front for a ready engine.")
        qd.add_metric([], float(s.front_queue_depth))
        yield qd
        inf = GaugeMetricFamily(
            "pitstop_front_inflight_requests", "Requests the front is forwarding right now.")
        inf.add_metric([], float(s.front_inflight))
        yield inf


def _flag(name: str, documentation: str, value: bool | None) -> GaugeMetricFamily:
    """A 0/1 gauge; without a sample while its value is not known here (None)."""
    g = GaugeMetricFamily(name, documentation)
    if value is not None:
        g.add_metric([], 1.0 if value else 0.0)
    return g


M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """A labelled metric's children by their label values (in the metric's label order),
    each looked up once: prometheus_client's `labels()` checks and converts its arguments
    and takes a lock at every call, which a path taken per request need not pay.

    Example::

        answered = Children(metrics.front_requests)
        answered("/v1/models", 200).inc()    # label values are made strings, as labels() does
    """

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[object, ...], M] = {}

    def __call__(self, *values: object) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class EngineLabel:
    """A registry as one engine's agent serves it: every sample carries `engine="NAME"`.

    On a node of several engines each agent is its own scrape target; the label says which
    engine a series is without any scrape configuration (docs/metrics.md). Only the
    exposition changes: the registry itself, and what tests read from it, stay unlabelled.

    Example::

        start_http_server(9411, registry=EngineLabel.over(registry, "a"))
    """

    def __init__(self, source: CollectorRegistry | RestrictedRegistry, engine: str) -> None:
        self._source = source
        self._engine = engine

    @classmethod
    def over(cls, registry: CollectorRegistry, engine: str) -> CollectorRegistry | EngineLabel:
        """`registry` labelled with `engine`; unchanged for the node's one unnamed agent."""
        return cls(registry, engine) if engine else registry

    def collect(self) -> Iterable[Metric]:
        for m in self._source.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            out.samples = [s._replace(labels={"engine": self._engine, **s.labels})
                           for s in m.samples]
            yield out

    def restricted_registry(self, names: Iterable[str]) -> EngineLabel:
        """What prometheus_client's server asks for when a scrape names metrics (`name[]`)."""
        assert isinstance(self._source, CollectorRegistry)
        return EngineLabel(self._source.restricted_registry(names), self._engine)


def new_registry() -> CollectorRegistry:
    """A fresh registry; status is only read at scrape time, never at registration."""
    # `_created` companions would double every counter's and histogram's series for a value
    # no dashboard or rule reads; the switch is process-wide in prometheus_client.
    disable_created_metrics()
    return CollectorRegistry(auto_describe=False)
