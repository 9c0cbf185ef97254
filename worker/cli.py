"""The `glmflash` console script."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from engine.checkpoint.prepared_store import prepared_files
from provision.cache import PREPARED_DIRNAME, model_home
from provision.readahead import snapshot_files, start_readahead
from worker.compile_cache import seed_prebuilt_kernels, use_compile_cache
from worker.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="glmflash", description="Serve GLM-5.3-Flash behind an OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("boot", "provision (cold or fast_resume), load, warm up and serve; the container entrypoint"),
                       ("serve", "the same, for interactive use (no --model: the embedded tiny model on CPU)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--model", help="snapshot directory, Hugging Face id (org/name[@revision]) or s3:// URI")
        cmd.add_argument("--cache-dir")
        cmd.add_argument("--host")
        cmd.add_argument("--port", type=int)
        cmd.add_argument("--device", help="cuda, cpu or auto")
        cmd.add_argument("--dtype", help="bfloat16, float32 or auto")
        cmd.add_argument("--max-model-len", type=int)
        cmd.add_argument("--max-num-seqs", type=int)
        cmd.add_argument("--moe-vram-budget-gib", type=float, help="GPU memory for routed experts; the rest run from host RAM")
        cmd.add_argument("--served-model-name")
        cmd.add_argument("--ready-at", choices=("loaded", "partial"),
                         help="ready once every weight is loaded, or once all but the routed experts are")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k != "command"}
    if overrides.get("model", "").startswith("s3://"):
        overrides["s3_uri"] = overrides.pop("model")
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    triton_dir = use_compile_cache(settings.cache_dir)  # before the engine's kernels are defined
    seeded = seed_prebuilt_kernels(settings.prebuilt_kernels, triton_dir)
    logging.getLogger("glmflash.cli").info("event=compile_cache dir=%s autotuning=%s prebuilt=%s seeded=%d",
                                           triton_dir, os.environ["TRITON_CACHE_AUTOTUNING"],
                                           settings.prebuilt_kernels, seeded)
    from engine.cpu_cores import cap_torch_threads, quota_cores

    before, after = cap_torch_threads()
    logging.getLogger("glmflash.cli").info("event=cpu_threads torch_before=%d torch=%d cpu_quota=%s", before, after,
                                           quota_cores())
    from worker.serve import CannotListen, serve as run

    # Once the imports are done: reading ahead beside them slowed them more than it saved the load (their page
    # faults queued behind the readahead's reads), while from here to the load's first read (the memory plan, the
    # host banks' allocation, the kernels' preload) the disk would sit idle.
    spec = settings.model_source  # none: the embedded tiny model, nothing worth reading ahead
    if spec:
        files = (prepared_files(model_home(settings.cache_dir, spec, settings.model_revision) / PREPARED_DIRNAME)
                 or snapshot_files(Path(spec)))
        readahead = start_readahead(files)  # a child process that ends on its own
        logging.getLogger("glmflash.cli").info("event=readahead files=%d bytes=%d", len(files), readahead.bytes)
    try:
        asyncio.run(run(settings))
    except CannotListen as error:
        logging.getLogger("glmflash.cli").error('event=listen_failed host=%s port=%d reason="%s" hint="another '
                                                'port: --port or GLMFLASH_PORT"', error.host, error.port, error.reason)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
