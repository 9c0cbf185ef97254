"""MoE routing: sigmoid scores, biased top-k selection, normalised weights in one launch on CUDA."""
