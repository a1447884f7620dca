#!/usr/bin/env bash
# The test suite under the lent GPU machine's versions (torch 2.11, triton 3.6), on a CPU.
#
#   tools/test_gpu_stack.sh                    # makes .venv-gpu-stack/ from requirements-gpu-stack.txt if
#                                              # missing, then runs the whole suite (pytest.ini's 2 workers)
#   tools/test_gpu_stack.sh --per-file         # each test file in a fresh process of its own, one worker
#   tools/test_gpu_stack.sh --venv DIR         # that virtual environment (made there if missing)
#   tools/test_gpu_stack.sh --python python3   # an interpreter as it is, nothing installed: the GPU
#                                              # machine's own (torch 2.11 and triton 3.6, no network)
#   tools/test_gpu_stack.sh -- tests/test_fp8_head.py -k quantizers   # files and options for pytest
#
# It prints the versions it tested, then a table per test file (passed, failed, errors, skipped,
# seconds) and the wall time; the exit status is pytest's (nonzero when anything failed). --out DIR
# keeps the JUnit XML and the log of each pytest process there (default: a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-gpu-stack python_bin="" per_file=0 out="" pytest_args=()
while (($#)); do
    case "$1" in
        --venv) venv=$2; shift 2 ;;
        --python) python_bin=$2; shift 2 ;;
        --per-file) per_file=1; shift ;;
        --out) out=$2; shift 2 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "tools/test_gpu_stack.sh: unknown option $1 (see --help; pytest's own options go after --)" >&2
           exit 2 ;;
    esac
done

if [[ -z $python_bin ]]; then
    if [[ ! -x $venv/bin/python ]]; then
        echo "making $venv from requirements-gpu-stack.txt (torch 2.11's CUDA build: about 5 GB)"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet -r requirements-gpu-stack.txt
    fi
    python_bin=$venv/bin/python
fi

# What is tested, and a clear line where it is not the GPU machine's stack or where numpy breaks
# triton's interpreter (the check is tests/conftest.py's, which says so again after the run).
"$python_bin" - <<'EOF'
import importlib.metadata
import sys
sys.path.insert(0, "tests")
import numpy
import torch
from conftest import triton_interpreter_conflict
try:
    triton_version = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    triton_version = None
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton_version}, numpy {numpy.__version__}")
if not torch.__version__.startswith("2.11.") or triton_version != "3.6.0":
    print("note: not the GPU machine's stack (torch 2.11 with triton 3.6); the results are for the versions above")
if triton_version is None:
    print("note: no triton: the Triton kernel tests (tests/test_fused_ce.py) are skipped")
if triton_interpreter_conflict():
    print(f"warning: {triton_interpreter_conflict()}")
EOF

if [[ -z $out ]]; then
    out=$(mktemp -d)
fi
mkdir -p "$out"
rm -f "$out"/*.xml  # the table counts every report there
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
status=0
if ((per_file)); then
    # A fresh process per file: a test that passes only because an earlier file set something up
    # (registered an op, compiled a graph) fails here.
    files=() options=()
    for arg in ${pytest_args[@]+"${pytest_args[@]}"}; do
        if [[ $arg == tests/test_*.py* ]]; then files+=("$arg"); else options+=("$arg"); fi
    done
    ((${#files[@]})) || files=(tests/test_*.py)
    for file in "${files[@]}"; do
        name=$(basename "${file%%::*}" .py)
        echo "running $file"
        "$python_bin" -m pytest -q -n 0 -p no:cacheprovider -rfE -o junit_family=xunit1 \
            --junitxml="$out/$name.xml" "$file" ${options[@]+"${options[@]}"} >"$out/$name.log" 2>&1 || status=$?
        grep -E '^(FAILED|ERROR) ' "$out/$name.log" || true
    done
else
    set +e +o pipefail
    "$python_bin" -m pytest -q -p no:cacheprovider -rfE -o junit_family=xunit1 --junitxml="$out/suite.xml" \
        ${pytest_args[@]+"${pytest_args[@]}"} 2>&1 | tee "$out/suite.log"
    status=${PIPESTATUS[0]}
    set -e -o pipefail
fi
elapsed=$(( $(date +%s) - start ))

"$python_bin" - "$out" "$elapsed" <<'EOF'
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, elapsed = Path(sys.argv[1]), int(sys.argv[2])
counts = collections.defaultdict(collections.Counter)
seconds = collections.Counter()
for report in sorted(out.glob("*.xml")):
    for case in ET.parse(report).iter("testcase"):
        # classname "tests.test_x" or "tests.test_x.TestClass"; a file that failed to import has its
        # path as the name and no class
        parts = (case.get("classname") or case.get("name", "")).replace("/", ".").split(".")
        file = "/".join(parts[:2]).removesuffix(".py") + ".py"
        outcome = ("failed" if case.find("failure") is not None else "errors" if case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        counts[file][outcome] += 1
        seconds[file] += float(case.get("time", 0))
columns = ("passed", "failed", "errors", "skipped")
print(f"\n{'file':34} " + " ".join(f"{c:>7}" for c in columns) + f" {'seconds':>8}")
for file in sorted(counts):
    print(f"{file:34} " + " ".join(f"{counts[file][c]:7d}" for c in columns) + f" {seconds[file]:8.0f}")
total = sum(counts.values(), collections.Counter())
print(f"{'all':34} " + " ".join(f"{total[c]:7d}" for c in columns) + f" {sum(seconds.values()):8.0f}")
print(f"wall time {elapsed // 60} min {elapsed % 60} s; logs and JUnit XML in {out}")
EOF
exit "$status"
