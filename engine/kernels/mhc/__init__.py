"""mHC (manifold-constrained hyper-connections): stream mixing weights, collapse and combine."""
