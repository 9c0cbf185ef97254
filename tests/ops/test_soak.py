"""ops/soak.py, the CPU version of the soak: the embedded tiny model's worker under mixed streams (tools, JSON
answers, clients leaving mid-stream) through the official client, its /metrics against the clients' counts,
its memory and descriptors sampled, then SIGTERM with requests in flight."""

from __future__ import annotations

from ops import soak
from ops.soak import Sample, Tally, growth_checks, metric_checks


def test_a_short_soak_loses_nothing_and_stops_clean(tmp_path):
    report = soak.main(["--seconds", "40", "--streams", "8", "--sample-s", "4", "--max-tokens", "24",
                        "--prompt-words", "80", "--disconnect", "0.2", "--grace", "30",
                        "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "soak.json")])
    assert report["ok"], report["problems"]
    assert report["failed"] == 0 and report["whole"] + report["left_on_purpose"] + report["refused"] == report["sent"]
    assert all(report["by_kind"][kind] > 0 for kind in soak.KINDS) and report["left_on_purpose"] > 0
    stop = report["stop"]
    assert stop["sent"] == 8 and stop["failed"] == 0 and stop["whole"] + stop["refused"] == stop["sent"]
    assert stop["whole"] > 0  # requests in flight when SIGTERM came ended whole


def test_the_checks_name_what_went_wrong():
    tally = Tally(sent=10)
    page = {'glmflash_requests_total{route="/v1/chat/completions",status="200"}': 8.0,
            'glmflash_requests_total{route="/v1/chat/completions",status="500"}': 1.0,
            'glmflash_requests_total{route="/v1/models",status="200"}': 3.0, "glmflash_requests_running": 1.0}
    problems = metric_checks(page, tally)
    assert any("counts 8 API requests" in p for p in problems)
    assert any("1 server errors" in p for p in problems) and any("requests_running is 1" in p for p in problems)
    steady = [Sample(t, 500 << 20, 20, None) for t in (0, 10, 20, 30, 40, 50)]
    assert growth_checks(steady, 50) == []
    leaking = steady[:-1] + [Sample(50, 700 << 20, 40, None)]
    assert [p.split()[0] for p in growth_checks(leaking, 50)] == ["resident", "open"]
