#!/usr/bin/env bash
# Set up ./.venv (CPU torch without a GPU) and run the main job: DreaMS-style fine-tuning of a small
# transformer over synthetic MS/MS spectra (tiny model preset, CPU, under a minute on 2 cores) with every
# lightning-memopt callback, then print where the memory log, the memory plot and the checkpoints are,
# and the memory summary.
#
# Safe to run again: each run writes to a new outputs/dreams/version_<n>/ and reuses the synthetic
# spectra in outputs/data/. Extra arguments go to examples/dreams/train.py (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh examples
.venv/bin/python examples/dreams/train.py --model_preset tiny --accelerator cpu "$@"
