#!/usr/bin/env bash
# Install offload with its test dependencies and run the test suite (CPU; tests marked
# `gpu` skip themselves where there is no CUDA device). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[test]"
ruff check offload tests scripts
python -m pytest -q "$@"
