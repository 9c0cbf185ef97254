"""RMSNorm: one launch per call on CUDA instead of a chain of elementwise ops."""
