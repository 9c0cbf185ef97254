"""Every setting of the worker, in one pydantic-settings object read from the environment.

Variables are `GLMFLASH_<FIELD>` (e.g. `GLMFLASH_PORT=3000`); the common ones also answer to the
names users already set for other workers: `API_KEY`, `HF_TOKEN`, `MODEL_NAME`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, FilePath
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache_dir() -> Path:
    workspace = Path("/workspace")
    if workspace.is_dir() and os.access(workspace, os.W_OK):
        return workspace / "glmflash"
    return Path.home() / ".cache" / "glmflash"


def _env(name: str, *aliases: str) -> AliasChoices:
    return AliasChoices(f"GLMFLASH_{name}", *aliases)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(populate_by_name=True, extra="ignore")

    model: str | None = Field(None, validation_alias=_env("MODEL", "MODEL_NAME"),
                              description="Snapshot directory or Hugging Face id; unset serves the embedded tiny model")
    served_model_name: str | None = Field(None, validation_alias=_env("SERVED_MODEL_NAME"),
                                          description="Name in /v1/models and accepted in requests (default: the model's)")
    host: str = Field("0.0.0.0", validation_alias=_env("HOST"))
    port: int = Field(3000, validation_alias=_env("PORT", "WORKER_PORT"),
                      description="Listen port (Vast sets WORKER_PORT; its public side is VAST_TCP_PORT_<port>)")
    api_key: str | None = Field(None, validation_alias=_env("API_KEY", "API_KEY"),
                                description="When set, /v1 requests need 'Authorization: Bearer <key>'")
    hf_token: str | None = Field(None, validation_alias=_env("HF_TOKEN", "HF_TOKEN"))
    cache_dir: Path = Field(default_factory=lambda: _default_cache_dir(), validation_alias=_env("CACHE_DIR"),
                            description="Where snapshots (and the tiny model) are kept: /workspace/glmflash on "
                                        "the volume serverless platforms keep, else ~/.cache/glmflash")
    device: str = Field("auto", validation_alias=_env("DEVICE"), description="cuda, cpu or auto")
    dtype: str = Field("auto", validation_alias=_env("DTYPE"), description="bfloat16, float32 or auto")
    max_num_seqs: int = Field(16, ge=1, validation_alias=_env("MAX_NUM_SEQS"),
                              description="Requests decoding at once (one state slot each)")
    max_model_len: int = Field(8192, ge=16, validation_alias=_env("MAX_MODEL_LEN"),
                               description="Longest prompt + completion, in tokens")
    max_num_batched_tokens: int = Field(2048, ge=1, validation_alias=_env("MAX_NUM_BATCHED_TOKENS"),
                                        description="Tokens per forward step (decodes + prefill chunks)")
    max_prefill_tokens: int | None = Field(
        None, ge=1, validation_alias=_env("MAX_PREFILL_TOKENS"),
        description="Tokens per step when no request is decoding: under hybrid offload each prefill chunk brings "
                    "every host expert over PCIe once, so a lone long prompt prefills faster in longer chunks; the "
                    "reserve kept from expert slots grows with it (unset: under hybrid offload on a GPU chosen at "
                    "load from the link's measured rate and the free memory, else MAX_NUM_BATCHED_TOKENS)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", validation_alias=_env("KV_CACHE_DTYPE"),
        description="The DSA latent cache: auto (the activations' dtype) or fp8 (e4m3 with a scale per 128 values: "
                    "about half the memory a token, so about twice the context; logits within a few percent)")
    moe_vram_budget_gib: float | None = Field(None, ge=0, validation_alias=_env("MOE_VRAM_BUDGET_GIB"),
                                              description="GPU memory for routed experts, in GiB; the rest stay in "
                                                          "host RAM and run on the CPU (unset: every expert on the GPU "
                                                          "when the model fits, else whatever memory the caches leave)")
    cpu_expert_threads: int | None = Field(None, ge=1, validation_alias=_env("CPU_EXPERT_THREADS"),
                                           description="CPU threads computing the routed experts kept in host RAM "
                                                       "(default: with a GPU every core but one, without "
                                                       "torch's thread count)")
    cpu_expert_pin: bool = Field(True, validation_alias=_env("CPU_EXPERT_PIN"),
                                 description="With a GPU, pin each CPU expert thread to its own core (physical "
                                             "cores first, the first core left to the threads driving the GPU); "
                                             "skipped under a CPU quota, where the kernel places threads")
    expert_calibration: FilePath | None = Field(None, validation_alias=_env("EXPERT_CALIBRATION"),
                                                description="A text file of prompts, one per line, prefilled once at "
                                                            "start: hybrid placement puts the experts they route to "
                                                            "most in GPU slots first")
    pcie_expert_percent: int | None = Field(None, ge=0, le=100, validation_alias=_env("PCIE_EXPERT_PERCENT"),
                                            description="Share (percent) of a decode step's missed experts that "
                                                        "are copied over PCIe and run on the GPU while the CPU runs "
                                                        "the rest (default: from both rates measured at load)")
    mtp_drafts: bool = Field(False, validation_alias=_env("MTP_DRAFTS"),
                             description="Load the checkpoint's MTP layer and draft the next token with it after "
                                         "every step, only counting how often it is right (/metrics)")
    speculative_tokens: int = Field(0, ge=0, le=3, validation_alias=_env("SPECULATIVE_TOKENS"),
                                    description="Draft this many tokens a step with the MTP layer and verify them in "
                                                "the next one (speculative decoding: up to this many + 1 tokens a "
                                                "step; greedy output unchanged, sampled output from the same "
                                                "distribution); 0: off")
    measured_draft_length: bool = Field(True, validation_alias=_env("MEASURED_DRAFT_LENGTH"),
                                        description="With GLMFLASH_SPECULATIVE_TOKENS: draft 0 to that many tokens "
                                                    "each step, whichever the measured acceptance and step times "
                                                    "say gives the most tokens a second (off: always that many)")
    prefix_cache: bool = Field(True, validation_alias=_env("PREFIX_CACHE"),
                               description="Start each request from the saved state of the longest prompt prefix "
                                           "seen before (shared system prompts, conversation turns, n > 1)")
    prefix_cache_gib: float = Field(4.0, ge=0, validation_alias=_env("PREFIX_CACHE_GIB"),
                                    description="Device memory for cached prefixes, in GiB: KDA state snapshots "
                                                "(about 141 MiB each on the full model) and latent pages")
    prefix_cache_host_gib: float = Field(0.0, ge=0, validation_alias=_env("PREFIX_CACHE_HOST_GIB"),
                                         description="Host RAM, in GiB, that prefixes evicted from the device move "
                                                     "to (0: evicted prefixes are dropped)")
    max_queue: int = Field(256, ge=0, validation_alias=_env("MAX_QUEUE"),
                           description="Requests waiting for a slot; beyond it the server answers 429")
    tool_call_parser: str = Field("glm45", validation_alias=_env("TOOL_CALL_PARSER"))
    reasoning_parser: str = Field("glm45", validation_alias=_env("REASONING_PARSER"))
    log_level: str = Field("INFO", validation_alias=_env("LOG_LEVEL"))

    # Images (chat `image_url` parts; a checkpoint without a vision tower answers them with 400)
    max_images_per_request: int = Field(16, ge=0, validation_alias=_env("MAX_IMAGES_PER_REQUEST"),
                                        description="Images one chat request may carry; 0 turns images off")
    max_image_bytes: int = Field(20 << 20, ge=1, validation_alias=_env("MAX_IMAGE_BYTES"),
                                 description="Largest encoded image (a data: URL's decoded bytes or a fetched "
                                             "body, which stops being read past it)")
    max_image_pixels: int = Field(50_000_000, ge=1, validation_alias=_env("MAX_IMAGE_PIXELS"),
                                  description="Largest image, width x height, checked from its header before it "
                                              "is decoded")
    fetch_image_urls: bool = Field(True, validation_alias=_env("FETCH_IMAGE_URLS"),
                                   description="Fetch http(s) image URLs; off, only data: URLs are accepted (the "
                                               "server then makes no requests on a client's behalf)")
    image_fetch_timeout_s: float = Field(10.0, gt=0, validation_alias=_env("IMAGE_FETCH_TIMEOUT_S"),
                                         description="Time to fetch one image URL, connection to last byte")

    # Provisioning
    model_revision: str | None = Field(None, validation_alias=_env("MODEL_REVISION", "MODEL_REVISION"),
                                       description="Pinned Hugging Face revision (a commit hash; default: main)")
    s3_uri: str | None = Field(None, validation_alias=_env("S3_URI"),
                               description="s3://bucket/prefix holding a snapshot; used instead of the hub when set")
    s3_endpoint_url: str | None = Field(None, validation_alias=_env("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"),
                                        description="Endpoint of an S3-compatible store (MinIO, R2, ...)")
    download_workers: int = Field(8, ge=1, validation_alias=_env("DOWNLOAD_WORKERS"),
                                  description="Parallel downloads / ranged GETs")
    prepare_busy_mb_s: float = Field(
        200.0, ge=0, validation_alias=_env("PREPARE_BUSY_MB_S"),
        description="The prepared snapshot's write after ready, while requests run: at most this many MB/s, one "
                    "piece at a time, its threads beside the CPU expert workers' cores (0: it waits until no request "
                    "runs); idle, it writes at the disk's rate")
    kernel_precompile_processes: int | None = Field(
        None, ge=0, validation_alias=_env("KERNEL_PRECOMPILE_PROCESSES"),
        description="Child processes compiling the shipped GPU kernels the volume's cache lacks while the weights "
                    "load (0: none, they compile in the server; default: a quarter of the cores, at most 4)")
    prebuilt_kernels: Path | None = Field(
        None, validation_alias=_env("PREBUILT_KERNELS"),
        description="A directory of GPU kernels compiled when the image was built (`python -m "
                    "engine.kernels.prebuilt DIR`; the Docker image sets it): copied into the volume's Triton "
                    "cache at start, so a first start compiles only what it lacks")
    ready_at: Literal["loaded", "partial"] = Field(
        "loaded", validation_alias=_env("READY_AT"),
        description="When /ready turns 200: loaded (every weight in place) or partial (the non-expert weights in "
                    "place; routed experts fill in the background and a step reads the ones it needs first)")
    expert_fill_gbps: float | None = Field(None, gt=0, validation_alias=_env("EXPERT_FILL_GBPS"),
                                           description="With ready_at=partial, a cap on the background expert "
                                                       "fill's read rate in GB/s (unset: as fast as the disk)")
    start_window_s: float = Field(300.0, gt=0, validation_alias=_env("START_WINDOW_S"),
                                  description="Budget from container start to ready; stage lines report what is left")

    # Lifecycle
    drain_grace_s: float = Field(30.0, ge=0, validation_alias=_env("DRAIN_GRACE_S"),
                                 description="On SIGTERM, how long in-flight requests may run before exit")
    idle_timeout_s: float = Field(0.0, ge=0, validation_alias=_env("IDLE_TIMEOUT_S"),
                                  description="Park (exit cleanly) after this long without work; 0 disables")
    controller_url: str | None = Field(None, validation_alias=_env("CONTROLLER_URL"),
                                       description="Inactivity controller that receives idle/busy reports")

    # Vast.ai serverless (names as the platform injects them; absent = plain mode)
    vast: bool = Field(False, validation_alias=_env("VAST"),
                       description="Serve under Vast's serverless controller even if REPORT_ADDR is not injected "
                                   "(the endpoint templates set it)")
    container_id: str | None = Field(None, validation_alias=AliasChoices("CONTAINER_ID"))
    report_addr: str | None = Field(None, validation_alias=AliasChoices("REPORT_ADDR"))
    master_token: str | None = Field(None, validation_alias=AliasChoices("MASTER_TOKEN"))
    unsecured: bool = Field(False, validation_alias=AliasChoices("UNSECURED"))
    public_ipaddr: str | None = Field(None, validation_alias=AliasChoices("PUBLIC_IPADDR"))
    vast_max_queue_time: float = Field(30.0, gt=0, validation_alias=_env("VAST_MAX_QUEUE_TIME"),
                                       description="Queued workload / max_perf above which Vast requests get 429")
    vast_benchmark_s: float = Field(20.0, gt=0, validation_alias=_env("VAST_BENCHMARK_S"),
                                    description="Time for the startup benchmark behind max_perf, in all: a short "
                                                "first round sizes the rest to fit")
    vast_default_max_tokens: int = Field(256, ge=1, validation_alias=_env("VAST_DEFAULT_MAX_TOKENS"),
                                         description="max_tokens assumed for workload units when a chat request omits it")

    @property
    def moe_vram_budget_bytes(self) -> int | None:
        return None if self.moe_vram_budget_gib is None else int(self.moe_vram_budget_gib * 2 ** 30)

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_gib * 2 ** 30)

    @property
    def prefix_cache_host_bytes(self) -> int:
        return int(self.prefix_cache_host_gib * 2 ** 30)

    @property
    def vast_mode(self) -> bool:
        """Running under Vast's serverless controller: a Vast container (CONTAINER_ID) that either got
        REPORT_ADDR or was told so by its template. A plain Vast instance stays in plain mode."""
        return bool(self.container_id and (self.report_addr or self.vast))

    @property
    def vast_report_addr(self) -> str:
        return self.report_addr or "https://run.vast.ai"  # the framework's own default

    @property
    def model_source(self) -> str | None:
        """The snapshot to serve: the S3 URI when set, else `model`; None: the embedded tiny model."""
        return self.s3_uri or self.model

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        if not self.model_source:  # the embedded tiny model is a CPU demo unless asked otherwise
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"
