"""What every study gets: the preset, the device, the seed, the progress line, and the entry format."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .config import Preset
from .inputs import generator


@dataclass
class Context:
    preset: Preset
    device: str
    seed: int
    start: float = field(default_factory=time.time)  # wall clock: worker processes share it
    quiet: bool = False

    def gen(self, label: str) -> torch.Generator:
        return generator(self.seed, label)

    def elapsed(self) -> float:
        return time.time() - self.start

    def progress(self, message: str) -> None:
        """One line on stderr per measurement group, with the elapsed time."""
        if not self.quiet:
            print(f"[kda.accuracy {self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def entry(section: str, id_: str, params: dict, metrics: dict, info: dict | None = None,
          checks: dict | None = None) -> dict:
    """One measurement. `metrics` are errors (numbers or lists of numbers, all relative) that `--check`
    compares with a baseline; `checks` are properties that must hold (bitwise agreement, finiteness,
    bounds) and must stay true; `info` is everything else (floors, ratios, fits), not compared."""
    return dict(id=f"{section}/{id_}", section=section, params=params, metrics=metrics, info=info or {},
                checks=checks or {})
