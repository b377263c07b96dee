"""Fused ops (Triton) with their pure-torch references (`reference.py`, the spec); `ops.kernel_ops(device)`
picks one set of them once."""
