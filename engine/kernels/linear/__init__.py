"""Linear layers over any stored weight format (dense, FP8 block, NVFP4)."""
