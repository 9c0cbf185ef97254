"""bench_boot's reading of a start's log: where the time between process start and ready went."""

from __future__ import annotations

from datetime import datetime

from ops.bench_boot import critical_path

LOG = """\
2026-12-06 15:30:09,729 level=INFO logger=glmflash.cli event=readahead files=1 bytes=2978552176
2026-12-06 15:30:10,107 level=INFO logger=glmflash.worker event=listening url=http://127.0.0.1:44217 vast=False
PROVISION_STAGE=load elapsed_s=0.00 budget_left_s=300.00 path=/cache/prepared
2026-12-06 15:30:19,606 level=INFO logger=glmflash.engine event=load_timing wall_s=9.494 threads=8 read_s=2.2
2026-12-06 15:30:19,700 level=INFO logger=glmflash.engine event=prepared_load allocate_s=2.21 read_s=11.62 read_gb_s=1.73
2026-12-06 15:30:20,000 level=INFO logger=glmflash.engine event=warm_up_wait waited_s=0.25
2026-12-06 15:30:21,450 level=INFO logger=glmflash.engine event=graph_capture shapes=2x1,1x1 warm_s=0.40,0.30 seconds=1.05
2026-12-06 15:30:21,500 level=INFO logger=glmflash.engine event=decode_graphs sizes=1,2 tokens_per_request=1 capture_s=1.10
2026-12-06 15:30:24,000 level=INFO logger=glmflash.engine event=prefill_warm_up lengths=2048,128 seconds=2.4
2026-12-06 15:30:25,000 level=INFO logger=glmflash.engine event=prefill_warm_up lengths=64 seconds=9.9
2026-12-06 15:30:25,100 level=INFO logger=glmflash.engine event=expert_calibration file=x prompts=1 seconds=3.0
"""


def test_each_path_event_once_from_process_start_with_the_seconds_it_reports():
    start = datetime(2026, 12, 6, 15, 30, 9, 500000).timestamp()
    assert critical_path(LOG, start) == {"readahead": "0.23", "listening": "0.61", "load_timing": "10.11+9.49",
                                         "prepared_load": "10.20+11.62", "warm_up_wait": "10.50+0.25",
                                         "graph_capture": "11.95+1.05", "decode_graphs": "12.00+1.10",
                                         "prefill_warm_up": "14.50+2.40"}
