"""The kernel entry points the harness measures, looked up at call time.

Every study calls `call("chunk", ...)` or `call("fused_recurrent", ...)`, never `kda.chunk_kda`
directly, so that a test can put a deliberately worsened kernel in `KERNELS` and show that `--check`
catches it (tests/test_accuracy_harness.py)."""

from __future__ import annotations

from .. import api

KERNELS = {"chunk": api.chunk_kda, "fused_recurrent": api.fused_recurrent_kda}
PUBLIC_NAME = {"chunk": "kda.chunk_kda", "fused_recurrent": "kda.fused_recurrent_kda"}


def call(kernel: str, *args, **kwargs):
    return KERNELS[kernel](*args, **kwargs)
