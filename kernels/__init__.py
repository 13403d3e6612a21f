"""Triton kernels for the paged KV cache, each beside its plain-torch reference.

The references define the contracts and run wherever Triton cannot (CPU).
"""
