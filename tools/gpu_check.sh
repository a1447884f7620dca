#!/usr/bin/env bash
# The first GPU hour's verdict in one command (docs/gpu.md): benchmark, compiled graphs, memory,
# activation checkpointing and a short training run; a table, then one JSON line. Exit code 0 when
# every check passed, 1 when one failed (the reasons on stderr), 2 for bad flags.
#   tools/gpu_check.sh                    # the record's shapes on every visible GPU (1 to 8)
#   tools/gpu_check.sh --preset tiny      # the same logic at toy size; on the CPU without a GPU
#   tools/gpu_check.sh --offline --arch 9.0   # before renting: compile for a GPU this machine lacks
#   PYTHON=.venv/bin/python tools/gpu_check.sh   # choose the interpreter (default python3)
# Any other --field=value is passed on to every trainer run.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
