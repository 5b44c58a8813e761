#!/usr/bin/env bash
# Set up ./.venv for this project: safe to run any number of times.
#
#   bash scripts/bootstrap.sh [EXTRAS]      (EXTRAS default: test)
#
# With the test extra it also puts pytorch-lightning 2.1.4 (the oldest Lightning served) into .venv/lightning-oldest.
#
# On a machine without an NVIDIA GPU it installs the CPU build of torch (never the multi-GB CUDA
# packages) before anything that depends on torch; with a GPU it installs the default (CUDA) build.
# A second run with an unchanged pyproject.toml installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${LIGHTNING_MEMOPT_VENV:-.venv}
EXTRAS=${1:-test}
CPU_TORCH=${LIGHTNING_MEMOPT_CPU_TORCH:-torch==2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.lightning-memopt-$EXTRAS-$(cksum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && "$PY" -c "import lightning_memopt, torch" 2>/dev/null; then
  exit 0
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if has_gpu; then
    echo "bootstrap: NVIDIA GPU found; installing torch with CUDA"
    "$PY" -m pip install "torch>=2.13"
  else
    echo "bootstrap: no GPU; installing the CPU build of torch ($CPU_TORCH)"
    if "$PY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
      "$PY" -m pip install "$CPU_TORCH" --extra-index-url "$CPU_INDEX"
    else
      # The CPU index is out of reach: use pip's configured sources (e.g. a local wheel directory).
      "$PY" -m pip install "$CPU_TORCH"
    fi
    if [ "$("$PY" -c 'import torch; print(torch.version.cuda is None)')" != "True" ]; then
      echo "bootstrap: warning: the torch that was installed is a CUDA build" >&2
    fi
  fi
fi

"$PY" -m pip install -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",test,"* ]]; then
  # The oldest Lightning served (lightning_memopt.utilities.namespaces.MIN_VERSION), beside the venv: tests/test_namespaces.py
  # runs the contract tests on it with this folder first on PYTHONPATH. setuptools<70 gives it pkg_resources.
  rm -rf "$VENV/lightning-oldest"
  "$PY" -m pip install --quiet --no-deps --target "$VENV/lightning-oldest" \
    pytorch-lightning==2.1.4 lightning-fabric==2.1.4 "setuptools<70"
fi
rm -f "$VENV"/.lightning-memopt-"$EXTRAS"-*
touch "$stamp"
