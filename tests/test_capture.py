"""`kda.accuracy.capture` and `python -m kda.accuracy --inputs`: a capture changes no bit of the model's
results, the replay's numbers equal the same quantities computed here from the captured files with
`kda_reference` and the kernels, the budget stops the recording and says so, a broken directory names
the broken file, and the sequence rules (slot, state bits, layer names) hold."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

import kda
import kda.api
import kda_reference as ref
from kda.accuracy import capture, cli
from kda.accuracy.captured import CaptureError, load
from kda.accuracy.decode import window
from kda.accuracy.measure import same_bits

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, STEPS = (20, 9), 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # as conftest's: the interpreter on CPU
REPLAY = ["--device", DEVICE, "--quiet"]


def _example():
    spec = importlib.util.spec_from_file_location("capture_model", ROOT / "examples" / "capture_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The example model run twice, without and with a capture: (outputs, captured outputs, capture dir)."""
    directory = tmp_path_factory.mktemp("cap") / "example"
    plain = example.run_model(PROMPTS, STEPS, device=DEVICE)
    with capture(directory, layers_per_forward=2) as cap:
        recorded = example.run_model(PROMPTS, STEPS, device=DEVICE)
    assert cap.calls_recorded == cap.calls_seen == 2 * (1 + STEPS) and cap.stopped is None
    return plain, recorded, directory


@pytest.fixture(scope="module")
def replayed(captured, tmp_path_factory):
    """The README's replay command on the capture: report.json."""
    out = tmp_path_factory.mktemp("report")
    assert cli.main(["--inputs", str(captured[2]), "--out", str(out), *REPLAY]) == 0
    return json.loads((out / "report.json").read_text()), out


def test_capture_leaves_outputs_bitwise_unchanged(captured):
    plain, recorded, _ = captured
    assert len(plain) == len(recorded) == 1 + STEPS
    for a, b in zip(plain, recorded):
        assert same_bits(a, b)
    assert kda.chunk_kda is kda.api.chunk_kda and kda.fused_recurrent_kda is kda.api.fused_recurrent_kda
    assert not hasattr(kda.chunk_kda, "__wrapped__")


def test_capture_restores_on_exception(tmp_path):
    original = kda.api.chunk_kda
    with pytest.raises(RuntimeError, match="inside"):
        with capture(tmp_path / "c"):
            assert kda.chunk_kda is not original
            raise RuntimeError("inside")
    assert kda.chunk_kda is original and kda.api.chunk_kda is original
    assert json.loads((tmp_path / "c" / "index.json").read_text())["calls"] == []


def test_capture_files_and_layers(captured):
    """Files load with weights_only; layer0/layer1 by call order; each sequence's decode steps continue it."""
    directory = captured[2]
    index = json.loads((directory / "index.json").read_text())
    for c in index["calls"]:
        tensors = torch.load(directory / c["file"], weights_only=True)
        assert set(tensors) >= {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens"}
    assert [c["layer"] for c in index["calls"]] == ["layer0", "layer1"] * (1 + STEPS)
    layers, _ = load(str(directory))
    assert [L.name for L in layers] == ["layer0", "layer1"]
    for L in layers:
        assert [(s.prefill_len, s.decode_len) for s in L.sequences] == [(p, STEPS) for p in PROMPTS]
        assert L.options["lower_bound"] == -5.0 and L.options["use_gate_in_kernel"]


def _direct(directory: Path, layer: str, dtype: torch.dtype) -> dict:
    """The replay's numbers for one layer and one round-to-nearest pool dtype, computed here from the files:
    each sequence alone, its prefill through chunk_kda and its tokens through fused_recurrent_kda, against
    kda_reference.recurrent_kda in float64."""
    index = json.loads((directory / "index.json").read_text())
    seqs: dict[int, list] = {}
    opts = None
    for c in index["calls"]:
        if c["layer"] != layer:
            continue
        t = torch.load(directory / c["file"], weights_only=True, map_location=DEVICE)
        opts = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                    lower_bound=-5.0, A_log=t["A_log"], dt_bias=t["dt_bias"])
        for p in c["pieces"]:
            seqs.setdefault(p["seq"], []).append({n: t[n][p["batch"], p["start"]:p["end"]]
                                                  for n in ("q", "k", "v", "g", "beta")})
    num = den = floor = st_num = st_den = 0.0
    for parts in seqs.values():
        full = {n: torch.cat([p[n] for p in parts]).unsqueeze(0) for n in parts[0]}
        P = parts[0]["q"].shape[0]
        o_ref, s_ref = ref.recurrent_kda(*(full[n] for n in ("q", "k", "v", "g", "beta")), output_final_state=True,
                                         state_dtype=torch.float64, allow_float64=True, **opts)
        x = {n: full[n].float() if n in ("q", "k", "v") else full[n] for n in full}
        pool = torch.full((2, *s_ref.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
        slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        one = dict(state_cache=pool, state_indices=slot, state_v_first=True, **opts)
        kda.chunk_kda(*_tokens(x, slice(0, P)), has_initial_state=torch.tensor([False], device=DEVICE), **one)
        outs = [kda.fused_recurrent_kda(*_tokens(x, slice(t, t + 1)), **one)[0][0, 0] for t in range(P, P + STEPS)]
        for s in range(STEPS - window(STEPS), STEPS):
            exact = o_ref[0, P + s]
            num += (outs[s].double() - exact).square().sum().item()
            den += exact.square().sum().item()
            floor += (exact.to(torch.bfloat16).double() - exact).square().sum().item()
        st_num += (pool[1].double().transpose(-1, -2) - s_ref[0]).square().sum().item()
        st_den += s_ref[0].square().sum().item()
    return dict(out_rel=math.sqrt(num / den), out_floor_bf16=math.sqrt(floor / den),
                state_rel=math.sqrt(st_num / st_den))


def _tokens(x: dict, tokens: slice) -> tuple:
    return tuple(x[n][:, tokens].contiguous() for n in ("q", "k", "v", "g", "beta"))


@pytest.mark.parametrize("layer,dtype", [("layer1", torch.bfloat16), ("layer0", torch.float16)])
def test_replay_equals_direct_computation(captured, replayed, layer, dtype):
    report, _ = replayed
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    got = next(x for x in report["entries"] if x["id"] == f"captured/{layer}/{name}")
    want = _direct(captured[2], layer, dtype)
    assert got["info"]["steps"][-1] == STEPS
    for key, value in (("out_rel", got["metrics"]["out_rel"][-1]), ("state_rel", got["metrics"]["state_rel"][-1]),
                       ("out_floor_bf16", got["info"]["out_floor_bf16"][-1])):
        assert value == pytest.approx(want[key], rel=6e-3), key  # report.json keeps 3 significant digits
    verdict = next(v for v in report["verdicts_per_layer"] if v["layer"] == layer and v["state"] == name)
    assert verdict["out_over_floor"] == pytest.approx(want["out_rel"] / want["out_floor_bf16"], rel=1e-2)
    assert verdict["passes"] == (verdict["out_over_floor"] <= 1 and verdict["out_over_emulation"] <= 1.5
                                 and verdict["state_over_emulation"] <= 1.5)


def test_replay_report(replayed):
    """Per layer and for the model, worst layer named, the short capture said so; report.md written."""
    report, out = replayed
    assert {v["state"] for v in report["verdicts"]} == {"fp32", "fp16", "bf16"}
    for v in report["verdicts"]:
        assert v["worst_layer"] in ("layer0", "layer1") and f"worst layer {v['worst_layer']}" in v["text"]
        assert v["text"].startswith(("passes in every captured layer", "FAILS in layer(s)"))
    assert any("16384" in n and f"{STEPS} decode steps" in n for n in report["notes"])
    md = (out / "report.md").read_text()
    assert "## Verdict for the model" in md and "## What this capture cannot decide" in md


def test_budget_stops_recording(tmp_path):
    directory = tmp_path / "small"
    plain = example.run_model(PROMPTS, 1, device=DEVICE)
    with pytest.warns(UserWarning, match="stopped recording"):
        with capture(directory, max_tokens=sum(PROMPTS) + 1, layers_per_forward=2) as cap:
            recorded = example.run_model(PROMPTS, 1, device=DEVICE)
    assert all(same_bits(a, b) for a, b in zip(plain, recorded))  # the model ran on
    index = json.loads((directory / "index.json").read_text())
    assert cap.calls_recorded == 1 and index["calls_recorded"] == 1 and index["calls_seen"] == 4
    assert index["stopped"]["at_call"] == 2 and "max_tokens" in index["stopped"]["reason"]
    out = tmp_path / "report"
    assert cli.main(["--inputs", str(directory), "--out", str(out), *REPLAY]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["verdicts"] == [] and any("stopped recording" in n for n in report["notes"])
    assert any("no decode steps" in n for n in report["notes"])


def _broken(captured, tmp_path, name: str) -> Path:
    directory = tmp_path / name
    shutil.copytree(captured[2], directory)
    return directory


def test_missing_or_mangled_file_named(captured, tmp_path):
    d = _broken(captured, tmp_path, "missing")
    (d / "calls" / "00003.pt").unlink()
    with pytest.raises(CaptureError, match=r"calls/00003\.pt: missing"):
        load(str(d))
    d = _broken(captured, tmp_path, "mangled")
    (d / "calls" / "00002.pt").write_bytes(b"not a torch file")
    with pytest.raises(CaptureError, match=r"calls/00002\.pt: not readable"):
        load(str(d))
    d = _broken(captured, tmp_path, "pickled")
    torch.save({"q": types.SimpleNamespace(x=1)}, d / "calls" / "00001.pt")  # not loadable with weights_only
    with pytest.raises(CaptureError, match=r"calls/00001\.pt: not readable with torch.load\(weights_only=True\)"):
        load(str(d))
    d = _broken(captured, tmp_path, "keys")
    torch.save({"q": torch.zeros(1)}, d / "calls" / "00004.pt")
    with pytest.raises(CaptureError, match=r"calls/00004\.pt: tensors \['k', 'v', 'g', 'beta'\] missing"):
        load(str(d))
    d = _broken(captured, tmp_path, "index")
    (d / "index.json").write_text("{ truncated")
    with pytest.raises(SystemExit, match=r"index\.json: not readable as JSON"):
        cli.main(["--inputs", str(d), *REPLAY])
    (d / "index.json").unlink()
    with pytest.raises(SystemExit, match=r"index\.json: missing"):
        cli.main(["--inputs", str(d), *REPLAY])


def test_dense_continuation_by_state_bits_and_named_layers(tmp_path):
    """Dense calls: a piece continues the sequence whose final state it starts from, whatever its batch row;
    `cap.layer(name)` names the calls; a module that imported the function by name is captured too."""
    gen = torch.Generator().manual_seed(1)
    x = lambda T: tuple(t.to(DEVICE) for t in (  # noqa: E731
        torch.randn(2, T, 1, 8, generator=gen), torch.randn(2, T, 1, 8, generator=gen),
        torch.randn(2, T, 1, 8, generator=gen), -torch.rand(2, T, 1, 8, generator=gen),
        torch.rand(2, T, 1, generator=gen)))
    user = types.ModuleType("user_model")
    user.chunk_kda = kda.chunk_kda  # `from kda import chunk_kda`
    sys.modules["user_model"] = user
    try:
        with capture(tmp_path / "dense") as cap:
            with cap.layer("attn"):
                _, S = user.chunk_kda(*x(5), output_final_state=True)
                _, S2 = kda.fused_recurrent_kda(*x(1), initial_state=S.flip(0).contiguous(), output_final_state=True)
                kda.fused_recurrent_kda(*x(1), initial_state=torch.ones_like(S))  # matches nothing: new sequences
        assert user.chunk_kda is kda.api.chunk_kda
    finally:
        del sys.modules["user_model"]
    index = json.loads((tmp_path / "dense" / "index.json").read_text())
    assert [c["layer"] for c in index["calls"]] == ["attn"] * 3
    assert [p["seq"] for p in index["calls"][1]["pieces"]] == [1, 0]  # rows swapped, sequences followed
    third = index["calls"][2]["pieces"]
    assert [p["seq"] for p in third] == [2, 3] and all(p["initial_state"] for p in third)
    layers, _ = load(str(tmp_path / "dense"))
    assert [(s.prefill_len, s.decode_len, s.initial_state is None) for s in layers[0].sequences] == \
        [(5, 1, True), (5, 1, True), (0, 1, False), (0, 1, False)]


def test_fla_path(tmp_path):
    fla_kda = pytest.importorskip("fla.ops.kda", reason="fla is not installed: its capture path is not exercised")
    if not torch.cuda.is_available():
        pytest.skip("fla's kernels need a CUDA device")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=gen).cuda().bfloat16() for _ in range(3))
    g = -torch.rand(1, 16, 2, 64, generator=gen).cuda()
    beta = torch.rand(1, 16, 2, generator=gen).cuda().bfloat16()
    plain, _ = fla_kda.chunk_kda(q, k, v, g, beta)
    with capture(tmp_path / "fla"):
        got, _ = fla_kda.chunk_kda(q, k, v, g, beta)
    assert same_bits(plain, got)
    index = json.loads((tmp_path / "fla" / "index.json").read_text())
    assert [c["source"] for c in index["calls"]] == ["fla"]


def test_readme_commands(tmp_path, monkeypatch, capsys):
    """The README's commands, in-process from a fresh directory: the example's main under capture, then the
    replay into accuracy_reports/inputs-<name>/."""
    monkeypatch.chdir(tmp_path)
    assert example.main(["--capture", "captures/example", "--prompts", "5,3", "--steps", "2"]) == 0
    assert "captured 6 of 6 KDA calls" in capsys.readouterr().out
    # the README's replay command (on a GPU machine, where kda's kernels are not interpreted, with --device cuda)
    on_gpu = ["--device", "cuda"] if DEVICE == "cuda" else []
    assert cli.main(["--inputs", "captures/example", "--quiet", *on_gpu]) == 0
    out = capsys.readouterr().out
    assert "inputs-example" in out and "bf16 state:" in out
    assert (tmp_path / "accuracy_reports" / "inputs-example" / "report.md").is_file()
