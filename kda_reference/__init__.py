"""Float64 PyTorch oracle of Kimi Delta Attention (KDA): the math every `kda` kernel must equal.

Per value head, with state ``S`` ``[K, V]``, log-decay ``g_t`` ``[K]`` and scalar ``beta_t``::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

- ``recurrent_kda``: token by token (the definition).
- ``chunk_kda``: the chunked WY/UT form of the Triton kernels; equal to ``recurrent_kda`` in float64.
- ``kda_gate``, ``l2norm``, ``prepare_inputs``: the optional in-kernel pre-processing.

Both functions share the call contract of ``kda.chunk_kda`` (sequences, dense and paged state); see
``kda_reference.contract`` for the decisions the oracle makes where the contract is silent.
"""

from .chunk import chunk_kda
from .preprocess import kda_gate, l2norm, prepare_inputs
from .recurrent import recurrent_kda

__all__ = ["chunk_kda", "kda_gate", "l2norm", "prepare_inputs", "recurrent_kda"]
