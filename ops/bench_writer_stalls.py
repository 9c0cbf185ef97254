"""How long the serving thread waits on the GIL while the prepared snapshot's writers run, by the writers' place.

The serving loop is Python: a writer thread that takes the GIL and is then kept from a core holds it up. This
puts a spinning process on each CPU the expert workers would hold (all but the first) and one on the first (the
threads that drive the device: a spinning doorbell listener, the step thread), runs a busy Python loop on the
first as the serving thread, and 8 writer threads doing what the prepared write does per piece (a 4 MiB
pwrite and its CRC) paced by `worker.prepare_pace.ServingFirst` as a server paces them while requests run
(`--busy-mb-s`, GLMFLASH_PREPARE_BUSY_MB_S's default):
  none: no writers (the serving loop's own rate);
  beside: where the server puts them now (`engine.cpu_cores.background_cpus`), at the normal priority: here the
          first CPU, the serving thread's, the last resort where every other CPU holds an expert worker (a server
          leaves more CPUs free: CPU 15 of 16 on the H100 machine);
  idle / nice: floating under SCHED_IDLE or at nice 19, as earlier versions ran them.
Prints the serving loop's longest gap, the time it spent in gaps over 50 ms and its loops:
  python3 -m ops.bench_writer_stalls --seconds 6 --policies none,beside,idle,nice
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import zlib

from engine.cpu_cores import allowed_cpus, background_cpus
from worker.prepare_pace import ServingFirst

PIECE = 4 << 20


def run(policy: str, seconds: float, directory: str, busy_bytes_per_s: float) -> dict:
    cpus = allowed_cpus()
    expert_cpus = cpus[1:] or cpus
    hogs = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{cpu}])\nwhile True: pass"])
            for cpu in expert_cpus + cpus[:1]]
    os.sched_setaffinity(0, cpus[:1])  # the serving thread on the first CPU, as worker_cpus leaves it
    stop = threading.Event()
    place = (lambda: background_cpus(expert_cpus, cpus)) if policy == "beside" else (lambda: cpus)
    pace = ServingFirst(lambda: True, busy_bytes_per_s, stop.wait, cpus=place)
    data = os.urandom(PIECE)

    def write(index: int) -> None:
        thread = threading.get_native_id()
        if policy == "idle":
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        elif policy == "nice":
            os.setpriority(os.PRIO_PROCESS, thread, 19)
        fd = os.open(os.path.join(directory, f"piece-{index}"), os.O_WRONLY | os.O_CREAT, 0o644)
        while not stop.is_set():
            pace(PIECE)
            os.pwrite(fd, data, 0)
            zlib.crc32(data)
        os.close(fd)

    writers = [threading.Thread(target=write, args=(i,)) for i in range(0 if policy == "none" else 8)]
    time.sleep(0.5)  # the spinners on their cores
    for thread in writers:
        thread.start()
    gaps, end = [], time.monotonic() + seconds
    last = time.monotonic()
    while last < end:
        sum(range(2000))
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    stop.set()
    for thread in writers:
        thread.join()
    for hog in hogs:
        hog.kill()
        hog.wait()
    os.sched_setaffinity(0, cpus)
    return {"policy": policy, "longest_gap_ms": round(max(gaps) * 1e3, 1),
            "gaps_over_50ms_s": round(sum(g for g in gaps if g > 0.05), 2), "loops": len(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--policies", default="none,beside,idle,nice")
    parser.add_argument("--busy-mb-s", type=float, default=200.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        for policy in args.policies.split(","):
            figures = run(policy, args.seconds, directory, args.busy_mb_s * 1e6)
            print(" ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
