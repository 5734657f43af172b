"""`kda.accuracy.capture(directory, ...)`: record a real model's KDA calls for the replay report.

While the context is open, every module global bound to `kda.chunk_kda`, `kda.fused_recurrent_kda` (in
`kda`, `kda.api`, and any module that did `from kda import chunk_kda`) and, where fla is importable, to
`fla.ops.kda.chunk_kda` / `fla.ops.kda.fused_recurrent_kda`, is replaced by a wrapper that copies the
call's inputs to the CPU, calls the original with the very same arguments and returns its result
unchanged. On exit (also on an exception) the originals are put back and `index.json` is written. A
reference held some other way (a bound method, a dict, a closure) is not seen, nor are other copies of
fla's kernels (a serving engine's vendored `fla` ops).

Layers. A call's layer is the name of the innermost open `cap.layer(name)` context when there is one;
else `layer<i>`, i the call's position within the current forward. A forward ends at `cap.step()`, or
after `layers_per_forward` calls when that is given. Without either, every call is its own layer.

Sequences. Each sequence of a call (a batch row, a varlen segment) is a piece of one sequence of its
layer. A piece that starts from zeros (no state, `has_initial_state[n]` false) starts a new sequence.
A piece that reads a state continues the sequence whose last recorded final state has the same bits:
in a paged call the one that last wrote slot `state_indices[n]` of that layer; in a dense call any
sequence of that layer whose returned `final_state[n]` equals `initial_state[n]` bit for bit. A state
that matches nothing (captured mid-sequence, or changed by the caller in between, e.g. cast to another
dtype) starts a new sequence whose initial state is saved with the call. Padding (`state_indices[n] < 0`)
is skipped. Speculative verify (2-D `state_indices`) and options outside kda's contract are recorded
but marked unsupported: the replay leaves them out and says so.

Budget. Before a call is written its tokens (the rows of its non-padding sequences) and bytes (the tensors
saved) are added to what was recorded; past `max_tokens` or `max_bytes` the capture stops recording (the
model runs on), warns once, and `index.json` says where and why (`stopped`). A call whose arguments the
capture cannot follow but the kernel accepts stops the recording the same way (the index would otherwise
miss a piece of a sequence).

Cost: every call copies its inputs and the state planes it reads and writes to the host (a sync). A
capture is for a diagnostic run, not for serving traffic, and runs eagerly (not under torch.compile).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import sys
import threading
import warnings

import torch

FUNCTIONS = ("chunk_kda", "fused_recurrent_kda")
INDEX = "index.json"
FORMAT = 1
TENSORS = ("q", "k", "v", "g", "beta")
# scalar options of kda's contract that the replay reproduces (fla's spelling `transpose_state_layout` maps
# to state_v_first); any other option with a value other than None/False makes the call unsupported
OPTIONS = ("scale", "output_final_state", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
           "use_gate_in_kernel", "lower_bound", "state_v_first", "stochastic_rounding")
IGNORED = {"cu_seqlens_cpu", "state_cache", "state_indices", "has_initial_state", "initial_state", "out", "errors",
           "A_log", "dt_bias", "cu_seqlens", "state_dtype", "seed", "checkpoint_every", "checkpoint_indices",
           "transpose_state_layout", "cp_context", "disable_recompute", "return_intermediate_states",
           "safe_gate", *TENSORS}  # fla's safe_gate: a kernel path for lower-bounded gates, the same math


def _originals() -> dict:
    """{id(function): (name, source, function)} for kda's public functions and fla's where importable."""
    from .. import api

    found = {id(getattr(api, n)): (n, "kda", getattr(api, n)) for n in FUNCTIONS}
    try:
        import fla.ops.kda as fla_kda
    except Exception:  # fla absent or broken: kda's functions only
        return found
    for n in FUNCTIONS:
        fn = getattr(fla_kda, n, None)
        if fn is not None:
            found[id(fn)] = (n, "fla", fn)
    return found


def _state_hash(plane: torch.Tensor) -> str:
    """A digest of a state plane's dtype and bits (K-first, contiguous)."""
    raw = plane.contiguous().view(torch.uint8) if plane.element_size() == 1 else plane.contiguous()
    ints = raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[raw.element_size()])
    return hashlib.sha1(str(plane.dtype).encode() + ints.numpy().tobytes()).hexdigest()


def _k_first(plane: torch.Tensor, v_first: bool) -> torch.Tensor:
    """A state plane `[HV, K, V]` on the CPU, from either layout."""
    plane = plane.detach()
    return (plane.transpose(-1, -2) if v_first else plane).cpu().contiguous().clone()


class Capture:
    """The context manager of the module docstring. `calls_seen`, `calls_recorded`, `tokens`, `bytes` and
    `stopped` (None, or a dict with the reason and the call where it stopped) tell how it went."""

    def __init__(self, directory, *, max_tokens: int = 1 << 20, max_bytes: int = 1 << 30,
                 layers_per_forward: int | None = None, include_fla: bool = True):
        if max_tokens <= 0 or max_bytes <= 0:
            raise ValueError(f"max_tokens and max_bytes must be positive, got {max_tokens}, {max_bytes}")
        if layers_per_forward is not None and layers_per_forward <= 0:
            raise ValueError(f"layers_per_forward must be positive or None, got {layers_per_forward}")
        self.directory, self.max_tokens, self.max_bytes = str(directory), max_tokens, max_bytes
        self.layers_per_forward, self.include_fla = layers_per_forward, include_fla
        self.calls_seen = self.calls_recorded = self.tokens = self.bytes = 0
        self.stopped = None
        self.forward = self._position = 0
        self._names: list[str] = []
        self._records: list[dict] = []
        self._patched: list[tuple[dict, str, object]] = []
        self._paged: dict[tuple[str, int], tuple[int, str]] = {}  # (layer, slot) -> (sequence, final hash)
        self._dense: dict[tuple[str, str], int] = {}  # (layer, final hash) -> sequence
        self._sequences: list[dict] = []
        self._busy = threading.local()

    # --- the user's markers -------------------------------------------------------------------------

    def step(self) -> None:
        """End the current forward: the next call is layer 0 of the next forward."""
        self.forward += 1
        self._position = 0

    @contextlib.contextmanager
    def layer(self, name: str):
        """Calls inside are named `name` (nested: the innermost name)."""
        self._names.append(str(name))
        try:
            yield self
        finally:
            self._names.pop()

    def _layer_name(self) -> str:
        """The current call's layer (module docstring), advancing the position within the forward."""
        position = self._position
        self._position += 1
        if self.layers_per_forward and self._position == self.layers_per_forward:
            self.step()
        return self._names[-1] if self._names else f"layer{position}"

    # --- patching -----------------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        os.makedirs(os.path.join(self.directory, "calls"), exist_ok=True)
        import kda

        for n in FUNCTIONS:
            getattr(kda, n)  # resolve kda's lazy attributes, so that they are patched too
        originals = _originals()
        if not self.include_fla:
            originals = {i: o for i, o in originals.items() if o[1] != "fla"}
        wrappers = {i: self._wrap(*o) for i, o in originals.items()}
        for module in list(sys.modules.values()):
            try:
                names = vars(module)
            except TypeError:
                continue
            for name, value in list(names.items()):
                if id(value) in wrappers and value is originals[id(value)][2]:
                    names[name] = wrappers[id(value)]
                    self._patched.append((names, name, value))
        return self

    def __exit__(self, *exc) -> None:
        for names, name, value in reversed(self._patched):
            names[name] = value
        self._patched.clear()
        self.write_index()

    def _wrap(self, fn_name: str, source: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if getattr(self._busy, "on", False):  # a wrapped function calling another: the outer one records
                return original(*args, **kwargs)
            self._busy.on = True
            try:
                return self._record(fn_name, source, original, signature, args, kwargs)
            finally:
                self._busy.on = False

        return wrapper

    # --- one call -----------------------------------------------------------------------------------

    def _record(self, fn_name, source, original, signature, args, kwargs):
        """Run `original(*args, **kwargs)` and record the call (module docstring); returns its result."""
        self.calls_seen += 1
        forward, layer = self.forward, self._layer_name()
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # the original raises its own error
        bound.apply_defaults()
        a = dict(bound.arguments)
        for p in signature.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                a.update(a.pop(p.name, {}))
        if self.stopped is not None:
            return original(*args, **kwargs)
        try:
            plan = self._plan(layer, a)
        except Exception as exc:  # arguments the original will reject, or a form this capture cannot follow
            result = original(*args, **kwargs)  # raises the contract's own error, if any
            self._stop_on(f"call {self.calls_seen} could not be recorded ({type(exc).__name__}: {exc})")
            return result
        if plan is None:  # not the tensors of a KDA call: let the original judge
            return original(*args, **kwargs)
        sources = {n: a[n] for n in (*TENSORS, "A_log", "dt_bias", "cu_seqlens") if isinstance(a.get(n), torch.Tensor)}
        initial, tokens = plan.pop("initial"), plan.pop("tokens")
        nbytes = sum(t.numel() * t.element_size() for t in (*sources.values(), *initial.values()))
        if self.tokens + tokens > self.max_tokens or self.bytes + nbytes > self.max_bytes:
            self._stop_on(f"budget: recording call {self.calls_seen} would reach {self.tokens + tokens} tokens "
                          f"(max_tokens {self.max_tokens}) and {self.bytes + nbytes} bytes "
                          f"(max_bytes {self.max_bytes})")
            return original(*args, **kwargs)
        tensors = {n: x.detach().cpu().clone() for n, x in sources.items()} | initial  # before the call writes
        result = original(*args, **kwargs)
        self._after(a, plan, result)
        file = f"calls/{len(self._records):05d}.pt"
        torch.save(tensors, os.path.join(self.directory, file))
        self._records.append(dict(file=file, function=fn_name, source=source, layer=layer, forward=forward,
                                  tokens=tokens, bytes=nbytes, **plan))
        self.calls_recorded += 1
        self.tokens += tokens
        self.bytes += nbytes
        return result

    def _stop_on(self, reason: str) -> None:
        """Stop recording (the model runs on): warn once and write the index with the reason."""
        self.stopped = dict(reason=reason, at_call=self.calls_seen, calls_recorded=self.calls_recorded)
        warnings.warn(f"kda.accuracy.capture: stopped recording ({reason}); the model runs on unrecorded; "
                      f"{self.calls_recorded} calls are in {self.directory}", stacklevel=5)
        self.write_index()

    def _plan(self, layer: str, a: dict) -> dict | None:
        """Options, sequences (rows, slot, the sequence each piece belongs to) and the initial states to save,
        read before the call (the pool is written in place)."""
        if not all(isinstance(a.get(n), torch.Tensor) for n in TENSORS):
            return None
        q = a["q"]
        v_first = bool(a.get("state_v_first") or a.get("transpose_state_layout"))
        options = {n: a.get(n) for n in OPTIONS if n in a}
        options["state_v_first"] = v_first
        if isinstance(options.get("scale"), torch.Tensor):
            options["scale"] = float(options["scale"])
        extra = {n: _jsonable(x) for n, x in a.items() if n not in IGNORED and n not in OPTIONS}
        unsupported = [f"{n}={x}" for n, x in extra.items() if x not in (None, False)]
        cu = a.get("cu_seqlens")
        if isinstance(cu, torch.Tensor):
            bounds = cu.detach().cpu().tolist()
            rows = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
        else:
            rows = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
        pool, slots = a.get("state_cache"), a.get("state_indices")
        dense = a.get("initial_state")
        pieces, initial, state_dtype = [], {}, None
        if pool is not None:
            state_dtype = str(pool.dtype).replace("torch.", "")
            slots = slots.detach().cpu()
            if slots.dim() == 2:
                unsupported.append("speculative verify (2-D state_indices)")
                slots = slots[:, 0]
            has = a.get("has_initial_state")
            has = [True] * len(rows) if has is None else has.detach().cpu().tolist()
        elif dense is not None:
            state_dtype = str(dense.dtype).replace("torch.", "")
        for n, (b, bos, eos) in enumerate(rows):
            slot = int(slots[n]) if pool is not None else None
            if slot is not None and slot < 0:
                continue  # padding
            state = None
            if pool is not None and has[n]:
                state = _k_first(pool[slot], v_first)
            elif pool is None and dense is not None:
                state = _k_first(dense[n], v_first)
            seq = None if state is None else self._continued(layer, slot, _state_hash(state))
            if seq is None:
                seq = len(self._sequences)
                self._sequences.append(dict(layer=layer, slot=slot))
                if state is not None:
                    initial[f"initial_state/{seq}"] = state
            pieces.append(dict(seq=seq, row=n, batch=b, start=bos, end=eos, slot=slot,
                               initial_state=f"initial_state/{seq}" if f"initial_state/{seq}" in initial else None))
        return dict(options=options, extra=extra, unsupported=unsupported, state_dtype=state_dtype,
                    state="paged" if pool is not None else ("dense" if dense is not None else "none"),
                    pieces=pieces, tokens=sum(p["end"] - p["start"] for p in pieces), initial=initial)

    def _continued(self, layer: str, slot: int | None, digest: str) -> int | None:
        """The sequence a piece reading a state with this digest continues, or None (module docstring)."""
        if slot is not None:
            seq, last = self._paged.get((layer, slot), (None, None))
            return seq if last == digest else None
        return self._dense.pop((layer, digest), None)

    def _after(self, a: dict, plan: dict, result) -> None:
        """Remember each piece's final state digest, so that a later call can continue its sequence."""
        v_first = plan["options"]["state_v_first"]
        for p in plan["pieces"]:
            layer = self._sequences[p["seq"]]["layer"]
            if p["slot"] is not None:
                self._paged[(layer, p["slot"])] = (p["seq"], _state_hash(_k_first(a["state_cache"][p["slot"]],
                                                                                 v_first)))
            elif plan["options"].get("output_final_state") and isinstance(result, tuple) and result[1] is not None:
                self._dense[(layer, _state_hash(_k_first(result[1][p["row"]], v_first)))] = p["seq"]

    def write_index(self) -> None:
        """index.json: what was recorded, how the calls map to layers and sequences, and whether it stopped."""
        index = dict(format=FORMAT, calls=self._records, sequences=self._sequences, stopped=self.stopped,
                     max_tokens=self.max_tokens, max_bytes=self.max_bytes, tokens=self.tokens, bytes=self.bytes,
                     calls_seen=self.calls_seen, calls_recorded=self.calls_recorded)
        path = os.path.join(self.directory, INDEX)
        with open(path + ".tmp", "w") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)


def _jsonable(x):
    """A JSON-safe stand-in for an option's value (its repr when it is not a plain scalar)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)
