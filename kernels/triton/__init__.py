"""Triton kernels of the ReWY backward, one module per pipeline stage."""
