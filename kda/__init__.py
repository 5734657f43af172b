"""kda: Kimi Delta Attention kernels for serving (chunked prefill and paged decode, in Triton)."""

from .api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
__version__ = "0.1.0"
