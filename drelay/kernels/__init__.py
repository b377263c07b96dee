"""Fused ops (Triton) with their pure-torch references; `reference.kernel(op, *tensors)` picks one."""
