"""`python -m kda.accuracy [--preset quick|full|tiny] [--device cpu|cuda] [--seed N] [--out-dir DIR]
[--check BASELINE.json]`: see docs/accuracy.md."""

import sys

from .cli import main

sys.exit(main())
