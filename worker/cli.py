"""The `glmflash` console script."""

from __future__ import annotations

import argparse
import asyncio
import logging

from provision.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="glmflash", description="Serve GLM-5.3-Flash behind an OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load a model and serve it (no --model: the embedded tiny model on CPU)")
    serve.add_argument("--model", help="snapshot directory or Hugging Face id (org/name[@revision])")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--device", help="cuda, cpu or auto")
    serve.add_argument("--dtype", help="bfloat16, float32 or auto")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--served-model-name")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k != "command"}
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    from worker.serve import serve as run

    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
