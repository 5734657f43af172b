"""The accuracy harness of `kda`: `python -m kda.accuracy` (or `nox -s accuracy`).

It measures `kda.chunk_kda` and `kda.fused_recurrent_kda` against the float64 oracle (`kda_reference`)
and writes `accuracy_reports/<preset>-<device>/report.{md,json}` and PNG plots: the evidence for (or
against) storing the recurrent state in fp16 or bf16. docs/accuracy.md says how to run and read it.

Modules: `config` (presets, regimes, thresholds), `inputs` (seeded random inputs), `oracle` (float64
reference and emulation), `kernels` (the measured entry points), `measure` (errors, floors, fits),
the studies `decode`, `prefill` (dtype matrix, length, chunked prefill, adversarial) and `layouts`
(varlen, paged vs dense), `verdict`, `report`, `check` (`--check BASELINE.json`) and `cli`.

On a user's own model: `capture` (module `recording`) records its KDA calls; `python -m kda.accuracy --inputs DIR`
replays them (`captured`: loading, `captured_study`: the measurements, `captured_report`: the report).
"""

from .cli import main

__all__ = ["capture", "main"]


def capture(directory, *, max_tokens: int = 1 << 20, max_bytes: int = 1 << 30, layers_per_forward: int | None = None,
            include_fla: bool = True):
    """A context manager that records every KDA call made while it is open into `directory`, for
    `python -m kda.accuracy --inputs directory` (`kda.accuracy.recording` states the rules: layer names,
    sequence identity, budget). Imported here lazily: `python -m kda.accuracy` loads torch only after
    checking its optional dependencies."""
    from .recording import Capture

    return Capture(directory, max_tokens=max_tokens, max_bytes=max_bytes, layers_per_forward=layers_per_forward,
                   include_fla=include_fla)
