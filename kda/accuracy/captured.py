"""A capture directory (written by `kda.accuracy.capture`) read back as layers of sequences, checked on the way.

Every file is read with `torch.load(weights_only=True)`; a missing, unreadable or inconsistent file raises
`CaptureError` naming it. Per layer, each sequence's pieces are joined in call order and split into
- the prefill: its tokens up to the last piece longer than one token (chunked prefills join into one), and
- the continuation: the one-token pieces after it (decode steps), replayed token by token.
A layer whose calls disagree on an option, on `A_log` or `dt_bias`, or hold an unsupported call (module
`recording`) is left out with the reason; so are the sequences such a call touched.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from .recording import FORMAT, INDEX, TENSORS

FLAGS = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_gate_in_kernel", "lower_bound", "scale")


class CaptureError(ValueError):
    """A capture directory that cannot be replayed; the message names the file and what is wrong."""


@dataclass
class Sequence:
    """One sequence of a layer: its initial state (K-first `[HV, K, V]`, None: zeros), its prefill and its
    continuation as dicts of q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV, K]`, beta `[T, HV]`."""

    id: int
    initial_state: torch.Tensor | None
    prefill: dict
    decode: dict

    @property
    def prefill_len(self) -> int:
        return self.prefill["q"].shape[0]

    @property
    def decode_len(self) -> int:
        return self.decode["q"].shape[0]


@dataclass
class Layer:
    """The sequences of one layer, the kernel options they share (flags, scale, A_log, dt_bias), the dtypes
    the model used (inputs, state storage) and what was left out, with reasons."""

    name: str
    options: dict
    sequences: list[Sequence] = field(default_factory=list)
    input_dtype: str = ""
    state_dtype: str | None = None
    calls: int = 0
    left_out: list[str] = field(default_factory=list)

    @property
    def shape(self) -> dict:
        s = self.sequences[0].prefill
        return dict(H=s["q"].shape[1], HV=s["v"].shape[1], K=s["q"].shape[2], V=s["v"].shape[2])


def _load_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    if not os.path.isfile(path):
        raise CaptureError(f"{path}: missing; a capture directory holds the index.json that kda.accuracy.capture "
                           "writes when its context closes")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise CaptureError(f"{path}: not readable as JSON ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("calls"), list):
        raise CaptureError(f"{path}: not a capture index of format {FORMAT} (keys format, calls, sequences)")
    return index


def _load_call(directory: str, call: dict) -> dict:
    """The tensors of one recorded call, checked against its index entry."""
    path = os.path.join(directory, str(call.get("file")))
    if not os.path.isfile(path):
        raise CaptureError(f"{path}: missing (listed in {INDEX})")
    try:
        tensors = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CaptureError(f"{path}: not readable with torch.load(weights_only=True) ({type(exc).__name__}: "
                           f"{exc})") from exc
    needed = list(TENSORS) + [p["initial_state"] for p in call["pieces"] if p.get("initial_state")]
    if not isinstance(tensors, dict) or any(not isinstance(tensors.get(n), torch.Tensor) for n in needed):
        missing = [n for n in needed if not isinstance(tensors, dict) or not isinstance(tensors.get(n), torch.Tensor)]
        raise CaptureError(f"{path}: tensors {missing} missing")
    q, v = tensors["q"], tensors["v"]
    B, T = q.shape[:2] if q.dim() == 4 else (None, None)
    shapes = dict(q=4, k=4, v=4, g=4, beta=3)
    if B is None or any(tensors[n].dim() != d or tensors[n].shape[:2] != (B, T) for n, d in shapes.items()) \
            or v.shape[2] != tensors["g"].shape[2] or tensors["beta"].shape[2] != v.shape[2]:
        raise CaptureError(f"{path}: q, k, v, g, beta shapes {[tuple(tensors[n].shape) for n in TENSORS]} are not "
                           "[B, T, H, K], [B, T, H, K], [B, T, HV, V], [B, T, HV, K], [B, T, HV]")
    for p in call["pieces"]:
        if not (0 <= p["batch"] < B and 0 <= p["start"] <= p["end"] <= T):
            raise CaptureError(f"{path}: piece rows {p['batch']}, [{p['start']}, {p['end']}) outside [B={B}, T={T}]")
    return tensors


def _options(call: dict, tensors: dict) -> dict:
    opts = {n: call["options"].get(n) for n in FLAGS}
    opts = {n: x for n, x in opts.items() if x is not None or n == "scale"}
    for n in ("A_log", "dt_bias"):
        if n in tensors:
            opts[n] = tensors[n]
    return opts


def _same(a: dict, b: dict) -> list[str]:
    """The options on which a and b differ."""
    out = []
    for n in set(a) | set(b):
        x, y = a.get(n), b.get(n)
        same = (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y)
        if not same:
            out.append(n)
    return sorted(out)


def _join(pieces: list[dict], first: dict) -> dict:
    """The pieces' tensors joined along time (empty, shaped like `first`'s, when there are none)."""
    return {n: torch.cat([p[n] for p in pieces]) if pieces else first[n][:0] for n in TENSORS}


def load(directory: str) -> tuple[list[Layer], dict]:
    """(layers, index) of a capture directory (module docstring), layers in the order they were first called."""
    index = _load_index(directory)
    layers: dict[str, Layer] = {}
    pieces: dict[int, list[tuple[dict, int]]] = {}  # sequence -> [(tensors of the piece), ...]
    bad_seqs: dict[int, str] = {}
    for call in index["calls"]:
        tensors = _load_call(directory, call)
        opts = _options(call, tensors)
        layer = layers.setdefault(call["layer"], Layer(call["layer"], opts, input_dtype=str(tensors["q"].dtype)[6:],
                                                       state_dtype=call.get("state_dtype")))
        layer.calls += 1
        differ = _same(layer.options, opts)
        reason = None
        if differ:
            reason = f"{call['file']}: options {differ} differ from the layer's first call"
        elif call.get("unsupported"):
            reason = f"{call['file']}: unsupported ({'; '.join(call['unsupported'])})"
        for p in call["pieces"]:
            if reason:
                bad_seqs.setdefault(p["seq"], reason)
            b, s, e = p["batch"], p["start"], p["end"]
            piece = {n: tensors[n][b, s:e] for n in TENSORS}
            if p.get("initial_state"):
                piece["initial_state"] = tensors[p["initial_state"]]
            pieces.setdefault(p["seq"], []).append(piece)
    for seq, info in enumerate(index.get("sequences", [])):
        if seq not in pieces:
            continue
        layer = layers[info["layer"]]
        if seq in bad_seqs:
            layer.left_out.append(f"sequence {seq}: {bad_seqs[seq]}")
            continue
        parts = pieces[seq]
        if sum(p["q"].shape[0] for p in parts) == 0:
            continue
        cut = len(parts)
        while cut > 0 and parts[cut - 1]["q"].shape[0] == 1:
            cut -= 1
        layer.sequences.append(Sequence(seq, parts[0].get("initial_state"), _join(parts[:cut], parts[0]),
                                        _join(parts[cut:], parts[0])))
    for layer in layers.values():
        if not layer.sequences:
            layer.left_out.append("no sequence to replay")
    return list(layers.values()), index
