"""Repeated calls without the Python around their launches.

A serving step calls `fused_recurrent_kda` or `chunk_kda` once per KDA layer with the same shapes, strides,
dtypes, devices, flags and host bounds, only the tensors' memory changing. Everything
`kda.contract.check_call`, the plan and the launchers derive from a call is a function of that metadata (no
check reads a tensor's values without KDA_DEBUG), so the first call of a kind runs the full path while its
launches are recorded (`kda.ops.launch.RECORD`, per thread), and a later call with the same key (`decode_key`,
`chunk_key`) only reads its tensors' addresses, allocates its outputs and workspaces (one buffer for all
workspaces) and launches the recorded kernels (`Replay`): the contract's checks, the plan and the argument
assembly ran once for every call that shares the key. What depends on the addresses is redone per call:
the 16-byte alignment each compiled kernel was specialised on (another alignment takes the full path, which
compiles for it) and the byte overlap of `out` with an input or the state (an overlap takes the full path,
which raises). A host TMA descriptor (over a workspace, or over the input v) is encoded again only when its
address moved. The key holds the length of `cu_seqlens_cpu`; its values are compared with the recorded ones
(other values: the full path, whose recording replaces the kind's).

Not recorded (every such call takes the full path): KDA_DEBUG on, the interpreter, a Triton version the launch
fast path was not tested with (`kda.ops.launch.FAST_PATH`), a launch hook registered (a profiler's), an argument
whose type the key does not cover, one tensor passed in two roles, a view of a buffer that several roles share,
and a launch Triton's own path made (`remember` raises `Unrecordable`). Workspaces and their views come from one
buffer per call, a region per buffer the call allocated. The walk beside the prepare is recorded with its
streams: each launch on the caller's stream or the side stream, and the waits between them in order. At most
`CAPACITY` kinds are kept, the oldest dropped first.
"""

from __future__ import annotations

import os
import threading

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import arguments
from .contract import DEBUG_OFF, byte_span, debug_enabled
from .ops import launch
from .ops.launch import FAST_PATH, DirectKernel, HostDescriptor, int_class, launch_hooked, raw_stream
from .plan import device_info

CAPACITY = 256
_SCALARS = (type(None), bool, int, float, torch.dtype)
# set by a CUDA tool in the environment of the program it runs (`_serialising`)
TOOL_VARIABLES = ("CUDA_INJECTION64_PATH", "NV_SANITIZER_INJECTION_PORT_BASE", "NV_NSIGHT_INJECTION_PORT_BASE")
_ALIGN = 256  # workspace offsets in the one buffer: every workspace as aligned as its own allocation's TMA needs

# a call's tensors in the order `Replay` reads them: the caller's (both functions' in one list,
# `kda.arguments.TENSORS`), then o and the final state (allocated by the call unless `out` is o)
ROLES = (*arguments.TENSORS, "o", "final")
_OUT = ROLES.index("o")
# out may not overlap these (`kda.contract.check_call`): q, k, v, g, beta and the state read
_NO_OVERLAP = tuple(ROLES.index(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "state_cache"))

CACHE: dict = {}


class _Uncached(Exception):
    """A call the key does not describe: it takes the full path and is not recorded."""


class Unrecordable(Exception):
    """`remember` found a call whose launches it cannot replay: the kind takes the full path every time."""


def _meta(x):
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise _Uncached
    return (x.shape, x.stride(), x.dtype, x.device)


def _scalar(x):
    if type(x) not in _SCALARS:
        raise _Uncached
    return (type(x), x)


def _bounds(x):
    """What of `cu_seqlens_cpu` the key holds: its length (and dtype); the values are compared by the
    recording itself (`_same_bounds`), which hashes nothing (building and hashing a tuple of the bounds costs
    more than comparing them)."""
    if x is None:
        return None
    t = type(x)
    if t is list or t is tuple:
        return len(x)
    if isinstance(x, torch.Tensor) and x.is_cpu:
        return (x.dtype, x.shape)
    raise _Uncached


def _bounds_value(x):
    """The host bounds as a recording keeps them: a list of the values, or a tensor's bytes."""
    if x is None:
        return None
    if type(x) is list or type(x) is tuple:
        return list(x)
    try:  # the values' bytes: half the host time of a list of them
        return x.numpy().tobytes()
    except (RuntimeError, TypeError):  # torch without numpy
        return x.tolist()


def _same_bounds(x, kept) -> bool:
    """Whether host bounds `x` (of the kind's type and length) hold the values `kept` (`_bounds_value`)."""
    if type(x) is list:
        return x == kept  # without the copy
    return _bounds_value(x) == kept


def _recordable(q) -> bool:
    """Whether a call may replay or be recorded at all: the launch fast path on (`kda.ops.launch.FAST_PATH`),
    a GPU call, KDA_DEBUG off (its checks read device values; a bad KDA_DEBUG value raises here as it would in
    the checks), no launch hook registered."""
    return (FAST_PATH and isinstance(q, torch.Tensor) and q.is_cuda and not debug_enabled()
            and not launch_hooked())


_KEY_PART = {arguments.METADATA: "_meta", arguments.VALUE: "_scalar", arguments.LENGTH: "_bounds"}


def _key_function(fn: str, name: str, doc: str):
    """`name`, the key of a `fn` call: one part per argument of `kda.arguments.key_names(fn)`, by its
    `key_part`; None where the call is not recorded."""
    keyed = [arguments.BY_NAME[n] for n in arguments.key_names(fn)]
    parts = "".join(f", {_KEY_PART[a.key_part]}({a.name})" for a in keyed)
    source = (f"def {name}({', '.join(a.name for a in keyed)}):\n"
              "    if not _recordable(q):\n"
              "        return None\n"
              "    try:\n"
              f"        return ({fn!r}, torch.cuda.current_device(){parts})\n"
              "    except (_Uncached, AttributeError):\n"
              "        return None\n")
    made = arguments.define(name, source, globals())
    made.__doc__ = doc
    return made


decode_key = _key_function("fused_recurrent_kda", "decode_key", """Everything a `fused_recurrent_kda` call's checks,
    plan and launch depend on but its tensors' memory and `seed`; None where the call is not recorded.""")
chunk_key = _key_function("chunk_kda", "chunk_key", "The same for a `chunk_kda` call.")


def _extent(x: torch.Tensor) -> int:
    """Bytes x spans (`kda.contract.byte_span`; 0 when empty)."""
    start, end = byte_span(x)
    return end - start


class Replay:
    """A kind's recorded launches: `__call__(tensors, seed)` with a call's tensors (in `ROLES` order up to
    errors, then `out`) launches them and returns what the full path returns, or None where the call must
    take the full path (another address modulo 16, `out` overlapping an input, a seed outside i32)."""

    __slots__ = ("launches", "order", "uses", "residues", "workspaces", "new_o", "new_final", "checks_out",
                 "extents", "device", "maps", "bounds", "events")

    def __init__(self, launches, order, uses, residues, workspaces, new_o, new_final, checks_out, extents, device,
                 bounds=None):
        # per launch: (launcher, its prefix (`launch.launcher_entry`), gx, gy, gz, function, packed, template,
        #              seed position or None, ((position, workspace offset), ...),
        #              ((position, offset, shape, strides, padding, encode or None, its metadata, map), ...)):
        #              a TMA descriptor is passed encoded (`launch.tma_encoder`) where the launcher would encode it
        #              on every launch, its encoding kept in `maps[map]` with the address it was made for
        self.launches = launches
        # in the call's order: (0, launch, side stream or None for the caller's) or (1, (waiter, waited), the
        # wait's index among the waits), a stream None standing for the caller's current stream
        self.order = order
        self.uses = uses  # ((role, ((launch, position, byte offset into the role's tensor), ...)), ...)
        # per use: the address modulo 16 (the kernels were specialised on the alignment of each address and
        # of the views at fixed offsets from it)
        self.residues = residues
        self.workspaces = workspaces  # bytes of the one workspace buffer (0: none)
        self.new_o = new_o  # (shape, dtype) of o to allocate, or None: o is `out`
        self.new_final = new_final  # (shape, dtype) of the final state to allocate (and return), or None
        self.checks_out = checks_out
        self.extents = extents  # per role: bytes spanned (for out's overlap check)
        self.device = device
        self.maps = [(None, None)] * sum(len(launch[-1]) for launch in launches)
        self.bounds = bounds  # the host bounds the call was recorded with (`_bounds_value`), or None
        # per thread, one event per wait in `order`, recorded again by every call (a wait takes the event's
        # state when it is queued): a new event per wait costs its creation and destruction on the host
        self.events = {}

    def __call__(self, tensors: tuple, seed, bounds=None):
        if seed is not None and (type(seed) is not int or int_class(seed)):  # not i32: another binary
            return None
        if self.bounds is not None and not _same_bounds(bounds, self.bounds):  # other routing and grids
            return None
        dev = tensors[0].device
        o = tensors[_OUT] if self.new_o is None else torch.empty(self.new_o[0], dtype=self.new_o[1], device=dev)
        final = None
        if self.new_final is not None:
            final = torch.empty(self.new_final[0], dtype=self.new_final[1], device=dev)
        tensors = tensors[:_OUT] + (o, final)
        if self.checks_out:
            ext = self.extents
            o0 = o.data_ptr()
            o1 = o0 + ext[_OUT]
            for r in _NO_OVERLAP:
                x = tensors[r]
                if x is not None:
                    x0 = x.data_ptr()
                    if x0 < o1 and o0 < x0 + ext[r]:
                        return None
        filled = [list(launch[7]) for launch in self.launches]
        for (role, places), residue in zip(self.uses, self.residues):
            p = tensors[role].data_ptr()
            if p & 15 != residue:
                return None
            for i, pos, delta in places:
                filled[i][pos] = p + delta
        base = 0
        if self.workspaces:
            ws = torch.empty(self.workspaces, dtype=torch.uint8, device=dev)
            base = ws.data_ptr()
        stream = raw_stream(self.device)
        maps = self.maps
        current = events = None
        for kind, a, b in self.order:
            if kind:  # a wait (waiter, waited) between the caller's stream (None) and a side stream, its event b
                if current is None:
                    current = torch.cuda.current_stream(self.device)
                    events = self._events()
                waiter, waited = a
                ev = events[b]
                ev.record(current if waited is None else waited)
                (current if waiter is None else waiter).wait_event(ev)
                continue
            run, prefix, gx, gy, gz, function, packed, _, seed_at, ws_at, desc_at = self.launches[a]
            vals = filled[a]
            for pos, off in ws_at:
                vals[pos] = base + off
            for pos, off, shape, strides, padding, make, meta, j in desc_at:
                if off.__class__ is int:
                    p = base + off
                else:  # (role,): a caller's tensor, its alignment checked with the others'
                    p = tensors[off[0]].data_ptr()
                if make is None:  # the launcher encodes it
                    vals[pos] = HostDescriptor(p, shape, strides, padding)
                    continue
                last = maps[j]  # the workspace mostly returns to the address of the call before
                if last[0] != p:
                    last = (p, make(HostDescriptor(p, shape, strides, padding), meta))
                    maps[j] = last
                vals[pos:pos + len(last[1])] = last[1]
            if seed_at is not None and seed is not None:
                vals[seed_at] = seed
            run(gx, gy, gz, stream if b is None else b.cuda_stream, function, *prefix, packed, None, None, None, *vals)
        return o, final

    def _events(self) -> list:
        """This thread's events for the waits (made at its first call of this kind)."""
        mine = self.events.get(threading.get_ident())
        if mine is None:
            waits = sum(1 for op in self.order if op[0])
            mine = self.events[threading.get_ident()] = [torch.cuda.Event() for _ in range(waits)]
        return mine


def replayed(key, tensors: tuple, seed, bounds=None):
    """The recorded kind's result for this call (`bounds`: its `cu_seqlens_cpu`), or None: the full path runs
    (and records the kind under `key`)."""
    entry = CACHE.get(key)
    return None if entry is None else entry(tensors, seed, bounds)


def remember(key, tensors: tuple, record: list, result: tuple, bounds=None) -> None:
    """Record the launches a full call made (`record`: `kda.ops.launch.RECORD`'s entries) under `key`.
    `tensors`: the call's tensors in `ROLES` order up to the caller's last, then `out`; `result`: its (o, final
    state). Raises `Unrecordable` for a call whose launches a replay could not repeat."""
    if CAPACITY <= 0 or not record:
        return
    o, final = result
    out_given = tensors[_OUT] is not None
    roles = tensors[:_OUT] + (o, final)
    role_of, storage_of = {}, {}
    for r, x in enumerate(roles):
        if x is not None:
            if id(x) in role_of:  # one object in two roles: an argument would be read back into one of them
                raise Unrecordable("one tensor in two roles")
            role_of[id(x)] = r
            # roles may share a buffer (q, k, v split from one projection); a view derived from a buffer is
            # placed by its role only where one role holds that buffer
            storage_of.setdefault(x.untyped_storage().data_ptr(), []).append(r)
    device = torch.cuda.current_device()
    main = launch.RECORD.main
    # streams other than the caller's: the torch streams the recorded waits name (the side stream of the walk
    # beside the prepare, one per device for the process), by raw handle
    sides = {x.cuda_stream: x for op in record if op[0] == "wait" for x in op[1:] if x.cuda_stream != main}
    launches, order, places, regions = [], [], {}, {}
    size = n_maps = 0

    def workspace(x: torch.Tensor) -> int:
        """Where x's first element lies in the one buffer: a region per buffer of this call's own."""
        nonlocal size
        storage = x.untyped_storage()
        sp = storage.data_ptr()
        if sp not in regions:
            regions[sp] = size
            size += -(-storage.nbytes() // _ALIGN) * _ALIGN
        return regions[sp] + x.data_ptr() - sp

    n_waits = 0
    dependents = []  # launches a ("dependent",) note precedes (`kda.ops.launch.dependent`)
    for op in record:
        if op[0] == "dependent":
            dependents.append(len(launches))
            continue
        if op[0] == "wait":
            order.append((1, (None if op[1].cuda_stream == main else op[1],
                              None if op[2].cuda_stream == main else op[2]), n_waits))
            n_waits += 1
            continue
        kernel, grid, args, meta, st = op
        if st != main and st not in sides:
            raise Unrecordable("a launch on a stream no recorded wait names")
        hit = kernel.compiled(args, meta) if isinstance(kernel, DirectKernel) else None
        if hit is None:
            raise Unrecordable("a launch Triton's own path made")
        run, prefix, function, packed, tail, vals = hit
        i = len(launches)
        ws_at, desc_at = [], []
        for pos, a in enumerate(args):
            if isinstance(a, TensorDescriptor):
                base = a.base
                if not isinstance(base, torch.Tensor):
                    raise Unrecordable("a TMA descriptor over something else than a tensor")
                r = role_of.get(id(base))
                if r is not None:  # over a caller's tensor (the walk's v): its role's address, alignment checked
                    places.setdefault(r, [])
                    at = (r,)
                elif base.untyped_storage().data_ptr() in storage_of:
                    raise Unrecordable("a TMA descriptor over a view of a caller's buffer")
                else:
                    at = workspace(base)
                desc_at.append((pos, at, tuple(a.shape), tuple(a.strides), a.padding))
            elif isinstance(a, torch.Tensor):
                r = role_of.get(id(a))
                if r is None:  # a view of a role's tensor, at a fixed offset from it for this key
                    holders = storage_of.get(a.untyped_storage().data_ptr(), ())
                    if len(holders) > 1:
                        raise Unrecordable("a view of a buffer that several roles share")
                    r = holders[0] if holders else None
                if r is not None:
                    places.setdefault(r, []).append((i, pos, a.data_ptr() - roles[r].data_ptr()))
                else:
                    ws_at.append((pos, workspace(a)))
        seed_at = kernel.position("seed")
        g = tuple(grid) + (1,) * (3 - len(grid))
        template = list(vals) + list(tail)
        encoder = launch.tma_encoder(run) if desc_at else None
        if encoder is not None and len(encoder[2]) != len(desc_at):
            encoder = None
        if encoder is None:
            for pos, *_ in desc_at:
                template[pos] = None  # the descriptor holds this call's workspace: keep no tensor alive
            desc_at = [(*d, None, None, n_maps + j) for j, d in enumerate(desc_at)]
        else:  # the raw launcher, each descriptor's encoding spliced in at its place
            run, make, metas = encoder
            width = {d[0]: len(make(args[d[0]], m)) for d, m in zip(desc_at, metas)}
            moved, at = {}, 0
            for pos in range(len(template)):
                moved[pos] = at
                at += width.get(pos, 1)
            for pos in sorted(width, reverse=True):
                template[pos:pos + 1] = [None] * width[pos]
            desc_at = [(moved[d[0]], *d[1:], make, m, n_maps + j) for j, (d, m) in enumerate(zip(desc_at, metas))]
            ws_at = [(moved[pos], off) for pos, off in ws_at]
            seed_at = None if seed_at is None else moved[seed_at]
            for r, held in places.items():
                places[r] = [(li, moved[pos] if li == i else pos, delta) for li, pos, delta in held]
        n_maps += len(desc_at)
        launches.append((run, prefix, *g, function, packed, tuple(template), seed_at, tuple(ws_at),
                         tuple(desc_at)))
        order.append((0, i, None if st == main else sides[st]))
    uses = tuple((r, tuple(p)) for r, p in places.items())
    if device_info(device).pdl and not _serialising():  # programmatic dependent launch: Hopper and later
        order = _programmatic(order, launches, dependents)
    entry = Replay(
        launches=tuple(launches), order=tuple(order), uses=uses,
        residues=tuple(roles[r].data_ptr() & 15 for r, _ in uses), workspaces=size,
        new_o=None if out_given else (tuple(o.shape), o.dtype),
        new_final=None if final is None else (tuple(final.shape), final.dtype),
        checks_out=out_given, extents=tuple(_extent(x) if x is not None else 0 for x in roles), device=device,
        bounds=_bounds_value(bounds),
    )
    while key not in CACHE and len(CACHE) >= CAPACITY:  # a kind recorded again (new host bounds) evicts none
        del CACHE[next(iter(CACHE))]
    CACHE[key] = entry


def _serialising() -> bool:
    """Whether kernels may run one at a time here: `CUDA_LAUNCH_BLOCKING` set, or a CUDA tool injected
    (`CUDA_INJECTION64_PATH`, the tools' launcher preloaded, or the injection ports compute-sanitizer and Nsight
    Compute set in the environment of the program they run: both seen on the H200 machine). Run one at a time, a
    walk launched before its prepare (`_programmatic`) would wait out its budget (`kda.ops.overlap`) before the
    prepare could run; the recorded order (the prepare launched first) waits on nothing there."""
    env = os.environ
    blocking = env.get("CUDA_LAUNCH_BLOCKING", "").strip().lower() not in DEBUG_OFF  # the words KDA_DEBUG reads as off
    return blocking or "TreeLauncher" in env.get("LD_PRELOAD", "") or any(env.get(name) for name in TOOL_VARIABLES)


def _programmatic(order: list, launches: list, dependents: list = ()) -> list:
    """The walk beside the prepare on the caller's stream alone. Recorded, that call forks a side stream after
    the gate pass (or the counters' zeroing, or the prepare's first launch), launches the prepare on the caller's
    stream and the walk on the side stream, then joins them: two event waits a call. Replayed, the walk is launched
    on the caller's stream where the fork was, and the prepare after it as its programmatic dependent (CUDA's
    programmatic dependent launch): each walk program first lets it start (`_chunk_state_kernel`), and the
    prepare's program of the last chunk waits for the walk (`kda.ops.overlap.finish`), so the stream's next work
    still follows both. The kernels are loaded by then (the recording launched them), so the
    walk spinning first cannot hold up a module load. Any other shape of order (the split prepare's two launches,
    another launcher than Triton 3.6's) is kept as recorded. `dependents`: launches noted as the programmatic
    dependent of the launch before them on their stream (`kda.ops.launch.dependent`: the routed short sequences'
    loop after the walk), their PDL flag set where they follow a launch on that stream. `launches` is updated in
    place."""
    for i in dependents:
        at = next((j for j, op in enumerate(order) if not op[0] and op[1] == i), None)
        prefix = None if not at else launch.with_pdl(launches[i][1])
        if prefix is not None and not order[at - 1][0] and order[at - 1][2] == order[at][2]:
            launches[i] = (launches[i][0], prefix, *launches[i][2:])
    waits = [i for i, op in enumerate(order) if op[0]]
    sides = [i for i, op in enumerate(order) if not op[0] and op[2] is not None]
    if len(waits) != 2 or len(sides) != 1:
        return order
    fork, join = waits
    (side,) = sides
    if not (fork + 2 == side and side + 1 == join and order[fork][1][1] is None and order[join][1][0] is None):
        return order
    dep = order[fork + 1][1]  # the prepare's (last) launch, between the fork and the walk
    run, prefix, *rest = launches[dep]
    prefix = launch.with_pdl(prefix)
    if prefix is None:
        return order
    launches[dep] = (run, prefix, *rest)
    return order[:fork] + [(0, order[side][1], None), (0, dep, None)] + order[join + 1:]


def recording() -> list:
    """Start recording this thread's launches (`kda.ops.launch.RECORD`), on the current stream; `stop` ends
    it."""
    launch.RECORD.main = raw_stream(torch.cuda.current_device())
    launch.RECORD.launches = []
    return launch.RECORD.launches


def stop() -> None:
    launch.RECORD.launches = None
