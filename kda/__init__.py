"""kda: Kimi Delta Attention kernels for serving (chunked prefill and paged decode, in Triton)."""

from typing import TYPE_CHECKING

__all__ = ["chunk_kda", "fused_recurrent_kda"]
__version__ = "0.1.0"

# Bits of the error word a call fills when given `errors=` (int32 [N]): what the kernels' guards found for a
# sequence from device values the host did not read (docs/contract.md).
ERROR_SLOT = 1  # its state slot (or verify's read slot) at or past the pool's slot count: a no-op sequence
ERROR_BOUNDS = 2  # its varlen bounds outside 0 <= bos <= eos <= T: a no-op sequence, no output row written
ERROR_ACCEPTED = 4  # num_accepted_tokens outside 1..T_max (speculative verify): a no-op sequence
ERROR_KEPT_SLOT = 8  # a slot named to keep a state (verify's per-token slots, a checkpoint) past the pool: skipped

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
