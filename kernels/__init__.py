"""ReWY kernels: fp64 token recurrences (ground truth), the pure-torch chunk forward and ReWY backward
(the CPU backend and the oracle), the Triton backward stages, and the autograd Functions that join them."""
