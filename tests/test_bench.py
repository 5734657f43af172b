"""The benchmark's CPU-side parts: its command line and its HBM floor (the timing itself needs a GPU)."""

from __future__ import annotations

import collections
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def _tool(name: str = "bench"):
    """The module `benchmarks/<name>.py`, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout and "--no-fla-varlen" in done.stdout and "--plan-device" in done.stdout


def test_plan_device_is_recorded_and_kept_apart_from_the_hopper_rows(tmp_path):
    """`--plan-device sm_80`: the header names the plan kda ran under, every JSON row carries it ("own" without the
    flag), and the default JSON is its own file, so the Hopper plan's `h200-latest.json` is not overwritten."""
    import json

    import pytest

    from kda.plan import DeviceInfo

    bench = _tool()
    own, forced = bench.parse_args([]), bench.parse_args(["--plan-device", "sm_80"])
    assert own.plan_device is None and own.json == bench.RESULTS / "h200-latest.json"
    assert forced.plan_device == "sm_80" and forced.json == bench.RESULTS / "h200-sm_80-plan-latest.json"
    assert bench.parse_args(["--plan-device", "sm_80", "--json", "x.json"]).json == Path("x.json")
    with pytest.raises(SystemExit):
        bench.parse_args(["--plan-device", "sm_75"])
    row = bench.Row(bench.Case("p", "prefill", "dense", 1, 64, 2), 1000, kda_graph=12.5)
    assert bench.row_json(row, 4e12)["plan_device"] == "own"
    bench.write_json(tmp_path / "rows.json", [], [row], 4e12, "sm_80")
    assert json.loads((tmp_path / "rows.json").read_text())[0]["plan_device"] == "sm_80"
    a100 = bench.plan_line("sm_80", DeviceInfo(132, (8, 0), 166912))
    assert a100.startswith("plan device: sm_80, forced") and "capability 8.0, 166912 B" in a100
    assert a100.endswith("132 SMs; no TMA, spin or PDL")
    h200 = bench.plan_line(None, DeviceInfo(132, (9, 0), 232448))
    assert "the GPU's own: capability 9.0" in h200 and h200.endswith("tma, spin, pdl")


def test_floor_bytes_by_hand():
    bench = _tool()
    # H = HV = 12, K = V = 128; per token: q, k bf16 (2 x 12 x 128 x 2 B) + v, o bf16 (same) + g fp32
    # (12 x 128 x 4 B) + beta bf16 (12 x 2 B) = 6144 + 6144 + 6144 + 24 = 18456 B; A_log + dt_bias fp32:
    # 12 x 4 + 12 x 128 x 4 = 6192 B; one fp32 state plane set: 12 x 128 x 128 x 4 = 786432 B.
    decode = bench.Case("d", "decode", "decode", 64, 1, 12)
    # 64 tokens, 64 states read and written, 64 int32 slot indices
    assert bench.floor_bytes(decode) == 64 * 18456 + 2 * 64 * 786432 + 6192 + 64 * 4 == 101_850_928
    prefill = bench.Case("p", "prefill", "dense", 1, 4096, 12)
    # 4096 tokens, one dense state read and written, no indices
    assert bench.floor_bytes(prefill) == 4096 * 18456 + 2 * 786432 + 6192 == 77_174_832
    bf16_pool = bench.Case("d", "decode", "decode", 256, 1, 12, pool_dtype="bfloat16", v_first=False)
    assert bench.floor_bytes(bf16_pool) == 256 * 18456 + 2 * 256 * 786432 // 2 + 6192 + 256 * 4


def test_the_acceptance_rows_are_all_there():
    bench = _tool()
    names = [c.name for c in bench.all_cases()]
    for B, T, H in ((1, 4096, 12), (1, 16384, 12), (1, 4096, 32), (1, 16384, 32), (4, 4096, 32), (1, 8192, 96),
                    (1, 65536, 12)):
        assert f"prefill {B}x{T} H={H}" in names
    # host cost is measured for every contract: a decode row with the bounds on the device only
    assert any(c.group == "decode" and c.seqlens and not c.host_bounds for c in bench.all_cases())
    # every 2-byte pool in both layouts at N = 64, 256, 1024, each beside the fp32 pool of its N and layout
    for n in (64, 256, 1024):
        for layout in ("", "K-first "):
            for dt in ("fp32", "bf16", "fp16"):
                assert f"decode N={n} H=12 {dt} {layout}pool" in names
    kinds = [c.group for c in bench.all_cases()]
    assert kinds[-1] == "varlen" and "mixed" in kinds  # the varlen row runs last


def test_narrow_pool_lines_pair_the_benchmarks_own_rows():
    """The lines under the decode table divide each 2-byte pool's steady time by its fp32 pool's, rows found by the
    names `all_cases` gives them (K-first dense and varlen too), and judge it against 0.6x."""
    bench = _tool()
    cases = {c.name: c for c in bench.all_cases() if c.group == "decode"}
    steady = {  # made-up times: V-first bf16 meets, K-first dense meets, K-first varlen misses
        "decode N=256 H=12 fp32 pool": 100.0, "decode N=256 H=12 bf16 pool": 55.0,
        "decode N=256 H=12 fp32 K-first pool": 108.4, "decode N=256 H=12 bf16 K-first pool": 63.3,
        "decode N=256 H=12 fp32 K-first pool varlen": 100.0, "decode N=256 H=12 bf16 K-first pool varlen": 65.0,
    }
    rows = [bench.Row(case=cases[name], floor_b=1, kda_steady=us) for name, us in steady.items()]
    text = bench.render([], rows, 4.2e12, True)
    import re

    # each pair's ratio, and its verdict against 0.6x, in whatever words the table uses
    found = {(float(r), v) for r, v in re.findall(r"([0-9.]+)x \((meets|misses)", text)}
    assert found == {(0.55, "meets"), (0.584, "meets"), (0.65, "misses")}


def test_no_benchmark_script_shadows_a_standard_module():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: a script named like a standard module
    (profile.py did) replaces it for every library the benchmark imports (fla's import then failed)."""
    import sys
    from pathlib import Path

    names = {p.stem for p in (Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py")}
    assert not names & set(sys.stdlib_module_names)


def test_host_second_pass_keeps_the_faster_pass_and_every_failure_as_it_was():
    """`remeasure_host`: each row's calls rebuilt and timed once more, the faster of the two passes kept for wall
    and CPU time alike; a cell whose first pass failed or was not run keeps its text, and a rebuild or a timing
    that raises leaves the row's first values."""
    bench = _tool()
    case = bench.Case("p", "prefill", "dense", 1, 64, 2)

    def row(**kw):
        return bench.Row(case, 0, **kw)

    rows = [row(kda_host=50.0, kda_host_cpu=49.0, fla_host=900.0, fla_host_cpu=890.0),
            row(kda_host=40.0, kda_host_cpu=40.0, fla_host="n/a"),
            row(kda_host="err", fla_host=800.0, fla_host_cpu=800.0),
            row(kda_host=60.0, kda_host_cpu=60.0),
            row(kda_host=70.0, kda_host_cpu=70.0, split_host=100.0, split_host_cpu=100.0)]
    second = {id(rows[0]): {"kda": (45.0, 46.0), "fla": (950.0, 880.0)},
              id(rows[1]): {"kda": (41.0, 39.0), "fla": (1.0, 1.0)},
              id(rows[2]): {"kda": (1.0, 1.0), "fla": (700.0, 700.0)},
              id(rows[4]): {"kda": ValueError("timing"), "split": (90.0, 95.0)}}
    current, order = {}, iter(rows)

    def make(c, fla, extra):  # called once a row, in order
        r = current["row"] = next(order)
        if r is rows[3]:
            raise RuntimeError("rebuild")
        return {who: (lambda who=who: who) for who in second[id(r)]}, None

    class Timer:
        def host(self, fn):
            value = second[id(current["row"])][fn()]
            if isinstance(value, Exception):
                raise value
            return value

    bench.remeasure_host(rows, Timer(), None, {}, make=make)
    first = rows[0]
    assert (first.kda_host, first.kda_host_cpu, first.fla_host, first.fla_host_cpu) == (45.0, 46.0, 900.0, 880.0)
    assert (rows[1].kda_host, rows[1].kda_host_cpu, rows[1].fla_host) == (40.0, 39.0, "n/a")
    assert (rows[2].kda_host, rows[2].fla_host) == ("err", 700.0)
    assert (rows[3].kda_host, rows[3].kda_host_cpu) == (60.0, 60.0)
    assert (rows[4].kda_host, rows[4].split_host, rows[4].split_host_cpu) == (70.0, 90.0, 95.0)


def test_timeline_reads_the_last_call_of_a_trace():
    kp = _tool("kernel_profile")

    def kernel(ts, dur, name, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    trace = {"traceEvents": [
        kernel(100.0, 5.0, "gate"), kernel(106.0, 50.0, "prepare"), kernel(120.0, 60.0, "walk", stream=9),
        kernel(10.0, 5.0, "gate"), kernel(16.0, 50.0, "prepare"), kernel(20.0, 55.0, "walk", stream=9),
        kernel(101.0, 1.0, "a host op", cat="cpu_op"), {"ph": "i", "cat": "kernel", "ts": 0.0, "name": "marker"},
        kernel(200.0, 4.0, "gate", cat="Kernel"), kernel(205.0, 40.0, "prepare", cat="Kernel"),
    ]}
    spans = kp.kernel_spans(trace)
    assert [s[3] for s in spans] == ["gate", "prepare", "walk", "gate", "prepare", "walk", "gate", "prepare"]
    assert spans[2] == (20.0, 75.0, 9, "walk")
    assert kp.last_call(spans, "gate") == [(200.0, 204.0, 7, "gate"), (205.0, 245.0, 7, "prepare")]
    assert kp.last_call(spans, "absent") == spans
    args = kp.parse_args(["timeline", "--T", "8192", "--plan", "late_chunks=40", "--reps", "2"])
    assert (args.command, args.T, args.reps, [kp.parse_plan(p) for p in args.plan]) == (
        "timeline", 8192, 2, [{"late_chunks": 40}])


def test_ncu_command_takes_metrics_instead_of_sections(monkeypatch, capsys):
    """`kernel_profile.py ncu --metrics M` asks ncu for those counters only and does not pass `--metrics` (or
    `--kernel`, whose value may equal another argument's) on to the profiled `call`; without it the sections."""
    kp = _tool("kernel_profile")
    for argv, want in ((["ncu", "--op", "decode", "--metrics", "dram__bytes_read.sum", "--kernel", "decode"],
                        ["--metrics", "dram__bytes_read.sum"]),
                       (["ncu", "--op", "decode"], ["--section", "SpeedOfLight"])):
        monkeypatch.setattr(sys, "argv", ["kernel_profile.py", *argv])
        assert kp.cmd_ncu(kp.parse_args(argv)) == 0
        cmd = shlex.split(capsys.readouterr().out.strip())
        head, call = cmd[:cmd.index("call")], cmd[cmd.index("call") + 1:]
        assert all(w in head for w in want) and ("--section" in head) != ("--metrics" in head)
        assert call == ["--op", "decode"]


def test_ncu_source_charges_each_instruction_to_its_innermost_loop(tmp_path):
    """`ncu_source.py` on a source page export (a kernel-name row, then the header): a backward branch closes a loop,
    nested loops own their own instructions, every sample lands in exactly one region, opcodes lose their predicate
    and modifiers, and the rows of a second kernel's table are not read."""
    ns = _tool("ncu_source")
    head = ('"# Address","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"stall_long_sb","stall_long_sb (Not Issued)"')  # the second counts a subset of the first's samples again
    body = [("0x00", "MOV R1, c[0x0][0x28]", 1, 1, 0), ("0x10", "LDG.E R2, [R4.64]", 2, 1, 0),
            ("0x20", "FFMA R3, R2, R2, R3", 30, 64, 30), ("0x30", "@!P1 BRA 0x20", 3, 64, 0),
            ("0x40", "BAR.SYNC.DEFER_BLOCKING 0x0", 10, 8, 0), ("0x50", "@!P0 BRA.U.ANY 0x10", 4, 8, 0),
            ("0x60", "EXIT", 0, 1, 0)]
    rows = ['"Kernel Name","k"', head] + [f'"{n}","{a}","{s}","{x}","{e}","{r}","{r // 2}"'
                                        for n, (a, s, x, e, r) in enumerate(body)]
    rows += ['"Kernel Name","other"', head, '"0","0x00","FADD R0, R0, R0","99","99","0","0"']
    path = tmp_path / "walk.csv"
    path.write_text("\n".join(rows) + "\n")
    instrs = ns.read(path)
    assert [i.opcode for i in instrs] == ["MOV", "LDG", "FFMA", "BRA", "BAR", "BRA", "EXIT"]
    spans = ns.loops(instrs)
    assert spans == [(0x10, 0x50), (0x20, 0x30)]
    assert [ns.owner(i.address, spans) for i in instrs] == [None, (0x10, 0x50), (0x20, 0x30), (0x20, 0x30),
                                                          (0x10, 0x50), (0x10, 0x50), None]
    text = ns.summary(instrs, top=2)
    assert "50 stall samples" in text and "FFMA 60.0%" in text and "long_sb 100.0%" in text
    assert "0x0020-0x0030: 2 instructions, 66.0% of samples" in text
    assert "0x0010-0x0050: 3 instructions, 32.0% of samples" in text and "outside loops: 2 instructions, 2.0%" in text


def test_ncu_source_sums_stall_samples_by_source_line(tmp_path):
    """`ncu_source.py --lines` on a `--print-source cuda,sass` export: each file's lines keep their file's name, a
    line's own row (its number) is read and its instructions' rows (no number) are not, the "(Not Issued)" columns
    are not reasons, and the summary orders lines by their samples."""
    ns = _tool("ncu_source")
    head = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","stall_barrier",'
            '"stall_barrier (Not Issued)","stall_long_sb"')
    rows = ['"File Path","/x/lib/standard.py"', '"Function Name","k"', head,
            '"263","return a + b","-","-","7","0","0","2"', '"","","0x10","FADD R1, R1, R2","7","0","0","2"',
            '"File Path","/x/kda/ops/prep.py"', '"Function Name","k"', head,
            '"81","acc = mma(a, b)","-","-","40","30","12","5"', '"","","0x20","HGMMA.64x64x8","25","20","9","0"',
            '"","","0x30","WARPGROUP.DEPBAR.LE gsb0, 0x0","15","10","3","5"', '"","","...","...","-","-","-","-"',
            '"276","x = g_s.load(GT)","-","-","3","0","0","3"']
    path = tmp_path / "lines.csv"
    path.write_text("\n".join(rows) + "\n")
    lines = ns.read_lines(path)
    assert [(x.file, x.line, x.samples) for x in lines] == [("standard.py", 263, 7), ("prep.py", 81, 40),
                                                            ("prep.py", 276, 3)]
    assert lines[1].reasons == {"barrier": 30, "long_sb": 5} and lines[0].reasons == {"long_sb": 2}
    text = ns.line_summary(lines, top=2).splitlines()
    assert text[0] == "3 source lines, 50 stall samples; top 2 lines:"
    assert text[1].split()[:2] == ["80.0%", "prep.py:81"] and text[1].endswith("barrier 30, long_sb 5")
    assert text[2].split()[:2] == ["14.0%", "standard.py:263"] and len(text) == 3


def test_sass_lines_weights_each_loop_by_its_trips(tmp_path):
    """`sass_lines.py` on an `nvdisasm -g` listing: labels resolve to the next instruction's address, a branch back
    to one closes a loop, nested loops multiply their trips, a loop of fewer than 8 instructions (a spin-wait) counts
    once, each instruction is charged to the last line-table entry before it, and opcodes lose their predicate and
    modifiers."""
    ns = _tool("sass_lines")

    def ins(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;"

    lines = ['\t//## File "/x/k.py", line 10', ins(0x00, "MOV R1, c[0x0][0x28]"), ".L_x_0:",
             '\t//## File "/x/k.py", line 20']
    lines += [ins(0x10 * (1 + n), "FFMA R3, R2, R2, R3") for n in range(3)]  # outer loop body before the inner
    lines += [".L_x_1:", '\t//## File "/x/lib.py", line 5']
    lines += [ins(0x40 + 0x10 * n, "FADD.FTZ R4, R4, R3") for n in range(8)]  # inner loop: 8 + its branch
    lines += [ins(0xc0, "@!P1 BRA `(.L_x_1)"), '\t//## File "/x/k.py", line 20', ins(0xd0, "@P0 BRA `(.L_x_0)"),
              ".L_x_2:", ins(0xe0, "LDG.E R5, [R6.64]"), ins(0xf0, "@!P2 BRA `(.L_x_2)"), ins(0x100, "EXIT")]
    instrs, labels = ns.parse("\n".join(lines))
    assert labels == {".L_x_0": 0x10, ".L_x_1": 0x40, ".L_x_2": 0xe0}
    assert [i.opcode for i in instrs][:5] == ["MOV", "FFMA", "FFMA", "FFMA", "FADD"]
    spans = ns.loops(instrs, labels)
    assert spans == [(0x10, 0xd0), (0x40, 0xc0)]  # the 2-instruction spin-wait is not a loop
    counts = ns.census(instrs, spans, 3)
    ops = sum(counts.values(), collections.Counter())
    # MOV, LDG, the spin's BRA and EXIT once; 3 FFMA and the outer BRA 3 times; 8 FADD and the inner BRA 9 times
    assert sum(ops.values()) == 4 + 4 * 3 + 9 * 9
    assert ops["FADD"] == 72 and ops["FFMA"] == 9 and ops["BRA"] == 9 + 3 + 1
    assert counts[("lib.py", 5)] == {"FADD": 72, "BRA": 9}
    assert counts[("k.py", 20)] == {"FFMA": 9, "BRA": 3 + 1, "LDG": 1, "EXIT": 1} and counts[("k.py", 10)] == {"MOV": 1}
    assert sum(sum(c.values()) for c in ns.census(instrs, spans, 3, only=spans[1]).values()) == 9
    assert "97 instructions, loops weighted by 3 trips" in ns.report(instrs, spans, 3, top=2, loop=None)
