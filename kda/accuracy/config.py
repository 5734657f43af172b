"""What the harness sweeps (presets, decay regimes) and the thresholds its verdicts and `--check` use.

Every threshold lives here, is written into report.json and report.md, and is explained in
docs/accuracy.md; change it there too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: n for n, v in DTYPES.items()}[dtype]


# --- decay regimes (docs/accuracy.md, "The studies") ----------------------------------------------------------

LOWER_BOUND = -5.0  # the lower-bound gate g = -5 * sigmoid(x) of every regime


@dataclass(frozen=True)
class Regime:
    """Raw gate x ~ N(gate_mean, 1) through g = LOWER_BOUND * sigmoid(x); beta = sigmoid(N(beta_mean, 1))."""

    name: str
    gate_mean: float
    beta_mean: float
    decay: str  # the typical per-token decay, for the report
    heads: str  # which heads the regime stands for, for the report's advice


REGIMES = {
    "strong": Regime("strong", 0.0, 0.0, "about exp(-2.5) per token (Kimi-like)", "Kimi-like strong decay"),
    "weak": Regime("weak", -6.0, 0.0, "about exp(-0.012) per token (memory ~80 tokens)",
                   "weak-decay heads with ~80-token memory"),
    "long": Regime("long", -12.0, -4.0, "about exp(-3e-5) per token, beta ~ 0.02 (long memory)",
                   "long-memory heads"),
}

# --- thresholds -----------------------------------------------------------------------------------------

# Verdict of a narrow state storage dtype, per decay regime, from the decode study (fp32 inputs and
# outputs, so the output error is the error the state storage causes):
#   (1) output error at the longest measured step count <= OUTPUT_FLOOR_FACTOR x the bf16 rounding floor
#       of the exact output (what storing the output in bf16 already costs). With factor 1 the state
#       adds at most as much error as the bf16 output itself: a bf16 output then carries at most
#       sqrt(2) = 1.41x its unavoidable error;
#   (2) kernel / emulation ratio of the output and of the state error <= EMULATION_RATIO_MAX (the kernel
#       adds nothing beyond the rounding the storage dtype forces; noise between two rounding sequences
#       of the same data is well inside 1.5x).
OUTPUT_FLOOR_FACTOR = 1.0
EMULATION_RATIO_MAX = 1.5
# A fitted growth exponent whose 95% interval lies above this is reported as "still growing": the
# verdict then holds only up to the measured step count.
GROWING_EXPONENT = 0.1
# Kernel sanity bound of the dtype matrix, the varlen and the adversarial studies (the criterion of
# tests/test_chunk.py, which imports these), for the output and the final state:
# - fp32 inputs: error <= KERNEL_FLOOR_FACTOR x rounding floor + KERNEL_FP32_TERM;
# - fp16/bf16 inputs: error <= max(KERNEL_FLOOR_FACTOR x floor, floor + KERNEL_NARROW_TERM). chunk_kda's
#   intermediates then keep an 11-bit significand (tf32 dots on a GPU, fp16 workspaces on every device:
#   kda.plan.dot_precision, kda.plan.workspace_dtype), unit roundoff 2^-11 carried through a few
#   chained products; the result's own rounding (the floor) comes on top. For fp16 inputs the two are of
#   one size (H200, T = 2048: output 1.1e-3 against a floor of 2.1e-4), for bf16 the floor dominates.
KERNEL_FLOOR_FACTOR = 2.0
KERNEL_FP32_TERM = 1e-5
KERNEL_NARROW_TERM = 4 * 2.0**-11
# Paged vs dense with a slot stride that is not a multiple of 16 elements (kda/accuracy/layouts.py
# `reorder_bound`): the fp32 term on top of 2 unit roundoffs of the stored dtype, the relative L2
# difference that two K-summation orders may leave in fp32 results before their final rounding.
REORDER_FP32_TERM = 1e-6
# --check: an error metric fails when new > CHECK_FACTOR * baseline + CHECK_SLACK. The metrics are
# relative (L2 relative error, max abs error / max |exact|), so the slack is relative too: 5e-7 is about
# 4 fp32 ulps (2^-21), where fp32 results sit and where a different summation order alone moves them.
CHECK_FACTOR = 2.0
CHECK_SLACK = 5e-7
# Fits of error vs steps use checkpoints from this step count on (the first few steps are too few
# roundings to be on the curve).
FIT_MIN_STEP = 16
# Decode output error at step s: relative L2 over the last min(OUTPUT_WINDOW, ceil(s / 2)) steps.
OUTPUT_WINDOW = 64


def thresholds() -> dict:
    return dict(
        output_floor_factor=OUTPUT_FLOOR_FACTOR, emulation_ratio_max=EMULATION_RATIO_MAX,
        growing_exponent=GROWING_EXPONENT, kernel_floor_factor=KERNEL_FLOOR_FACTOR,
        kernel_fp32_term=KERNEL_FP32_TERM, kernel_narrow_term=KERNEL_NARROW_TERM,
        reorder_fp32_term=REORDER_FP32_TERM, check_factor=CHECK_FACTOR, check_slack=CHECK_SLACK,
        fit_min_step=FIT_MIN_STEP, output_window=OUTPUT_WINDOW,
    )


# --- presets --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Sizes of every study. K = V; H q/k heads, HV value heads (HV > H: GVA)."""

    name: str
    purpose: str  # one line for the report: what the preset is for
    proxy_for: str | None  # the preset whose verdict this one stands in for (None: it decides itself)
    K: int
    H: int
    HV: int
    # dtype matrix: input dtype x state storage x gate form, both kernels
    matrix_T: int
    matrix_B: int
    matrix_inputs: tuple[str, ...]
    matrix_states: tuple[str, ...]
    matrix_gates: tuple[str, ...]
    # growth with length (chunk_kda, one sequence per batch row, prefixes of one long sequence)
    length_Ts: tuple[int, ...]
    length_B: int
    length_regimes: tuple[str, ...]
    length_inputs: tuple[str, ...]
    # growth with decode steps (prefill with chunk_kda, then fused_recurrent_kda one token per call)
    decode_prefill: int
    decode_steps: int
    decode_reps: int  # sequences per regime
    decode_regimes: tuple[str, ...]
    decode_states: tuple[str, ...]
    decode_sr: tuple[str, ...]  # storage dtypes also run with stochastic rounding
    # chunked prefill (one sequence split into pieces, the state stored between pieces)
    chunked_T: int
    chunked_pieces: tuple[int, ...]
    chunked_regimes: tuple[str, ...]
    # varlen layouts, paged vs dense, adversarial inputs
    varlen_max_len: int  # sequence lengths of the layouts are clipped to this
    contract_states: tuple[str, ...]
    adversarial_T: int
    adversarial_cases: tuple[str, ...]
    adversarial_inputs: tuple[str, ...]
    adversarial_states: tuple[str, ...]

    def as_dict(self) -> dict:
        return asdict(self)


ALL3 = ("fp32", "fp16", "bf16")
INPUTS3 = ("bf16", "fp16", "fp32")
GATES = ("logdecay", "softplus", "lower_bound")
ADVERSARIAL = ("strong_decay", "extreme_decay", "weak_decay", "correlated_keys", "large_values")

PRESETS = {
    # For the test suite: seconds in the interpreter; every study runs, on a few points.
    "tiny": Preset(
        name="tiny", purpose="the test suite's preset: every study on a few points; no verdict to act on",
        proxy_for="full", K=16, H=1, HV=1,
        matrix_T=16, matrix_B=1, matrix_inputs=("bf16", "fp32"), matrix_states=("fp32", "bf16"),
        matrix_gates=("lower_bound",),
        length_Ts=(16, 32, 64), length_B=1, length_regimes=("strong",), length_inputs=("fp32",),
        decode_prefill=8, decode_steps=24, decode_reps=1, decode_regimes=("strong", "long"),
        decode_states=("fp32", "bf16"), decode_sr=("bf16",),
        chunked_T=32, chunked_pieces=(1, 4), chunked_regimes=("long",),
        varlen_max_len=5, contract_states=("bf16",),
        adversarial_T=16, adversarial_cases=("strong_decay", "correlated_keys"), adversarial_inputs=("fp32",),
        adversarial_states=("fp32",),
    ),
    # CPU through the Triton interpreter (its run time on 2 cores: README).
    "quick": Preset(
        name="quick", purpose="a CPU proxy (the Triton interpreter) of the full preset: the same studies, regimes "
                           "and thresholds at small sizes",
        proxy_for="full", K=32, H=1, HV=1,
        matrix_T=64, matrix_B=1, matrix_inputs=INPUTS3, matrix_states=ALL3, matrix_gates=GATES,
        length_Ts=(64, 128, 256, 512), length_B=1, length_regimes=("strong", "long"),
        length_inputs=("fp32", "bf16"),
        decode_prefill=64, decode_steps=256, decode_reps=1, decode_regimes=("strong", "weak", "long"),
        decode_states=ALL3, decode_sr=("fp16", "bf16"),
        chunked_T=256, chunked_pieces=(1, 2, 4, 8, 16, 32, 64), chunked_regimes=("strong", "long"),
        varlen_max_len=70, contract_states=ALL3,
        adversarial_T=64, adversarial_cases=ADVERSARIAL, adversarial_inputs=("fp32", "bf16"),
        adversarial_states=ALL3,
    ),
    # One H200: the serving head size, long sequences, 16384 decode steps; about 2 minutes.
    "full": Preset(
        name="full", purpose="the decision preset: the serving head size on one GPU", proxy_for=None, K=128, H=2, HV=4,
        matrix_T=2048, matrix_B=2, matrix_inputs=INPUTS3, matrix_states=ALL3, matrix_gates=GATES,
        length_Ts=tuple(64 * 2**i for i in range(11)), length_B=1, length_regimes=("strong", "weak", "long"),
        length_inputs=("fp32", "bf16"),
        decode_prefill=512, decode_steps=16384, decode_reps=4, decode_regimes=("strong", "weak", "long"),
        decode_states=ALL3, decode_sr=("fp16", "bf16"),
        chunked_T=8192, chunked_pieces=(1, 2, 4, 8, 16, 32, 64), chunked_regimes=("strong", "weak", "long"),
        varlen_max_len=300, contract_states=ALL3,
        adversarial_T=1024, adversarial_cases=ADVERSARIAL, adversarial_inputs=INPUTS3,
        adversarial_states=ALL3,
    ),
}
