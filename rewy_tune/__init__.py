"""rewy-tune: tuned ReWY Triton backward kernels for delta-rule linear attention.

Public surface: the four chunk ops (FLA-compatible), and the types the tuner and dispatcher share.
"""

from rewy_tune.ops import chunk_deltanet, chunk_gdn, chunk_gdn2, chunk_kda

__version__ = "0.1.0"

__all__ = ["chunk_deltanet", "chunk_gdn", "chunk_kda", "chunk_gdn2", "__version__"]
