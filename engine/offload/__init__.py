"""Hybrid expert offload: which routed experts live in device memory, which in host RAM, and how they move."""
