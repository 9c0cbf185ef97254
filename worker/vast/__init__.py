"""Vast.ai serverless, spoken natively by our aiohttp server (no PyWorker process, no proxy hop).

What the `vastai` package (1.9.1, `vastai/serverless/server/lib/`) does, and where this package does it instead:

* **Status** and **finished requests** (`metrics.py`): `reporter` (`VastReporter`).
* **Requests** (`backend.py` `Backend.__handle_request`): `envelope` (the `{auth_data, payload, session_id}` body),
  `signing` (the router's signature), `worker` (`VastWorker`: the key, admission, the request's life) and
  `middleware` (`vast_middleware` on our own routes, `openai_body`, `vast_verified`).
* **Benchmark** (`Backend.__run_benchmark`): `benchmark` (`measure_max_perf`, `cached_max_perf`).

Besides: `config` (`VastConfig`, from settings and the platform's environment), `workload` (`workload_of`, the
one unit for admission, cur_load and the benchmark) and `tls` (the instance certificate when USE_SSL=true).
"""

from worker.vast.benchmark import (
    BenchmarkFailed, benchmark_key, benchmark_payload, cached_max_perf, engine_generate_fn, measure_max_perf,
    measure_max_perf_within, read_cached_max_perf,
)
from worker.vast.config import VastConfig
from worker.vast.middleware import VAST_APP_KEY, openai_body, vast_middleware, vast_verified
from worker.vast.reporter import RequestRecord, VastReporter
from worker.vast.signing import load_public_key, verify_signature
from worker.vast.tls import ensure_instance_cert
from worker.vast.worker import PUBKEY_FAILED, VastWorker
from worker.vast.workload import workload_of

__all__ = [
    "PUBKEY_FAILED", "VAST_APP_KEY", "BenchmarkFailed", "RequestRecord", "VastConfig", "VastReporter", "VastWorker",
    "benchmark_key", "benchmark_payload", "cached_max_perf", "engine_generate_fn", "ensure_instance_cert",
    "load_public_key", "measure_max_perf", "measure_max_perf_within", "openai_body", "read_cached_max_perf", "vast_middleware",
    "vast_verified", "verify_signature", "workload_of",
]
