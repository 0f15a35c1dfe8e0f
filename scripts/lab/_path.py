"""Puts scripts/ on the import path, so that a lab script imports the harnesses there
(`benchlib`, `bench_kernels`, `validate_cost_model`) when run as
`python scripts/lab/NAME.py`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
