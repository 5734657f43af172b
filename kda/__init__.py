"""kda: Kimi Delta Attention kernels for serving (chunked prefill and paged decode, in Triton)."""

from typing import TYPE_CHECKING

__all__ = ["chunk_kda", "fused_recurrent_kda"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import chunk_kda, fused_recurrent_kda


def __getattr__(name: str):
    # torch and triton load on first use, not on `import kda`: `python -m kda.accuracy` can then check its
    # optional dependencies (and TRITON_INTERPRET) before paying for them.
    if name in __all__:
        from . import api

        fn = globals()[name] = getattr(api, name)  # later lookups skip this hook
        return fn
    raise AttributeError(f"module 'kda' has no attribute {name!r}")
