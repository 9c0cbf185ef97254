"""Prometheus metrics of one server: requests, tokens, latency, queue, cache occupancy and prefix cache hits.

A registry per app, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = r = CollectorRegistry()
        self.clock = clock
        # (when, CPU-read bytes, PCIe-copied bytes) at the previous refresh: the transfer rates' baseline.
        self._last_transfer = (clock(), 0, 0)
        self.requests = Counter("glmflash_requests", "Finished HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("glmflash_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("glmflash_generation_tokens", "Tokens generated", registry=r)
        self.aborted = Counter("glmflash_requests_aborted", "Requests aborted before finishing (client gone)",
                               registry=r)
        self.rejected = Counter("glmflash_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.ttft = Histogram("glmflash_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("glmflash_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("glmflash_request_latency_seconds", "Request latency, first byte in to last byte out",
                             buckets=LATENCY_BUCKETS, registry=r)
        # Time to first token inside the engine, in two parts (the rest of it is the HTTP path: template,
        # tokenizer, handing the request over and the first chunk back).
        self.queue_time = Histogram("glmflash_request_queue_time_seconds",
                                    "From the engine taking a request to its first step (a slot, the step already "
                                    "running, a prefix another request computes)", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram("glmflash_request_prefill_time_seconds",
                                      "From a request's first step to the end of the step that sampled its first "
                                      "token", buckets=LATENCY_BUCKETS, registry=r)
        self.engine_steps = Gauge("glmflash_engine_steps", "Engine steps run since start, by kind (decode: one token "
                                  "per request; prefill: some prompt chunk)", ["kind"], registry=r)
        self.engine_step_seconds = Gauge("glmflash_engine_step_seconds", "Wall time of those steps since start, by "
                                         "kind", ["kind"], registry=r)
        self.running = Gauge("glmflash_requests_running", "Requests holding a state slot", registry=r)
        self.waiting = Gauge("glmflash_requests_waiting", "Requests queued for a slot", registry=r)
        self.slots_used = Gauge("glmflash_state_slots_used", "Per-request state slots in use", registry=r)
        self.slots_total = Gauge("glmflash_state_slots_total", "Per-request state slots", registry=r)
        self.cache_usage = Gauge("glmflash_cache_usage_ratio",
                                 "Fraction of DSA cache pages in use (cached prefixes included: evicted on demand)",
                                 registry=r)
        self.expert_hit = Gauge("glmflash_expert_device_hit_ratio",
                                "Routed (token, expert) pairs served from device slots, of all pairs", registry=r)
        self.expert_host_pairs = Gauge("glmflash_expert_host_pairs", "Routed pairs computed on the CPU since start",
                                       registry=r)
        self.expert_fetched_bytes = Gauge("glmflash_expert_fetched_bytes",
                                          "Expert bytes copied from host RAM to the GPU since start (prefill "
                                          "rounds, the PCIe share of decode misses)",
                                          registry=r)
        self.expert_swaps = Gauge("glmflash_expert_swaps", "Experts moved from host RAM into device slots since start",
                                  registry=r)
        self.expert_host_gbps = Gauge("glmflash_expert_host_gbps", "Expert bytes the CPU executor read per second",
                                      registry=r)
        self.expert_cpu_share = Gauge("glmflash_expert_cpu_share", "Routed pairs computed on the CPU, of all pairs",
                                      registry=r)
        self.expert_fetched_pairs = Gauge("glmflash_expert_fetched_pairs",
                                          "Routed pairs run on the GPU after a copy of their expert from host RAM",
                                          registry=r)
        self.expert_pcie_percent = Gauge("glmflash_expert_pcie_percent",
                                         "Share of decode misses sent over PCIe (the rest run on the CPU)", registry=r)
        self.expert_rate_at_load = Gauge("glmflash_expert_rate_at_load_gbps",
                                         "Missed-expert rates measured at load, by path", ["path"], registry=r)
        self.expert_transfer = Gauge("glmflash_expert_transfer_gbps",
                                     "Expert bytes read from host RAM per second of wall time since the previous "
                                     "refresh, by path: cpu (the CPU executor's reads), pcie (copies to the GPU)",
                                     ["path"], registry=r)
        # Prefix cache totals since start (engine counters, mirrored at every refresh).
        self.prefix_requests = Gauge("glmflash_prefix_cache_requests", "Requests looked up in the prefix cache",
                                     registry=r)
        self.prefix_hits = Gauge("glmflash_prefix_cache_hits", "Requests that started from a cached prefix",
                                 registry=r)
        self.prefix_hit_tokens = Gauge("glmflash_prefix_cache_hit_tokens",
                                       "Prompt tokens restored from the prefix cache instead of computed", registry=r)
        self.prompt_tokens_computed = Gauge("glmflash_prompt_tokens_computed",
                                            "Prompt tokens run through the model (all but the cached ones)", registry=r)
        self.prefix_evictions = Gauge("glmflash_prefix_cache_evictions",
                                      "Cached pages and state snapshots evicted from the device", ["kind"], registry=r)
        self.prefix_entries = Gauge("glmflash_prefix_cache_entries", "Cached pages and state snapshots held now",
                                    ["kind", "tier"], registry=r)
        self.spec_drafts = Gauge("glmflash_spec_draft_tokens", "First MTP drafts (one a request-step) whose "
                                 "position was since sampled, and of those the ones equal to the sampled token",
                                 ["outcome"], registry=r)
        self.spec_verified = Gauge("glmflash_spec_verified_drafts", "Drafts run in verify steps, and of those the "
                                   "accepted ones", ["outcome"], registry=r)
        self.spec_draft_length = Gauge("glmflash_spec_draft_length", "Drafts a request gets for its next step "
                                       "(with speculative decoding: the length measured costs chose)", registry=r)
        self.spec_mean_length = Gauge("glmflash_spec_mean_accepted_length",
                                      "Tokens a verify step gave a request on average (1 + accepted drafts)",
                                      registry=r)

    def observe_engine(self, stats) -> None:
        """Refresh the occupancy gauges from an engine stats snapshot."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.slots_used.set(stats.slots_used)
        self.slots_total.set(stats.slots_total)
        self.cache_usage.set(stats.pages_used / stats.pages_total if stats.pages_total else 0.0)
        for kind, steps, seconds in (("decode", stats.steps.decode_steps, stats.steps.decode_seconds),
                                     ("prefill", stats.steps.prefill_steps, stats.steps.prefill_seconds)):
            self.engine_steps.labels(kind).set(steps)
            self.engine_step_seconds.labels(kind).set(seconds)
        offload = stats.offload
        if offload is None:  # every expert resident
            self.expert_hit.set(1.0)
        else:
            self.expert_hit.set(offload.hit_rate)
            self.expert_host_pairs.set(offload.host_pairs)
            self.expert_swaps.set(offload.swaps)
            self.expert_fetched_bytes.set(offload.fetched_bytes)
            self.expert_host_gbps.set(offload.host_bytes / offload.host_seconds / 1e9 if offload.host_seconds else 0.0)
            pairs = offload.device_pairs + offload.host_pairs + offload.fetched_pairs
            self.expert_cpu_share.set(offload.host_pairs / pairs if pairs else 0.0)
            self.expert_fetched_pairs.set(offload.fetched_pairs)
            self.expert_pcie_percent.set(offload.pcie_percent)
            self.expert_rate_at_load.labels("cpu").set(offload.cpu_rate_at_load / 1e9)
            self.expert_rate_at_load.labels("pcie").set(offload.pcie_rate_at_load / 1e9)
            self._observe_transfer(offload.host_bytes, offload.fetched_bytes)
        if stats.prefix is not None:
            self.observe_prefix_cache(stats.prefix)
        if stats.drafts is not None:
            self.observe_drafts(stats.drafts)

    def observe_drafts(self, drafts) -> None:
        self.spec_drafts.labels("proposed").set(drafts.proposed)
        self.spec_drafts.labels("accepted").set(drafts.accepted)
        self.spec_verified.labels("verified").set(drafts.verified)
        self.spec_verified.labels("accepted").set(drafts.verified_accepted)
        self.spec_mean_length.set(drafts.mean_accepted_length or 0.0)
        self.spec_draft_length.set(drafts.draft_length)

    def _observe_transfer(self, host_bytes: int, fetched_bytes: int) -> None:
        """What crossed each path since the previous refresh, over the wall time between the two (the CPU
        executor's own rate while it runs is glmflash_expert_host_gbps)."""
        now = self.clock()
        then, host_before, fetched_before = self._last_transfer
        if now > then:
            self.expert_transfer.labels("cpu").set((host_bytes - host_before) / (now - then) / 1e9)
            self.expert_transfer.labels("pcie").set((fetched_bytes - fetched_before) / (now - then) / 1e9)
            self._last_transfer = (now, host_bytes, fetched_bytes)

    def observe_prefix_cache(self, prefix) -> None:
        self.prefix_requests.set(prefix.requests)
        self.prefix_hits.set(prefix.hits)
        self.prefix_hit_tokens.set(prefix.hit_tokens)
        self.prompt_tokens_computed.set(prefix.computed_prompt_tokens)
        self.prefix_evictions.labels(kind="page").set(prefix.evicted_pages)
        self.prefix_evictions.labels(kind="snapshot").set(prefix.evicted_snapshots)
        for kind, tier, value in (("page", "device", prefix.device_pages), ("page", "host", prefix.host_pages),
                                  ("snapshot", "device", prefix.device_snapshots),
                                  ("snapshot", "host", prefix.host_snapshots)):
            self.prefix_entries.labels(kind=kind, tier=tier).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def samples(text: str) -> dict[str, float]:
    """A /metrics page (Prometheus text) -> sample name, with its labels as written there, -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
