"""The clamped SwiGLU of the dense MLPs (the shared experts): one launch on CUDA instead of four."""
