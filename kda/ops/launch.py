"""Kernel launches without Triton's per-launch binding.

`kernel[grid](*args, **meta)` on a `triton.jit` function binds every argument, specialises each one in
native code, builds a cache key from the options and only then calls the compiled kernel's C launcher:
several times the launcher's own host time (docs/performance.md, "Host cost per call"). `direct` wraps a kernel so that a launch whose
specialisation was seen before goes straight to the compiled kernel's launcher.

The specialisation key is computed here, per argument, as Triton computes it (`native_specialize_impl`,
the same in Triton 3.6 and 3.9): a tensor by its dtype and whether its address is a multiple of 16; an
int by whether it equals 1 (then a constant), is a multiple of 16, and which of i32, i64 or u64 holds it;
a host TMA descriptor by its dtype and block shape; a float, a bool or None by its type; an argument in the
kernel's `do_not_specialize` by its type alone. Together with the constexpr and option keywords (`meta`)
and the current device, that key names exactly one compiled kernel. Tensors reach the launcher as their
addresses. A launch falls back to Triton's own path (which compiles on a miss) for an argument of any
other type, while a launch hook is registered (a profiler's), under the interpreter, and for a kernel whose
signature this key cannot cover.

This module is the one place that reads Triton's internals (the specialisation rules, its launchers' attributes
and closures, its launch hooks): `kda.replay` reaches the compiled launchers only through `DirectKernel.compiled`,
`launcher_entry`, `tma_encoder`, `with_pdl` and `HostDescriptor`. Those internals were read from the Triton
versions in `TESTED_TRITON`; on any other version (`FAST_PATH` false) every launch is Triton's own
`kernel[grid](...)`, and `kda.replay` records nothing.

`RECORD.launches`, when a list, receives every launch this thread makes as (kernel, grid, run-time arguments,
keywords, stream), and every `wait_stream` between streams, for `kda.replay`.
"""

from __future__ import annotations

import re
import threading

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

_I32 = 2**31
_I64 = 2**63

# (major, minor) of the Triton releases the fast path was tested with (3.6.0 on the GPU machine, 3.9.0 on CPU);
# pyproject.toml's range holds them
TESTED_TRITON = ((3, 6), (3, 9))


def fast_path_tested(version: str) -> bool:
    """Whether Triton `version` (a `triton.__version__` string) is one the fast path was tested with."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m[1]), int(m[2])) in TESTED_TRITON


FAST_PATH = fast_path_tested(triton.__version__)
# a device's current stream handle, without a torch Stream object (absent from CPU-only torch builds)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

RECORD = threading.local()
RECORD.launches = None


class _Slow(Exception):
    """An argument the key does not cover: Triton's own launch path takes the call."""


def int_class(x: int) -> int:
    """Triton's integer type for a run-time int: 0 i32, 1 i64, 2 u64."""
    return 0 if -_I32 <= x < _I32 else (1 if -_I64 <= x < _I64 else 2)


def specialization(args: tuple, fixed: tuple) -> tuple[tuple, list]:
    """(key, launcher arguments) of a kernel's run-time arguments: two argument lists get one key exactly when
    Triton specialises them alike (`fixed[i]`: argument i is in the kernel's `do_not_specialize`); tensors
    become their addresses, TMA descriptors stay objects (the launcher encodes them). Raises `_Slow` for an
    argument of another type."""
    key = []
    vals = []
    for x, fixed_i in zip(args, fixed):
        t = type(x)
        if t is torch.Tensor or isinstance(x, torch.Tensor):
            p = x.data_ptr()
            key.append((x.dtype, fixed_i or p & 15 == 0))
            vals.append(p)
            continue
        if t is int:
            if fixed_i:
                key.append(int_class(x))
            elif x == 1:
                key.append(None)  # Triton makes an argument equal to 1 a constant
            else:
                key.append((int_class(x), x & 15 == 0))
        elif t is TensorDescriptor:  # Triton: its dtype and block shape; the launcher encodes the rest
            key.append((x.base.dtype, tuple(x.block_shape), x.padding))
        elif t is float:
            key.append(1.5)
        elif t is bool:
            key.append("u1")  # as Triton: a bool is its own type, whatever its value
        elif x is None:
            key.append("None")
        else:
            raise _Slow
        vals.append(x)
    return tuple(key), vals


# Compile options every kernel states rather than inherits, so that its numerics do not follow Triton's defaults:
# fused multiply-adds (Triton 3.9 warns that 3.10 turns its default off)
NUMERICS = {"enable_fp_fusion": True}


class DirectKernel:
    """A `triton.jit` kernel launched as `kernel[grid](*args, **meta)` (run-time arguments positional, in
    the signature's order; constexprs and launch options by keyword), through the compiled kernel's
    launcher once its specialisation has been launched through Triton. `fn` is the JIT function;
    `fast_path=False` (default: `FAST_PATH`, the Triton version's) launches every call through `fn`.
    `drops_overflow`: the kernel computes lanes that may overflow to inf and then drops them by a select (`direct`);
    under the interpreter its launches run with numpy's overflow and invalid-value warnings off."""

    def __init__(self, fn, fast_path: bool | None = None, drops_overflow: bool = False):
        self.fn = fn
        self._cache: dict = {}
        self._quiet = drops_overflow and knobs.runtime.interpret
        params = getattr(fn, "params", None)
        # None: not a JIT function we can bypass (the interpreter's), every launch goes through `fn`
        self._plain = None
        if fast_path is None:
            fast_path = FAST_PATH
        if fast_path and params is not None and not knobs.runtime.interpret:
            runtime = [p for p in params if not p.is_constexpr]
            # the run-time arguments must come first, unannotated and specialised the default way
            if (all(not p.is_constexpr for p in params[:len(runtime)])
                    and not any(p.annotation_type or p.is_const or p.do_not_specialize_on_alignment
                                for p in runtime)):
                self._plain = tuple(p.do_not_specialize for p in runtime)
                self._constexprs = tuple((p.name, p.default) for p in params[len(runtime):])

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    @property
    def direct(self) -> bool:
        """Whether a launch can skip Triton's binding (the fast path on, a JIT function off the interpreter)."""
        return self._plain is not None

    def position(self, name: str) -> int | None:
        """The position of run-time argument `name` among the launcher's arguments, or None."""
        names = self.fn.arg_names
        return names.index(name) if name in names else None

    def compiled(self, args: tuple, meta: dict) -> tuple | None:
        """(launcher, its prefix, function, packed metadata, constexpr tail, launcher arguments) of the binary a
        launch with these arguments runs, as `launch` calls it: `run(gx, gy, gz, stream, function, *prefix,
        packed, None, None, None, *arguments, *tail)`; None where that launch would go through Triton's own
        path (the fast path off, an argument the key does not cover, a specialisation not launched yet)."""
        if self._plain is None or len(args) != len(self._plain):
            return None
        try:
            key, vals = self.key(args, meta)
        except _Slow:
            return None
        hit = self._cache.get(key)
        return None if hit is None else (*hit, vals)

    def key(self, args: tuple, meta: dict) -> tuple[tuple, list]:
        """(the compiled kernel's key in this kernel's cache, launcher arguments) of one launch on the current
        device; raises `_Slow` where `specialization` does."""
        spec, vals = specialization(args, self._plain)
        return (torch.cuda.current_device(), spec, tuple(meta.items())), vals

    def launch(self, grid, args: tuple, meta: dict):
        record = getattr(RECORD, "launches", None)
        if record is not None:
            stream = raw_stream(torch.cuda.current_device()) if raw_stream is not None else None
            record.append((self, grid, args, meta, stream))
        plain = self._plain
        if self._quiet:
            import numpy as np  # the interpreter's arithmetic

            with np.errstate(over="ignore", invalid="ignore"):  # inf, and inf - inf, in the dropped lanes
                return self.fn[grid](*args, **meta, **NUMERICS)
        if plain is None or len(args) != len(plain) or knobs.runtime.launch_enter_hook.calls:
            return self.fn[grid](*args, **meta, **NUMERICS)
        try:
            key, vals = self.key(args, meta)
        except _Slow:
            return self.fn[grid](*args, **meta, **NUMERICS)
        device = key[0]
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.fn[grid](*args, **meta, **NUMERICS)  # compiles on a miss, and launches
            if getattr(compiled, "packed_metadata", None) is not None:
                run, prefix = launcher_entry(compiled.run)  # .run: a property that loads the binary if needed
                tail = tuple(meta.get(name, default) for name, default in self._constexprs)
                self._cache[key] = (run, prefix, compiled.function, compiled.packed_metadata, tail)
            return compiled
        run, prefix, function, packed, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, raw_stream(device), function, *prefix, packed, None, None, None, *vals, *tail)
        return None


def launcher_entry(run) -> tuple:
    """(entry, prefix): calling `entry(gx, gy, gz, stream, function, *prefix, packed metadata, launch metadata,
    enter hook, exit hook, *arguments)` launches as `run(gx, gy, gz, stream, function, packed metadata, ...)`
    does. Triton 3.6's `CudaLauncher.__call__` only allocates scratch (none when the kernel asks for none) and
    passes its cooperative-grid and PDL flags on to `launch`: called directly, a Python frame less a launch.
    Any other launcher (Triton 3.9's binds annotations in Python) is called as it is."""
    if (type(run).__name__ == "CudaLauncher" and not hasattr(run, "kernel_signature")
            and getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    return run, ()


def with_pdl(prefix: tuple) -> tuple | None:
    """`launcher_entry`'s prefix with the PDL flag set (the launch becomes the programmatic dependent of the grid
    launched before it on its stream), or None where the launcher takes no such flag or already sets it."""
    if len(prefix) != 4 or prefix[1]:
        return None
    return (prefix[0], 1, *prefix[2:])


def tma_encoder(run):
    """(raw launcher, encode, metadata per descriptor) where `run` (`launcher_entry`) is Triton 3.6's
    wrapper that encodes each host TMA descriptor on every launch (`make_tensordesc_arg`: a Python frame and a
    driver call per descriptor, a pass over every argument); None for any other launcher, which then encodes
    them itself. `encode(descriptor, metadata)` returns the arguments that stand for one descriptor."""
    code = getattr(run, "__code__", None)
    if code is None or not run.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in run.__closure__)))
    launcher, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    make = getattr(run, "__globals__", {}).get("make_tensordesc_arg")
    if launcher is None or metas is None or make is None or set(cells) != {"launcher", "tensordesc_meta",
                                                                             "tensordesc_indices"}:
        return None
    return launcher, make, list(metas)


class HostDescriptor:
    """What a launcher reads of a host `TensorDescriptor` (base, shape, strides, padding) over memory given by
    its address: the base is only asked for its address, so the descriptor stands for it (`kda.replay` passes
    one per replayed descriptor, `tma_encoder`'s `encode` takes one)."""

    __slots__ = ("p", "shape", "strides", "padding")

    def __init__(self, p: int, shape, strides, padding):
        self.p = p
        self.shape = shape
        self.strides = strides
        self.padding = padding

    @property
    def base(self):
        return self

    def data_ptr(self) -> int:
        return self.p


def launch_hooked() -> bool:
    """Whether a launch hook is registered (a profiler's): launches then go through Triton's own path."""
    return bool(knobs.runtime.launch_enter_hook.calls)


def wait_stream(waiter, waited) -> None:
    """`waiter.wait_stream(waited)` (torch streams), noted in `RECORD.launches` as ("wait", waiter, waited)
    while launches are recorded, so that a replay orders its streams as the call did."""
    waiter.wait_stream(waited)
    record = getattr(RECORD, "launches", None)
    if record is not None:
        record.append(("wait", waiter, waited))


def dependent() -> None:
    """The next launch may run as the programmatic dependent of the launch before it on its stream (the next
    kernel's last program waits for that grid), noted in `RECORD.launches` as ("dependent",) while launches are
    recorded: a replay sets that launch's PDL flag where the device has it (`kda.replay`). Unrecorded, nothing."""
    record = getattr(RECORD, "launches", None)
    if record is not None:
        record.append(("dependent",))


def direct(fn=None, *, drops_overflow: bool = False):
    """Decorator, above `@triton.jit` (`@direct`, or `@direct(drops_overflow=True)`): launches through
    `DirectKernel`."""
    if fn is None:
        return lambda f: DirectKernel(f, drops_overflow=drops_overflow)
    return DirectKernel(fn)


__all__ = ["FAST_PATH", "NUMERICS", "RECORD", "TESTED_TRITON", "DirectKernel", "HostDescriptor", "dependent", "direct",
           "fast_path_tested", "int_class", "launch_hooked", "launcher_entry", "raw_stream", "specialization",
           "tma_encoder", "wait_stream", "with_pdl"]
