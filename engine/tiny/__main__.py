"""python -m engine.tiny OUT_DIR [--format bf16|fp8|nvfp4-ct|nvfp4-modelopt] [--seed N]"""

from __future__ import annotations

import argparse

from engine.tiny.factory import FORMATS, write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.tiny", description="Write a tiny glm5_next snapshot.")
    parser.add_argument("out_dir")
    parser.add_argument("--format", default="bf16", choices=sorted(FORMATS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_tiny_model(args.out_dir, args.format, args.seed)
    print(f"tiny_model path={path} format={args.format} seed={args.seed}")


if __name__ == "__main__":
    main()
