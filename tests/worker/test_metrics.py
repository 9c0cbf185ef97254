"""Metrics computed from engine stats: the expert transfer rates over the time between two refreshes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.engine_core import EngineStats
from engine.experts.hybrid import OffloadStats
from engine.mtp_drafter import DraftStats
from worker.metrics import Metrics


def samples(metrics: Metrics) -> dict[str, float]:
    return {f"{s.name}{s.labels.get('path', '')}": s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def engine_stats(host_bytes: int, fetched_bytes: int) -> EngineStats:
    offload = OffloadStats(device_pairs=10, host_pairs=6, fetched_pairs=4, fetched_bytes=fetched_bytes,
                           host_seconds=0.5, host_bytes=host_bytes)
    return EngineStats(running=1, waiting=0, slots_used=1, slots_total=4, pages_used=2, pages_total=8,
                       offload=offload)


def test_expert_transfer_rates_cover_the_time_since_the_previous_refresh():
    now = [100.0]
    metrics = Metrics(clock=lambda: now[0])
    now[0] = 102.0  # two seconds after the server's start: 6 GB read by the CPU, 3 GB copied
    metrics.observe_engine(engine_stats(host_bytes=6_000_000_000, fetched_bytes=3_000_000_000))
    got = samples(metrics)
    assert got["glmflash_expert_transfer_gbpscpu"] == 3.0 and got["glmflash_expert_transfer_gbpspcie"] == 1.5
    assert got["glmflash_expert_host_gbps"] == 12.0  # the executor's own rate while it ran (6 GB in 0.5 s)
    now[0] = 106.0  # four seconds later: 2 GB more over PCIe, nothing on the CPU
    metrics.observe_engine(engine_stats(host_bytes=6_000_000_000, fetched_bytes=5_000_000_000))
    got = samples(metrics)
    assert got["glmflash_expert_transfer_gbpscpu"] == 0.0 and got["glmflash_expert_transfer_gbpspcie"] == 0.5
    metrics.observe_engine(engine_stats(host_bytes=7_000_000_000, fetched_bytes=5_000_000_000))  # no time passed
    assert samples(metrics)["glmflash_expert_transfer_gbpscpu"] == 0.0  # kept until time has passed


def test_draft_counts_and_the_mean_accepted_length():
    metrics = Metrics()
    stats = EngineStats(running=1, waiting=0, slots_used=1, slots_total=4, pages_used=2, pages_total=8,
                        drafts=DraftStats(proposed=10, accepted=6, verify_steps=4, verified=8,
                                           verified_accepted=6, draft_length=2))
    metrics.observe_engine(stats)
    got = {f"{s.name}{s.labels.get('outcome', '')}": s.value
           for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert got["glmflash_spec_draft_tokensproposed"] == 10 and got["glmflash_spec_draft_tokensaccepted"] == 6
    assert got["glmflash_spec_verified_draftsverified"] == 8 and got["glmflash_spec_verified_draftsaccepted"] == 6
    assert got["glmflash_spec_mean_accepted_length"] == 2.5  # 1 + 6 accepted over 4 verify steps
    assert got["glmflash_spec_draft_length"] == 2
