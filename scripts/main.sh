#!/usr/bin/env bash
# Set up ./.venv (CPU torch without a GPU) and run the main job: a short training run with the
# memory callbacks, then the memory summary and the path of the timeline plot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh examples
.venv/bin/python examples/quickstart.py "$@"
