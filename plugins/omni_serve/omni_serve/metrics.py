"""Prometheus metrics of one server (its own registry), every name prefixed `omni_`.

Latencies and counters are recorded by the request handlers; the stages' state (requests running/waiting,
KV blocks, prefix-cache hits, the counters a stage's model keeps, engine errors) is read from the engine's latest
snapshot when scraped, so /metrics never touches a scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .snapshot import Snapshot, node_of, restarting_of, restarts_of

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], Snapshot], jobs: Callable[[], dict[str, int]]):
        self.snapshot = snapshot
        self.jobs = jobs

    @staticmethod
    def _replicas(snap: Snapshot):
        """A replicated stage's replicas, each labelled by its index (the stage's own gauges add them up)."""
        labels = ["model", "stage", "replica"]
        running = GaugeMetricFamily("omni_replica_requests_running", "requests a stage's replica is running",
                                    labels=labels)
        waiting = GaugeMetricFamily("omni_replica_requests_waiting", "requests waiting in a stage's replica",
                                    labels=labels)
        restarts = CounterMetricFamily("omni_replica_restarts", "restarts of a stage's replica's worker",
                                       labels=labels)
        alive = GaugeMetricFamily("omni_replica_alive", "1 while a stage's replica takes requests (0 while it is dead "
                                  "or restarting)", labels=labels)
        for s in snap.stages:
            for index, replica in enumerate(s.replicas):
                key = [s.pipeline, s.node, str(index)]
                running.add_metric(key, replica.running)
                waiting.add_metric(key, replica.waiting)
                restarts.add_metric(key, restarts_of(replica))
                alive.add_metric(key, int(replica.dead is None and not restarting_of(replica)))
        return running, waiting, restarts, alive

    @staticmethod
    def _nodes(snap: Snapshot):
        """Where each placed stage's worker (each replica's) runs, where its placement tells: a Ray node id."""
        where = GaugeMetricFamily("omni_stage_node", "1 for the node a stage's (or replica's) worker runs on (Ray's "
                                  "node id); none while it has no node", labels=["model", "stage", "replica", "node"])
        for s in snap.stages:
            placed = [(str(i), r) for i, r in enumerate(s.replicas)] or [("", s.stats)]
            for index, stats in placed:
                if node_of(stats) is not None:
                    where.add_metric([s.pipeline, s.node, index, node_of(stats)], 1)
        return where

    @staticmethod
    def _model(snap: Snapshot):
        """The counters each stage's model keeps (StageStats.model, e.g. omni_wan's step_cache_hits), each as the
        counter `omni_<name>`."""
        families: dict[str, CounterMetricFamily] = {}
        for s in snap.stages:
            for name, value in s.stats.model.items():
                if name not in families:
                    families[name] = CounterMetricFamily(f"omni_{name}", f"{name}, as the stage's model counts it",
                                                         labels=["model", "stage"])
                families[name].add_metric([s.pipeline, s.node], value)
        return families.values()

    def collect(self):
        snap = self.snapshot()
        labels = ["model", "stage"]
        running = GaugeMetricFamily("omni_requests_running", "requests a stage is running", labels=labels)
        waiting = GaugeMetricFamily("omni_requests_waiting", "requests waiting in a stage's queue", labels=labels)
        used = GaugeMetricFamily("omni_kv_blocks_used", "KV cache blocks held by requests", labels=labels)
        total = GaugeMetricFamily("omni_kv_blocks_total", "KV cache blocks in the stage's pool", labels=labels)
        hits = CounterMetricFamily("omni_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                   labels=labels)
        for s in snap.stages:
            key, stats = [s.pipeline, s.node], s.stats
            running.add_metric(key, stats.running)
            waiting.add_metric(key, stats.waiting)
            if stats.kv_blocks_total is not None:
                used.add_metric(key, stats.kv_blocks_used)
                total.add_metric(key, stats.kv_blocks_total)
                hits.add_metric(key, stats.prefix_hit_tokens or 0)
        restarts = CounterMetricFamily("omni_stage_restarts", "restarts of a stage's worker process or Ray actor",
                                       labels=labels)
        restarting = GaugeMetricFamily("omni_stage_restarting", "1 while a stage's restarted worker builds its stage",
                                       labels=labels)
        for s in snap.stages:
            restarts.add_metric([s.pipeline, s.node], s.restarts)
            restarting.add_metric([s.pipeline, s.node], int(s.restarting))
        yield from (running, waiting, used, total, hits)
        yield from self._model(snap)
        yield from (restarts, restarting)
        yield from self._replicas(snap)
        yield self._nodes(snap)
        errors = CounterMetricFamily("omni_stage_errors", "failed requests by pipeline, node and failure kind",
                                     labels=["model", "stage", "kind"])
        for (pipeline, node, kind), count in sorted(snap.errors.items()):
            errors.add_metric([pipeline, node, kind], count)
        yield errors
        yield CounterMetricFamily("omni_requests_aborted", "requests aborted (client gone, cancelled, shutdown)",
                                  value=snap.aborted)
        yield GaugeMetricFamily("omni_engine_alive", "1 while the engine takes requests", value=0 if snap.dead else 1)
        yield GaugeMetricFamily("omni_requests_in_flight", "requests in the engine", value=snap.in_flight)
        yield CounterMetricFamily("omni_engine_steps", "engine loop steps", value=snap.steps)
        video = GaugeMetricFamily("omni_video_jobs", "video jobs by status", labels=["status"])
        for status, count in sorted(self.jobs().items()):
            video.add_metric([status], count)
        yield video


class Metrics:
    def __init__(self, snapshot: Callable[[], Snapshot], jobs: Callable[[], dict[str, int]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("omni_time_to_first_token_seconds", "time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("omni_inter_token_latency_seconds", "time between streamed text deltas", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("omni_time_to_first_audio_seconds", "speech: arrival to the first sound's bytes",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.chat_ttfa = Histogram("omni_chat_time_to_first_audio_seconds", "spoken chats: arrival to the answer's "
                                   "first audio", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.audio = Counter("omni_audio_seconds", "seconds of audio, by route: spoken (speech) or heard "
                             "(transcriptions)", ["model", "route"], registry=r)
        self.e2e = Histogram("omni_e2e_request_latency_seconds", "request latency, arrival to last byte",
                             ["model", "route"], buckets=E2E_BUCKETS, registry=r)
        self.generated = Counter("omni_generated_tokens", "tokens generated", ["model"], registry=r)
        self.prompt = Counter("omni_prompt_tokens", "prompt tokens processed", ["model"], registry=r)
        self.denoise = Histogram("omni_denoise_step_seconds", "time of one denoise step (as the server sees it)",
                                 ["model"], buckets=E2E_BUCKETS, registry=r)
        self.structured = Counter("omni_structured_requests", "requests with constrained (structured) output, by "
                                  "kind: json_schema, json_object, regex, choice", ["model", "kind"], registry=r)
        self.grammar_compile = Histogram("omni_grammar_compile_seconds", "time to compile a request's grammar (a "
                                         "schema compiled before is not compiled again)", ["model"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.http = Counter("omni_http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=r)
        r.register(_EngineCollector(snapshot, jobs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
