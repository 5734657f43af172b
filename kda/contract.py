"""The checked front door of every `kda` kernel call.

`check_call` validates and normalises the arguments of `chunk_kda` and `fused_recurrent_kda` and returns a
`KDACall`, the one description the kernel launchers read. The contract is `docs/contract.md` (summarised
in README). The kernels assume valid input: every check lives here, one function per argument group, and
runs before anything is launched or written, so a failed call leaves `out` and the state pool untouched.

Decisions where the contract is silent (also in `docs/contract.md`):

- Inputs need stride 1 in their last dimension; token and head strides are free (a q/k/v split out of a
  fused projection is used as it is), except that with `B > 1` the batch stride must equal `T` times the
  token stride, so tokens of the flattened `[B*T]` axis sit at one stride. `beta` may have any strides
  of that form. Nothing is ever copied to make an input contiguous: a layout we cannot address raises.
- Dense and paged state planes (`[HV, K, V]` or `[HV, V, K]` per sequence or slot) must be dense; the
  slot (or sequence) stride may be larger than the plane (a padded pool).
- `state_v_first` must be given (True or False) whenever `state_cache` is: a square plane (K == V, the
  serving case) cannot reveal its layout and a transposed read would be silently wrong. With a dense
  `initial_state` or no state, `None` means False (fla's K-first layout).
- `output_final_state=True` together with `state_cache` raises: the paged contract writes the final state
  into the pool and returns `final_state=None`, and we do not silently ignore the flag.
- `A_log`, `dt_bias` or `lower_bound` without `use_gate_in_kernel=True` raise for the same reason, and so
  does `stochastic_rounding=True` where no state is stored.
- `cu_seqlens_cpu` is trusted and is never needed: the kernels map chunks to sequences on the device, so
  no call reads `cu_seqlens` back to the host. When given, it is checked against `T` and its shape
  (host-only checks); under `KDA_DEBUG` it is also compared with the device copy. One use: bounds
  0, 1, ..., N (a decode batch) let `fused_recurrent_kda` take its one-token kernel.
- Trailing rows: varlen bounds may end below T (`cu_seqlens[-1] <= T`; engines pad the token count for
  CUDA graphs). The rows past the last bound are zero in `o`, written by the kernels on the device.
- The oracle (`kda_reference`) validates through this same `check_call` with `oracle=True`: no Triton, any
  device, and the device values always read (as under KDA_DEBUG), so it accepts and rejects what `kda`
  does; `allow_float64=True` (the oracle's exact mode, never `kda`'s) adds float64 to every float dtype.
- `KDA_DEBUG` (read at every call) adds the checks that need a device-to-host read (a sync):
  `cu_seqlens` values, slot indices in range and unique among non-padding sequences. It accepts only
  unset, "", 0/false/off/no (off) and 1/true/on/yes (on), in any case; anything else raises.
- Speculative verify (`fused_recurrent_kda` only): `state_indices` int32 `[N, T_max]` (stride 1 along
  T_max; T_max >= the longest sequence, checked when the lengths are known on the host: dense, or
  `cu_seqlens_cpu`) names the slot receiving the state after each token (< 0: not kept), and
  `num_accepted_tokens` int32 `[N]` (only with the 2-D form) picks the column the initial state is read
  from (`num_accepted_tokens[n] - 1`, else column 0); a read slot < 0 marks a padding sequence. Values
  (accepted counts in 1..T_max, slots in range, written slots distinct, no sequence reading a slot another
  writes) are checked under KDA_DEBUG or when the indices live on the CPU. `stochastic_rounding` is not
  available with it (each token's rounding would need its own noise stream).
- Prefix-cache checkpoints (`chunk_kda` only): `checkpoint_every` (a positive multiple of 64, the walk's
  chunk) and `checkpoint_indices` (int32 or int64 `[N, C]`, stride 1 along C), given together and only
  with `state_cache`: the state after the first `(j + 1) * checkpoint_every` tokens of sequence n goes to
  slot `checkpoint_indices[n, j]` when that entry is >= 0 and the sequence reaches the offset. The slot
  values (in range, distinct, no sequence's final or read slot) are checked under KDA_DEBUG or when the
  indices live on the CPU, where the sequence lengths are known on the host; without that the kernel
  skips a slot outside the pool instead of writing it.
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# checkpoint_every must be a multiple of the walk's chunk (kda.plan.CHUNK), so that a checkpoint lands on a
# chunk boundary of the walk
CHECKPOINT_MULTIPLE = 64
DEBUG_OFF = ("", "0", "false", "off", "no")
DEBUG_ON = ("1", "true", "on", "yes")


def debug_enabled() -> bool:
    """`KDA_DEBUG` on turns on the checks that read device memory back to the host (they sync). Read at
    call time; an undocumented value raises instead of being taken as on or off."""
    value = os.environ.get("KDA_DEBUG", "")
    if not value:  # unset: the common case, no string work
        return False
    word = value.strip().lower()
    if word in DEBUG_OFF:
        return False
    if word in DEBUG_ON:
        return True
    raise ValueError(f"KDA_DEBUG={value!r} is not a documented value: use 1/true/on/yes to turn the debug "
                     "checks on, or 0/false/off/no (or leave it unset) for off")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(slots=True)
class KDACall:
    """A validated call, read-only by convention (not frozen: a frozen dataclass of this size costs several
    microseconds to build, paid on every call). Shapes: q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g
    `[B, T, HV, K]`; beta `[B, T, HV]`.

    State is described uniformly as a source pool and a destination pool of dense planes:
    `state_mode` is "none", "dense" or "paged"; `state_in` is the pool read (the dense `initial_state`
    or the paged `state_cache`), `state_indices` maps sequence -> slot (None: sequence n uses slot n),
    `has_initial_state` masks the read (None: read every non-padding slot).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    scale: float
    cu_seqlens: torch.Tensor | None
    state_mode: str
    state_in: torch.Tensor | None
    state_indices: torch.Tensor | None
    has_initial_state: torch.Tensor | None
    state_v_first: bool
    state_dtype: torch.dtype
    output_final_state: bool
    out: torch.Tensor | None
    use_qk_l2norm_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    use_gate_in_kernel: bool
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None
    # every sequence holds exactly one token, known without reading the device: dense with T == 1, or
    # varlen whose host copy of the bounds (cu_seqlens_cpu) is 0, 1, ..., N (a decode batch)
    one_token_per_seq: bool = False
    # speculative verify: state_indices is [N, T_max] (the slot after each token); num_accepted_tokens
    # int32 [N] or None picks the column the initial state is read from
    verify: bool = False
    num_accepted_tokens: torch.Tensor | None = None
    # prefix-cache checkpoints (chunk_kda, paged): the state after every `checkpoint_every` tokens of sequence
    # n to slot checkpoint_indices[n, j] (int32/int64 [N, C]; < 0: not kept); 0 and None without them
    checkpoint_every: int = 0
    checkpoint_indices: torch.Tensor | None = None
    # the caller's error word, int32 [N]: the kernels OR in what their guards found (`kda.ERROR_*` bits)
    errors: torch.Tensor | None = None
    # varlen bounds as Python ints where the host has them (`cu_seqlens_cpu`, or read under KDA_DEBUG)
    host_bounds: list[int] | None = None

    @property
    def state_plane_shape(self) -> tuple[int, int, int]:
        """Shape of one sequence's state plane in the caller's layout."""
        return (self.HV, self.V, self.K) if self.state_v_first else (self.HV, self.K, self.V)


class Dtypes(NamedTuple):
    """The dtypes a call may use: q, k, v (`inputs`), g, beta and the gate's parameters (`floats`), the state
    (`states`)."""

    inputs: tuple
    floats: tuple
    states: tuple


KDA_DTYPES = Dtypes(INPUT_DTYPES, FLOAT_DTYPES, STATE_DTYPES)
# the oracle's exact mode (`kda_reference`, allow_float64=True): float64 as well, everywhere
ORACLE_F64_DTYPES = Dtypes(*(d + (torch.float64,) for d in KDA_DTYPES))


def _require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_float(name: str, x: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def _require_shape(name: str, x: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(x.shape)}")


def _bad_token_layout(strides: tuple, last: int, B: int, T: int) -> bool:
    """`_check_token_layout`'s condition from one `stride()` tuple (`last`: the last dimension's size, 1 when
    it need not be contiguous)."""
    return (last > 1 and strides[-1] != 1) or (B > 1 and T > 1 and strides[0] != T * strides[1])


def _check_token_layout(name: str, x: torch.Tensor, B: int, T: int, last_unit: bool = True) -> None:
    """Tokens of the flattened [B*T] axis must sit at one stride; the last dim must be contiguous."""
    if last_unit and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension (got strides {x.stride()}); "
                         "kda never copies an input to make it contiguous")
    if B > 1 and T > 1 and x.stride(0) != T * x.stride(1):
        raise ValueError(f"{name} with B > 1 must have stride(0) == T * stride(1) so that the [B*T] token "
                         f"axis has one stride (got strides {x.stride()})")


def _check_plane_pool(name: str, pool: torch.Tensor, plane: tuple[int, int, int], what: str) -> None:
    """A pool of dense planes: dims 1..3 contiguous, the slot stride at least one plane (an empty pool, which
    no kernel reads, may have any strides: torch keeps a transpose's strides through `.contiguous()`)."""
    shape = pool.shape
    if len(shape) != 4 or shape[1:] != plane:
        raise ValueError(f"{name} must have shape {what} = [*, {', '.join(map(str, plane))}], "
                         f"got {list(shape)}")
    hv, a, b = plane
    st = pool.stride()
    if ((b > 1 and st[3] != 1) or (a > 1 and st[2] != b) or (hv > 1 and st[1] != a * b)) and pool.numel() > 0:
        raise ValueError(f"{name} must hold dense [{hv}, {a}, {b}] planes (strides [*, {a * b}, {b}, 1]), "
                         f"got strides {list(st)}")
    if shape[0] > 1 and st[0] < hv * a * b:
        raise ValueError(f"{name}.stride(0) must be at least one plane ({hv * a * b}), got {st[0]}")


def _check_state_pool(name: str, pool, plane: tuple[int, int, int], what: str, device: torch.device,
                      state_dtype, states: tuple = STATE_DTYPES) -> None:
    """A state pool (initial_state or state_cache): fp32/fp16/bf16 dense planes on the call's device, whose
    dtype is the storage dtype (a different `state_dtype` would be silently ignored, so it raises)."""
    _require_tensor(name, pool)
    _require_float(name, pool, states)
    if pool.device != device:
        raise ValueError(f"{name} must be on {device}, got {pool.device}")
    _check_plane_pool(name, pool, plane, what)
    if state_dtype is not None and state_dtype != pool.dtype:
        raise ValueError(f"state_dtype={state_dtype} differs from {name}.dtype={pool.dtype}; the final state "
                         f"keeps {name}'s dtype")


def _check_per_sequence(name: str, x, dtype: torch.dtype, N: int, device: torch.device) -> None:
    """A contiguous [N] tensor of `dtype` on the call's device (state_indices, has_initial_state)."""
    _require_tensor(name, x)
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).replace('torch.', '')}, got {x.dtype}")
    if x.shape != (N,) or x.device != device:
        raise ValueError(f"{name} must be [N] = [{N}] on {device}, got {list(x.shape)} on {x.device}")
    if N > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def byte_span(x: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes `x` spans (start == end when empty)."""
    start = x.data_ptr()
    if x.numel() == 0:
        return (start, start)
    extent = 1
    for size, stride in zip(x.shape, x.stride()):
        extent += (size - 1) * stride
    return (start, start + extent * x.element_size())


def check_call(
    fn: str,
    q, k, v, g, beta,
    scale,
    initial_state,
    output_final_state: bool,
    *,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log,
    dt_bias,
    lower_bound,
    cu_seqlens,
    cu_seqlens_cpu,
    state_v_first: bool | None,
    state_cache,
    state_indices,
    has_initial_state,
    state_dtype,
    out,
    require_has_initial_state: bool,
    stochastic_rounding: bool = False,
    seed: int = 0,
    num_accepted_tokens=None,
    checkpoint_every=None,
    checkpoint_indices=None,
    errors=None,
    oracle: bool = False,
    allow_float64: bool = False,
) -> KDACall:
    """Validate one call of `fn` ("chunk_kda" or "fused_recurrent_kda") and return its `KDACall`.
    `stochastic_rounding`, `seed` and `num_accepted_tokens` are `fused_recurrent_kda`'s (the defaults stand
    for `chunk_kda`); `checkpoint_every` and `checkpoint_indices` are `chunk_kda`'s; `errors` both's.
    `oracle`: the call is `kda_reference`'s (module docstring): CPU tensors need no interpreter and the device
    values are always checked, whatever `KDA_DEBUG` says; `allow_float64` (oracle only) adds float64 to every
    float dtype."""
    debug = oracle or debug_enabled()
    dtypes = ORACLE_F64_DTYPES if allow_float64 else KDA_DTYPES
    B, T, H, HV, K, V = _check_inputs(fn, q, k, v, g, beta, dtypes, oracle)
    device = q.device
    scale = _check_scale(scale, K)
    lower_bound = _check_gate_args(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K, device, dtypes.floats)
    N, one_token_per_seq, host_bounds = _check_sequences(cu_seqlens, cu_seqlens_cpu, q, B, T, debug)
    state_v_first = _check_state_layout(state_v_first, state_cache)
    mode, state_in, final_dtype = _check_state(
        fn, initial_state, output_final_state, state_cache, state_indices, has_initial_state, state_dtype,
        state_v_first, require_has_initial_state, HV, K, V, N, device, debug, dtypes.states)
    verify = mode == "paged" and state_indices.dim() == 2
    if verify or num_accepted_tokens is not None:
        _check_verify(fn, verify, state_indices, num_accepted_tokens, state_cache, cu_seqlens, host_bounds,
                      T, N, device, debug)
        one_token_per_seq = False  # the one-token kernel serves the plain path only
    if checkpoint_every is not None or checkpoint_indices is not None:
        checkpoint_every = _check_checkpoints(
            checkpoint_every, checkpoint_indices, mode, verify, state_cache, state_indices, has_initial_state,
            cu_seqlens, host_bounds, T, N, device, debug)
    else:
        checkpoint_every = 0
    _check_out(out, (q, k, v, g, beta), state_in, B, T, HV, V, v.dtype, device)
    if errors is not None:
        _check_per_sequence("errors", errors, torch.int32, N, device)
    _check_rounding(stochastic_rounding, seed, final_dtype, mode, output_final_state)
    if verify and stochastic_rounding:
        raise ValueError("stochastic_rounding=True is not available with state_indices of shape [N, T_max] "
                         "(speculative verify): each token's rounding would need its own noise stream")
    return KDACall(
        q=q, k=k, v=v, g=g, beta=beta, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, scale=scale,
        cu_seqlens=cu_seqlens, state_mode=mode, state_in=state_in,
        state_indices=state_indices if mode == "paged" else None,
        has_initial_state=has_initial_state if mode == "paged" else None,
        state_v_first=state_v_first, state_dtype=final_dtype,
        output_final_state=bool(output_final_state), out=out,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        one_token_per_seq=one_token_per_seq, verify=verify,
        num_accepted_tokens=num_accepted_tokens if verify else None,
        checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices, errors=errors,
        host_bounds=host_bounds,
    )


def _check_inputs(fn: str, q, k, v, g, beta, dtypes: Dtypes = KDA_DTYPES,
                  oracle: bool = False) -> tuple[int, int, int, int, int, int]:
    """q, k, v, g, beta: tensors on one device (CPU only in the interpreter, or for the oracle), dtypes,
    shapes, head dims and token strides. Returns (B, T, H, HV, K, V). Each check is one condition on the hot
    path; the loops that name the offending argument run only once a condition fails."""
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    Tensor = torch.Tensor
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(g, Tensor)
            and isinstance(beta, Tensor)):
        for name, x in named:
            _require_tensor(name, x)
    device = q.device
    if k.device != device or v.device != device or g.device != device or beta.device != device:
        for name, x in named[1:]:
            if x.device != device:
                raise ValueError(f"{name} is on {x.device} but q is on {device}; all tensors must share a device")
    if q.is_cpu and not oracle and not interpreting():
        raise ValueError(
            f"kda.{fn} got CPU tensors: the Triton kernels run on CPU only in the interpreter "
            "(set TRITON_INTERPRET=1 before importing kda; slow), or use the PyTorch oracle "
            f"kda_reference.{'chunk_kda' if fn == 'chunk_kda' else 'recurrent_kda'}")
    dtype = q.dtype
    _require_float("q", q, dtypes.inputs)
    if k.dtype != dtype or v.dtype != dtype:
        for name, x in (("k", k), ("v", v)):
            if x.dtype != dtype:
                raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")
    _require_float("g", g, dtypes.floats)
    _require_float("beta", beta, dtypes.floats)
    q_shape, v_shape = q.shape, v.shape
    if len(q_shape) != 4:
        raise ValueError(f"q must be 4-D [B, T, H, K], got shape {list(q_shape)}")
    B, T, H, K = q_shape
    if len(v_shape) != 4:
        raise ValueError(f"v must be 4-D [B, T, HV, V], got shape {list(v_shape)}")
    HV, V = v_shape[2], v_shape[3]
    if k.shape != q_shape:
        _require_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    if v_shape[0] != B or v_shape[1] != T:
        _require_shape("v", v, (B, T, HV, V), "[B, T, HV, V]")
    if g.shape != (B, T, HV, K):
        _require_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    if beta.shape != (B, T, HV):
        _require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if H < 1 or HV < 1 or HV % H != 0:
        raise ValueError(f"the value heads HV={HV} (v.shape[2]) must be a positive multiple of the q/k heads H={H}")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        for dim_name, d, where in (("K", K, "q.shape[3], k.shape[3]"), ("V", V, "v.shape[3]")):
            if not 1 <= d <= MAX_HEAD_DIM:
                raise ValueError(f"head dim {dim_name}={d} ({where}) is outside the supported 1..{MAX_HEAD_DIM}")
    bad = _bad_token_layout
    if (bad(q.stride(), K, B, T) or bad(k.stride(), K, B, T) or bad(v.stride(), V, B, T)
            or bad(g.stride(), K, B, T) or bad(beta.stride(), 1, B, T)):
        for name, x in named[:4]:
            _check_token_layout(name, x, B, T)
        _check_token_layout("beta", beta, B, T, last_unit=False)
    return B, T, H, HV, K, V


def _check_scale(scale, K: int) -> float:
    """None means K ** -0.5; otherwise a finite Python number, of any sign (zero or a negative scale is
    well-defined arithmetic, as in fla; docs/contract.md)."""
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python number or None, got {scale!r}")
    return float(scale)


def _check_gate_args(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV: int, K: int, device,
                     floats: tuple = FLOAT_DTYPES) -> float | None:
    """The in-kernel gate's parameters: only with `use_gate_in_kernel`; A_log `[HV]`, dt_bias `[HV*K]` or
    `[HV, K]`, lower_bound finite and < 0. Returns lower_bound as a float (or None)."""
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            for name, x in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
                if x is not None:
                    raise ValueError(f"{name} is only used with use_gate_in_kernel=True; it was given without it")
        return None
    if A_log is not None:
        _require_tensor("A_log", A_log)
        _require_float("A_log", A_log, floats)
        if A_log.numel() != HV or A_log.device != device:
            raise ValueError(f"A_log must hold HV={HV} values on {device}, got shape {list(A_log.shape)} "
                             f"on {A_log.device}")
        if A_log.dim() != 1 or (HV > 1 and A_log.stride(0) != 1):
            raise ValueError("A_log must be a contiguous 1-D tensor [HV]")
    if dt_bias is not None:
        _require_tensor("dt_bias", dt_bias)
        _require_float("dt_bias", dt_bias, floats)
        if dt_bias.shape not in ((HV * K,), (HV, K)) or dt_bias.device != device:
            raise ValueError(f"dt_bias must be [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}] on {device}, "
                             f"got {list(dt_bias.shape)} on {dt_bias.device}")
        if not dt_bias.is_contiguous():
            raise ValueError("dt_bias must be contiguous")
    if lower_bound is None:
        return None
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a negative Python number or None, got {lower_bound!r}")
    if not (lower_bound < 0 and math.isfinite(lower_bound)):
        raise ValueError(f"lower_bound must be finite and < 0, got {lower_bound}")
    return float(lower_bound)


def _check_sequences(cu_seqlens, cu_seqlens_cpu, q: torch.Tensor, B: int, T: int,
                     debug: bool) -> tuple[int, bool, list[int] | None]:
    """A dense batch (N = B) or varlen (B == 1, `cu_seqlens` [N+1] on the device, its host copy checked
    when given; the device values only under KDA_DEBUG). Returns (N, one_token_per_seq, host):
    `one_token_per_seq`, every sequence holds one token, known without reading the device; `host`, the
    varlen bounds as Python ints where they are on the host (`cu_seqlens_cpu`, or read under KDA_DEBUG),
    else None."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
        return B, T == 1, None
    _require_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if cu_seqlens.numel() > 1 and cu_seqlens.stride(0) != 1:
        raise ValueError("cu_seqlens must be contiguous")
    if B != 1:
        raise ValueError(f"cu_seqlens (varlen) needs B == 1, got q of shape {list(q.shape)}")
    N = cu_seqlens.numel() - 1
    one_token_per_seq, host = False, None
    if cu_seqlens_cpu is not None:
        host = host_bounds_list(cu_seqlens_cpu)
        if len(host) != N + 1:
            raise ValueError(f"cu_seqlens_cpu has {len(host)} entries, cu_seqlens has {N + 1}")
        # 0, 1, ..., N (a decode batch) are valid bounds when T == N: the general check is then redundant
        one_token_per_seq = T == N and host == list(range(N + 1))
        if not one_token_per_seq:
            _check_bounds("cu_seqlens_cpu", host, T)
    if debug:
        dev = cu_seqlens.tolist()
        _check_bounds("cu_seqlens", dev, T)
        if host is not None and dev != host:
            raise ValueError("cu_seqlens_cpu differs from cu_seqlens (KDA_DEBUG check)")
        host = dev
    return N, one_token_per_seq, host


def _check_state_layout(state_v_first, state_cache) -> bool:
    """`state_v_first` is required (True or False) with a pool; None means False (K-first, fla's layout)
    for a dense `initial_state` or no state."""
    if state_v_first is None:
        if state_cache is not None:
            raise ValueError("state_cache needs state_v_first=True (planes [slots, HV, V, K]) or "
                             "state_v_first=False (planes [slots, HV, K, V]): a square plane (K == V) cannot "
                             "reveal its layout, and a transposed read would be silently wrong")
        return False
    if not isinstance(state_v_first, bool):
        raise TypeError(f"state_v_first must be True, False or None, got {state_v_first!r}")
    return state_v_first


def _check_state(fn: str, initial_state, output_final_state, state_cache, state_indices, has_initial_state,
                 state_dtype, state_v_first: bool, require_has_initial_state: bool, HV: int, K: int, V: int,
                 N: int, device, debug: bool,
                 states: tuple = STATE_DTYPES) -> tuple[str, torch.Tensor | None, torch.dtype]:
    """One state contract: none, dense `initial_state` [N, plane] or paged `state_cache` [slots, plane]
    with `state_indices` and `has_initial_state` (slot range and uniqueness under KDA_DEBUG). Returns
    (mode, the pool read, the storage dtype of the final state)."""
    if initial_state is not None and state_cache is not None:
        raise ValueError("pass either initial_state (dense contract) or state_cache (paged contract), not both")
    plane = (HV, V, K) if state_v_first else (HV, K, V)
    plane_txt = "HV, V, K]" if state_v_first else "HV, K, V]"
    if state_cache is not None:
        _check_state_pool("state_cache", state_cache, plane, "[slots, " + plane_txt, device, state_dtype, states)
        if output_final_state:
            raise ValueError("output_final_state=True with state_cache: the paged contract writes the final "
                             "state into state_cache in place and returns final_state=None")
        if not (isinstance(state_indices, torch.Tensor) and state_indices.dim() == 2):
            _check_per_sequence("state_indices", state_indices, torch.int32, N, device)
        if has_initial_state is not None:
            _check_per_sequence("has_initial_state", has_initial_state, torch.bool, N, device)
        elif require_has_initial_state:
            raise ValueError(f"{fn} with state_cache needs has_initial_state (bool [N]); "
                             "pass torch.ones(N, dtype=torch.bool) if every slot holds a state")
        if debug and N > 0 and state_indices.dim() == 1:
            live = [i for i in state_indices.tolist() if i >= 0]
            if any(i >= state_cache.shape[0] for i in live):
                raise ValueError(f"state_indices has a slot >= slots={state_cache.shape[0]} (KDA_DEBUG check)")
            if len(set(live)) != len(live):
                raise ValueError("state_indices names one slot twice (KDA_DEBUG check)")
        return "paged", state_cache, state_cache.dtype
    if state_indices is not None or has_initial_state is not None:
        for name, x in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
            if x is not None:
                raise ValueError(f"{name} belongs to the paged contract and needs state_cache")
    if initial_state is not None:
        _check_state_pool("initial_state", initial_state, plane, "[N, " + plane_txt, device, state_dtype, states)
        if initial_state.shape[0] != N:
            raise ValueError(f"initial_state must have N={N} planes, got {initial_state.shape[0]}")
        return "dense", initial_state, initial_state.dtype
    final_dtype = torch.float32 if state_dtype is None else state_dtype
    if final_dtype not in states:
        names = ", ".join(str(d).replace("torch.", "") for d in states)
        raise TypeError(f"state_dtype must be one of {names}, got {final_dtype}")
    return "none", None, final_dtype


def _check_rows(name: str, x: torch.Tensor, N: int, device, col: str) -> None:
    """A row of indices per sequence: `[N, col]` on the call's device, stride 1 along `col` (the kernels
    step along a row with unit stride)."""
    if x.dim() != 2 or x.shape[0] != N or x.device != device:
        raise ValueError(f"{name} must be [N, {col}] = [{N}, {col}] on {device}, got {list(x.shape)} on {x.device}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} [N, {col}] must have stride 1 along {col}, got strides {x.stride()}")


def host_lengths(cu_seqlens, host_bounds: list[int] | None, T: int, N: int) -> list[int] | None:
    """Every sequence's length where the host knows it without a sync (dense; `host_bounds`; bounds on the
    CPU), else None."""
    if cu_seqlens is None:
        return [T] * N
    host = host_bounds
    if host is None and cu_seqlens.is_cpu:  # on the CPU the read costs no sync
        host = cu_seqlens.tolist()
    return None if host is None else list(map(operator.sub, host[1:], host[:-1]))  # C-level: N may be 1000s


def _check_verify(fn: str, verify: bool, state_indices, num_accepted_tokens, state_cache, cu_seqlens,
                  host_bounds: list[int] | None, T: int, N: int, device, debug: bool) -> None:
    """Speculative verify: `state_indices` int32 `[N, T_max]` with stride 1 along T_max and T_max >= every
    sequence's length where the lengths are known on the host (`host_bounds` from `_check_sequences`);
    `num_accepted_tokens` int32 `[N]`, only with it. The values are read (`_check_verify_values`) under
    KDA_DEBUG or when they live on the CPU."""
    if num_accepted_tokens is not None and not verify:
        raise ValueError("num_accepted_tokens needs state_cache and state_indices of shape [N, T_max] "
                         "(speculative verify)")
    if fn != "fused_recurrent_kda":
        raise ValueError(f"state_indices of shape [N, T_max] (speculative verify) is only accepted by "
                         f"fused_recurrent_kda; {fn} takes state_indices of shape [N]")
    if state_indices.dtype != torch.int32:
        raise TypeError(f"state_indices must be int32, got {state_indices.dtype}")
    _check_rows("state_indices", state_indices, N, device, "T_max")
    T_max = state_indices.shape[1]
    lengths = host_lengths(cu_seqlens, host_bounds, T, N)
    if lengths and max(lengths) > T_max:
        raise ValueError(f"state_indices [N, T_max] needs T_max >= the longest sequence ({max(lengths)}), "
                         f"got T_max={T_max}")
    if num_accepted_tokens is not None:
        _check_per_sequence("num_accepted_tokens", num_accepted_tokens, torch.int32, N, device)
    if N > 0 and (debug or state_indices.is_cpu) and lengths is not None:
        _check_verify_values(state_indices, num_accepted_tokens, lengths, state_cache.shape[0])


def _check_verify_values(state_indices, num_accepted_tokens, lengths: list[int], slots: int) -> None:
    """The values of a verify call (they need a device read): accepted counts in 1..T_max; every slot used
    (the read slot, and the slots written within each sequence's length) below `slots`; written slots
    distinct; no sequence reads a slot that another writes (a race between programs)."""
    T_max = state_indices.shape[1]
    columns = [0] * len(lengths)
    if num_accepted_tokens is not None:
        accepted = num_accepted_tokens.tolist()
        if any(not 1 <= a <= T_max for a in accepted):
            raise ValueError(f"num_accepted_tokens must lie in 1 .. T_max={T_max}, got {accepted}")
        columns = [a - 1 for a in accepted]
    rows = state_indices.tolist()
    reads = [row[c] for row, c in zip(rows, columns)]
    writes = [[s for s in row[:n] if s >= 0] if r >= 0 else [] for row, n, r in zip(rows, lengths, reads)]
    flat = [s for w in writes for s in w]
    if any(s >= slots for s in flat + reads):
        raise ValueError(f"state_indices has a slot >= slots={slots}")
    if len(set(flat)) != len(flat):
        raise ValueError("state_indices names one slot twice among the slots written")
    owner = {s: n for n, w in enumerate(writes) for s in w}
    for n, r in enumerate(reads):
        if r >= 0 and owner.get(r, n) != n:
            raise ValueError(f"state_indices: sequence {n} reads slot {r}, which sequence {owner[r]} writes")


def _check_checkpoints(checkpoint_every, checkpoint_indices, mode: str, verify: bool, state_cache, state_indices,
                       has_initial_state, cu_seqlens, host_bounds: list[int] | None, T: int, N: int, device,
                       debug: bool) -> int:
    """Prefix-cache checkpoints (`kda_reference.contract`'s rules and messages): both arguments or neither,
    a pool with 1-D `state_indices`, `checkpoint_every` a positive multiple of 64, `checkpoint_indices` an
    int32/int64 `[N, C]` tensor on the call's device with stride 1 along C. The slot values are read
    (`_check_checkpoint_values`) under KDA_DEBUG or when they live on the CPU, where the lengths are known
    on the host. Returns `checkpoint_every`."""
    if checkpoint_every is None or checkpoint_indices is None:
        given, missing = (("checkpoint_indices", "checkpoint_every") if checkpoint_every is None
                          else ("checkpoint_every", "checkpoint_indices"))
        raise ValueError(f"{given} was given without {missing}: checkpoint_every and checkpoint_indices are "
                         "given together")
    if mode != "paged" or verify:
        raise ValueError("checkpoint_indices needs state_cache with state_indices of shape [N] (not verify): "
                         "checkpoints are stored in pool slots")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise TypeError(f"checkpoint_every must be a positive multiple of {CHECKPOINT_MULTIPLE} (an int), "
                        f"got {checkpoint_every!r}")
    if checkpoint_every <= 0 or checkpoint_every % CHECKPOINT_MULTIPLE != 0:
        raise ValueError(f"checkpoint_every must be a positive multiple of {CHECKPOINT_MULTIPLE}, "
                         f"got {checkpoint_every!r}")
    _require_tensor("checkpoint_indices", checkpoint_indices)
    if checkpoint_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"checkpoint_indices must be int32 or int64, got {checkpoint_indices.dtype}")
    _check_rows("checkpoint_indices", checkpoint_indices, N, device, "C")
    if N > 0 and (debug or checkpoint_indices.is_cpu):
        lengths = host_lengths(cu_seqlens, host_bounds, T, N)
        if lengths is not None:
            _check_checkpoint_values(checkpoint_every, checkpoint_indices, state_cache.shape[0], state_indices,
                                     has_initial_state, lengths)
    return checkpoint_every


def _check_checkpoint_values(checkpoint_every: int, checkpoint_indices, slots: int, state_indices,
                             has_initial_state, lengths: list[int]) -> None:
    """The checkpoint slots a call writes (entries >= 0 of the checkpoints each non-padding sequence reaches)
    must lie in [0, slots), be distinct, and be no slot a final state is written to or read from (a race
    between programs). Entries past a sequence's length are not checked, as they are not written."""
    rows, finals = checkpoint_indices.tolist(), state_indices.tolist()
    reached = [row[:n // checkpoint_every] if s >= 0 else [] for row, n, s in zip(rows, lengths, finals)]
    used = [s for row in reached for s in row if s >= 0]
    if any(s >= slots for s in used):
        raise ValueError(f"checkpoint_indices has a slot >= slots={slots}, got {rows}")
    if len(set(used)) != len(used):
        raise ValueError(f"checkpoint_indices names one slot twice among the checkpoints written, got {rows}")
    flags = has_initial_state.tolist() if has_initial_state is not None else [True] * len(finals)
    ends = {s for s in finals if s >= 0}  # every slot read (flag true) is also a slot written at the end
    clash = set(used) & ends
    if clash:
        n = next(i for i, s in enumerate(finals) if s in clash)
        what = "reads and ends in" if flags[n] else "ends in"
        raise ValueError(f"checkpoint_indices names slot {finals[n]}, which sequence {n} {what} "
                         f"(state_indices {finals}); checkpoint slots must be distinct from those")


def _check_out(out, inputs, state_in, B: int, T: int, HV: int, V: int, dtype, device) -> None:
    """`out`: o's shape [B, T, HV, V] and v's dtype, addressable token layout, no overlap with an input or
    the state (byte ranges on the host, no sync)."""
    if out is None:
        return
    _require_tensor("out", out)
    if out.shape != (B, T, HV, V) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be [B, T, HV, V] = {[B, T, HV, V]} of dtype {dtype} on {device}, "
                         f"got {list(out.shape)} {out.dtype} on {out.device}")
    _check_token_layout("out", out, B, T)
    o0, o1 = byte_span(out)  # once, not once per tensor it is compared with
    for name, x in zip(("q", "k", "v", "g", "beta", "the state"), (*inputs, state_in)):
        # x's end is needed only when x starts before out's end
        if x is not None and x.data_ptr() < o1 and o0 < byte_span(x)[1]:
            raise ValueError(f"out overlaps {name}; it must be a separate buffer")


def _check_rounding(stochastic_rounding, seed, state_dtype: torch.dtype, mode: str, output_final_state) -> None:
    """`fused_recurrent_kda`'s stochastic rounding: a bool and an int seed; on only where a fp16/bf16
    state is stored."""
    if not isinstance(stochastic_rounding, bool):
        raise TypeError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not stochastic_rounding:
        return
    if state_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("stochastic_rounding=True needs fp16 or bf16 state storage; the state here is "
                         f"{state_dtype}")
    if mode == "none" and not output_final_state:
        raise ValueError("stochastic_rounding=True but no state is stored (no state_cache, no "
                         "output_final_state): the flag would change nothing")


def host_bounds_list(cu_seqlens_cpu) -> list[int]:
    """The host bounds as a list of Python ints."""
    bounds = cu_seqlens_cpu
    if isinstance(bounds, torch.Tensor):
        if not bounds.is_cpu:
            raise ValueError(f"cu_seqlens_cpu must live on the host, got a tensor on {bounds.device}")
        bounds = bounds.tolist()
    if type(bounds) in (list, tuple):
        try:
            # an int sum (taken in C) means int entries only: nothing to convert, no O(N) Python loop
            if type(sum(bounds)) is int:
                return list(bounds)
        except TypeError:
            pass
    try:
        return list(map(int, bounds))
    except TypeError:
        raise TypeError(f"cu_seqlens_cpu must be a CPU tensor or a sequence of ints, got "
                        f"{type(cu_seqlens_cpu).__name__}") from None


def _check_bounds(name: str, bounds: list[int], T: int) -> None:
    """Varlen bounds: from 0, non-decreasing, ending at most at T (the rows past the last bound, padding for a
    CUDA graph, are zero in o)."""
    if bounds[0] != 0 or bounds[-1] > T:
        raise ValueError(f"{name} must start at 0 and end at most at T={T}, got {bounds[0]} .. {bounds[-1]}")
    if sorted(bounds) != bounds:  # one C pass over sorted input
        raise ValueError(f"{name} must be non-decreasing")
