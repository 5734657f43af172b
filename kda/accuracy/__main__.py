"""`python -m kda.accuracy [--preset quick|full|tiny] [--device cpu|cuda] [--seed N] [--out-dir DIR]
[--check BASELINE.json]`, or `python -m kda.accuracy --inputs CAPTURE_DIR [--out-dir DIR]` (a model's
captured activations, `kda.accuracy.capture`): see docs/accuracy.md."""

import sys

from .cli import main

sys.exit(main())
