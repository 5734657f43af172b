"""The arguments of `chunk_kda`, `fused_recurrent_kda` and `kda.distributed.chunk_kda`, in one table.

A row names an argument, its kind, its default, the functions that take it, whether it is positional (fla's
first eight), its part in the replay key (`kda.replay`) and in the custom ops' schemas (`kda.library`). Every
module that passes the arguments on derives its lists from this table at import:

- `kda.api`: the bodies of the public functions (their signatures are written out there for readers and IDEs,
  and checked against the table at import: `compiled`);
- `kda.replay`: the key functions and the order of a call's tensors (`TENSORS`);
- `kda.library`: the ops' signatures, fake implementations and mutated arguments;
- `kda.distributed`: its signature (checked the same way) and what it forwards to each local call.

`kda.contract.check_call` takes every argument of the two kernel functions by name (a test holds its
parameters to the table). Adding an argument: one row here, its line in the signatures it joins (the import
check names what is missing), and its check in `kda.contract`.

Forwarding 25 arguments must cost what hand-written forwarding costs, so the functions that forward them are
compiled from source built here once, at import (as `dataclasses` builds `__init__`): a call builds no dict
and loops over nothing.
"""

from __future__ import annotations

import inspect
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

CHUNK = "chunk_kda"
DECODE = "fused_recurrent_kda"
DISTRIBUTED = "distributed.chunk_kda"
FUNCTIONS = (CHUNK, DECODE, DISTRIBUTED)
KERNELS = (CHUNK, DECODE)  # the functions whose arguments reach `kda.contract.check_call` as they are

# kinds
TENSOR = "tensor"
BOOL = "bool"
FLOAT = "float"
INT = "int"
DTYPE = "dtype"
HOST_BOUNDS = "host bounds"  # a host sequence of ints (a list, a tuple or a CPU tensor)
GROUP = "process group"

# parts in the replay key (`kda.replay`): a tensor by its metadata, a scalar by its type and value, host bounds
# by their length (the recording compares the values), and an argument passed to each replay instead
METADATA = "metadata"
VALUE = "value"
LENGTH = "length"
PER_CALL = "per call"

# places in the custom ops' schemas (`kda.library`): in the table's order without a default; "last": after
# those, with its default; "required": a tensor the op mutates and the public wrapper allocates when not given
OP_ARG = "arg"
OP_LAST = "last"
OP_REQUIRED = "required"

REQUIRED = inspect.Parameter.empty

_ANNOTATION = {TENSOR: "torch.Tensor", BOOL: "bool", FLOAT: "float", INT: "int", DTYPE: "torch.dtype"}
_KEY = {TENSOR: METADATA, BOOL: VALUE, FLOAT: VALUE, INT: VALUE, DTYPE: VALUE, HOST_BOUNDS: LENGTH}


@dataclass(frozen=True)
class Arg:
    """One argument. `key` and `op` default from the kind; `mutated`: written in place (the ops declare it);
    `launcher`: passed to the kernel launcher beside the checked call (`KDACall` does not hold it)."""

    name: str
    kind: str
    default: object = REQUIRED
    takes: tuple = FUNCTIONS
    positional: bool = False
    key: str | None = None
    op: str = OP_ARG
    mutated: bool = False
    launcher: bool = False

    def annotation(self, op: bool = False) -> str | None:
        """The annotation a signature writes (None: unannotated), in a public signature or the op's."""
        if self.kind == HOST_BOUNDS:
            return "torch.Tensor | None" if op else None  # the op takes a CPU tensor (`kda.library`)
        base = _ANNOTATION.get(self.kind)
        if base is None or (op and self.op == OP_REQUIRED):
            return base
        return f"{base} | None" if self.default is None else base

    @property
    def key_part(self) -> str | None:
        return self.key or _KEY.get(self.kind)


ARGUMENTS = (
    Arg("q", TENSOR, positional=True),
    Arg("k", TENSOR, positional=True),
    Arg("v", TENSOR, positional=True),
    Arg("g", TENSOR, positional=True),
    Arg("beta", TENSOR, positional=True),
    Arg("scale", FLOAT, None, positional=True),
    Arg("initial_state", TENSOR, None, positional=True),
    Arg("output_final_state", BOOL, False, positional=True),
    Arg("group", GROUP, None, takes=(DISTRIBUTED,)),
    Arg("rank_bounds", HOST_BOUNDS, None, takes=(DISTRIBUTED,)),
    Arg("use_qk_l2norm_in_kernel", BOOL, False),
    Arg("use_beta_sigmoid_in_kernel", BOOL, False),
    Arg("use_gate_in_kernel", BOOL, False),
    Arg("A_log", TENSOR, None),
    Arg("dt_bias", TENSOR, None),
    Arg("lower_bound", FLOAT, None),
    Arg("cu_seqlens", TENSOR, None),
    Arg("cu_seqlens_cpu", HOST_BOUNDS, None),
    Arg("state_v_first", BOOL, None),
    Arg("state_cache", TENSOR, None, mutated=True),
    Arg("state_indices", TENSOR, None),
    Arg("has_initial_state", TENSOR, None),
    Arg("num_accepted_tokens", TENSOR, None, takes=(DECODE,), op=OP_LAST),
    Arg("state_dtype", DTYPE, None),
    Arg("out", TENSOR, None, op=OP_REQUIRED, mutated=True),
    # mutated, so no default in the ops: PyTorch's in-place bookkeeping drops a trailing argument left at its default
    Arg("errors", TENSOR, None, takes=KERNELS, mutated=True),
    Arg("checkpoint_every", INT, None, takes=(CHUNK,), op=OP_LAST),
    Arg("checkpoint_indices", TENSOR, None, takes=(CHUNK,), op=OP_LAST),
    Arg("stochastic_rounding", BOOL, False, takes=(DECODE,), launcher=True),
    Arg("seed", INT, 0, takes=(DECODE,), key=PER_CALL, launcher=True),
)

BY_NAME = {a.name: a for a in ARGUMENTS}
# a call's tensors in the order `kda.replay` reads them (both kernel functions' in one list; `out` apart)
TENSORS = tuple(a.name for a in ARGUMENTS if a.kind == TENSOR and a.name != "out" and set(a.takes) & set(KERNELS))


def of(fn: str) -> tuple[Arg, ...]:
    """The arguments `fn` takes, in its signature's order."""
    return tuple(a for a in ARGUMENTS if fn in a.takes)


def names(fn: str) -> tuple[str, ...]:
    return tuple(a.name for a in of(fn))


def signature(fn: str) -> inspect.Signature:
    """`fn`'s public signature as the table states it (annotations as strings, as written under
    `from __future__ import annotations`)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return inspect.Signature([
        inspect.Parameter(a.name, kinds[not a.positional], default=a.default,
                          annotation=a.annotation() or inspect.Parameter.empty) for a in of(fn)])


def parameters_source(fn: str) -> str:
    """`fn`'s parameter list as source, without annotations."""
    parts, star = [], False
    for a in of(fn):
        if not a.positional and not star:
            parts.append("*")
            star = True
        parts.append(a.name if a.default is REQUIRED else f"{a.name}={a.default!r}")
    return ", ".join(parts)


def call_source(fn: str, only=None) -> str:
    """The arguments of `fn` passed on as it takes them (the positional ones by position, the rest by name),
    `only` (a collection of names) restricting them."""
    return ", ".join(a.name if a.positional else f"{a.name}={a.name}" for a in of(fn)
                     if only is None or a.name in only)


def key_names(fn: str) -> tuple[str, ...]:
    """The arguments a replay key of `fn` is built from, in order (all but the per-call ones)."""
    return tuple(a.name for a in of(fn) if a.key_part != PER_CALL)


def per_call(fn: str) -> tuple[str, ...]:
    """The arguments of `fn` not in its replay key, passed to each replay."""
    return tuple(a.name for a in of(fn) if a.key_part == PER_CALL)


def launcher_names(fn: str) -> tuple[str, ...]:
    """The arguments passed to `fn`'s kernel launcher beside its `KDACall`."""
    return tuple(a.name for a in of(fn) if a.launcher)


def tensors_source(fn: str) -> str:
    """`fn`'s tensors in `TENSORS` order (None for a role it does not take), then `out`, as a tuple's source."""
    taken = set(names(fn))
    return "(" + ", ".join(n if n in taken else "None" for n in (*TENSORS, "out")) + ")"


def op_arguments(fn: str) -> tuple[Arg, ...]:
    """The custom op's parameters, in its schema's order."""
    taken = [a for a in of(fn) if a.kind != GROUP]
    return tuple(a for a in taken if a.op != OP_LAST) + tuple(a for a in taken if a.op == OP_LAST)


def op_parameters_source(fn: str) -> str:
    """The custom op's parameter list as source, annotated (the schema is inferred from it)."""
    return ", ".join(f"{a.name}: {a.annotation(op=True)}" + (f" = {a.default!r}" if a.op == OP_LAST else "")
                     for a in op_arguments(fn))


def mutated(fn: str) -> tuple[str, ...]:
    return tuple(a.name for a in op_arguments(fn) if a.mutated)


def define(name: str, source: str, namespace: dict):
    """The function `name` defined by `source`, its globals `namespace` (a module's, so that its names
    resolve as in that module's own code); the source is kept for tracebacks."""
    filename = f"<kda.arguments: {namespace.get('__name__')}.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope: dict = {}
    exec(compile(source, filename, "exec"), namespace, scope)
    return scope[name]


def check_signature(f: Callable, fn: str) -> None:
    """Raise TypeError where `f`'s signature differs from the table's for `fn`."""
    written, stated = inspect.signature(f).replace(return_annotation=inspect.Signature.empty), signature(fn)
    if written != stated:
        raise TypeError(f"the signature of {f.__module__}.{f.__qualname__} differs from kda.arguments' table for "
                        f"{fn}:\n  written {written}\n  table   {stated}")


F = TypeVar("F", bound=Callable)


def compiled(fn: str, body: str, namespace: dict) -> Callable[[F], F]:
    """Decorator: the function below, whose signature (checked against the table for `fn`) and docstring are
    written out by hand, with `body` (source, indented by four spaces) compiled as its body in `namespace`."""

    def build(f: F) -> F:
        check_signature(f, fn)
        source = f"def {f.__name__}({parameters_source(fn)}):\n{body}"
        made = define(f.__name__, source, namespace)
        made.__doc__, made.__qualname__, made.__module__ = f.__doc__, f.__qualname__, f.__module__
        made.__annotations__ = dict(f.__annotations__)
        return made

    return build
