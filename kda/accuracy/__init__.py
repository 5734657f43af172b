"""The accuracy harness of `kda`: `python -m kda.accuracy` (or `nox -s accuracy`).

It measures `kda.chunk_kda` and `kda.fused_recurrent_kda` against the float64 oracle (`kda_reference`)
and writes `accuracy_reports/<preset>-<device>/report.{md,json}` and PNG plots: the evidence for (or
against) storing the recurrent state in fp16 or bf16. docs/accuracy.md says how to run and read it.

Modules: `config` (presets, regimes, thresholds), `inputs` (seeded random inputs), `oracle` (float64
reference and emulation), `kernels` (the measured entry points), `measure` (errors, floors, fits),
the studies `decode`, `prefill` (dtype matrix, length, chunked prefill, adversarial) and `layouts`
(varlen, paged vs dense), `verdict`, `report`, `check` (`--check BASELINE.json`) and `cli`.
"""

from .cli import main

__all__ = ["main"]
