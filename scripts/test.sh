#!/usr/bin/env bash
# Set up ./.venv (CPU torch without a GPU); run the lint checks, the documentation build and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test,docs
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The documentation site: a broken link, page or API reference fails the build.
site=$(mktemp -d)
# No --quiet: it drops the warnings before --strict counts them, and the build would pass with them.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
# Every API page opened in headless Chromium at 1280 pixels: a signature wider than its box, or anything sticking out
# of the content column, fails (exit 1). Without Chromium (exit 2) the step says so and the run goes on.
rc=0
.venv/bin/python scripts/check_api_pages.py "$site" || rc=$?
if [ "$rc" = 2 ]; then
    echo "API pages NOT checked in a browser: no Chromium here (apt-get install chromium)" >&2
elif [ "$rc" != 0 ]; then
    exit "$rc"
fi
rm -rf "$site"
# Two processes (pytest-xdist): independent tests share the 2 cores CI has; `-n 0` after it runs them in one.
# Bytecode caches are written (into the clone's __pycache__/, ignored by git) even where the environment turns them
# off: every xdist worker and every process a test starts would otherwise compile the package and the tests again
# (collection alone: 9.3 s against 5.6 s per process).
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -n 2 "$@"
