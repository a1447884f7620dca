#!/usr/bin/env bash
# Launch the trainer on every visible GPU through torchrun; with no GPU, one CPU process.
#   ./run.sh                      # the record recipe (needs GPUs and data/cached_fineweb10B.py shards)
#   ./run.sh --preset tiny        # CPU-sized run on synthetic data
#   ./run.sh --num_extra_embeds=2 # any --field=value of the Hyperparameters dataclass
#   NPROC_PER_NODE=4 ./run.sh     # choose the number of processes (GPUs) on this machine (0: one plain process)
#   TRAINER=records/x01_lineage/train_gpt_medium.py ./run.sh --recipe snoo  # another script (path from the repository root)
#   RUNS=10 ./run.sh              # 10 runs one after another, each with its own fresh seed and log, into
#                                 # logs/<run_id or preset>-<date>-<time>/ (or --log_dir); stops at the first
#                                 # failing run (with its exit status) or at Ctrl-C; ends with a summary, the
#                                 # next command and, if runs are missing, the command that continues the batch
#   RUNS=3 ./run.sh --log_dir=logs/<batch> ...   # 3 more runs of that batch; its summary counts all of them
#   RUNS=10 ./run.sh --save_every=500            # each run saves under checkpoints/<batch>/run_<k>/<preset>/step_<N>/
# Multi-node: run the same command on every node with NNODES, NODE_RANK (0 .. NNODES-1) and
# MASTER_ADDR (node 0's address; MASTER_PORT defaults to 29500). World size = NNODES x processes per
# node, and it must divide the step's slices (8 for the record: 1, 2, 4 or 8 GPUs in all).
# The run is run.sh's child, started to receive SIGTERM when run.sh dies (setpriv --pdeathsig, where
# util-linux has it), so even a SIGKILLed run.sh leaves no trainer behind; torchrun ends its workers.
set -euo pipefail
cd "$(dirname "$0")"
# The variables read here that make a run what it is (interpreter, script, world size: processes, GPUs,
# nodes), as the caller set them: a batch's `continue:` line repeats them.
launch_env=()
for var in PYTHON TRAINER NPROC_PER_NODE CUDA_VISIBLE_DEVICES NNODES NODE_RANK MASTER_ADDR MASTER_PORT; do
  if [ -n "${!var+x}" ]; then launch_env+=("$var=${!var}"); fi
done
PYTHON=${PYTHON:-python3}
TRAINER=${TRAINER:-train_gpt_medium.py}
if [ ! -f "$TRAINER" ]; then
  echo "error: TRAINER=$TRAINER: no such script; give its path from the repository root, e.g. TRAINER=records/x01_lineage/train_gpt_medium.py" >&2
  exit 2
fi
# Bad counts are refused before anything starts (set but empty included: it is not a count).
if [ -n "${RUNS+x}" ] && ! [[ "$RUNS" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: RUNS=${RUNS}: give the number of runs as a positive integer, e.g. RUNS=10" >&2
  exit 2
fi
runs=${RUNS:-1}
if [ -n "${NPROC_PER_NODE+x}" ] && ! [[ "$NPROC_PER_NODE" =~ ^(0|[1-9][0-9]*)$ ]]; then
  echo "error: NPROC_PER_NODE=${NPROC_PER_NODE}: give the number of processes on this node as a non-negative" \
       "integer, e.g. NPROC_PER_NODE=8 (0: one process without torchrun)" >&2
  exit 2
fi
if [ -n "${NNODES:-}" ] && ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NNODES=${NNODES}: give the number of nodes as a positive integer, e.g. NNODES=2" >&2
  exit 2
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
fi
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  if [ -z "$CUDA_VISIBLE_DEVICES" ]; then gpus=0; else gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l); fi
fi
nproc=${NPROC_PER_NODE:-$gpus}
nnodes=${NNODES:-1}
# torchrun with the same interpreter as $PYTHON; a signal that stops it (Ctrl-C, run.sh's end) ends
# it with one line instead of its traceback, after it has ended its workers.
torchrun_py='import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    main()
except SignalException as e:
    print(f"torchrun: stopped by {e.sigval.name}; its processes were ended", file=sys.stderr)
    sys.exit(128 + e.sigval)'
torchrun=("$PYTHON" -c "$torchrun_py")

if [ "$nnodes" -gt 1 ]; then
  if [ "$nproc" -eq 0 ]; then
    echo "error: NNODES=$NNODES but no GPU is visible on this node; set NPROC_PER_NODE (CPU processes use gloo)" >&2
    exit 2
  fi
  cmd=("${torchrun[@]}" --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK on every node}"
       --nproc_per_node="$nproc" --master_addr="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
       --master_port="${MASTER_PORT:-29500}" "$TRAINER")
elif [ "$nproc" -eq 0 ]; then
  cmd=("$PYTHON" "$TRAINER")
else
  cmd=("${torchrun[@]}" --standalone --nproc_per_node="$nproc" "$TRAINER")
fi

# Several processes: the flags and the world size are checked once here, with the trainer's own
# messages, before torchrun starts (the ranks' refusals can be lost when torchrun stops the others).
# Only for a trainer of this project's kind (it defines parse_args and check_world_size, and importing
# it runs nothing); a script of another kind (upstream's record scripts train as they are imported)
# is not imported here: its ranks check their own input.
world=$((nnodes * nproc))
if [ "$world" -gt 1 ] && grep -q '^def parse_args(' "$TRAINER" && grep -q '^def check_world_size(' "$TRAINER"; then
  "$PYTHON" -c 'import contextlib, importlib.util, io, sys
spec = importlib.util.spec_from_file_location("trainer", sys.argv[2])
t = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = t  # dataclasses look their module up there while the file runs
spec.loader.exec_module(t)
argv = sys.argv[3:]
try:
    if "-h" not in argv and "--help" not in argv:
        with contextlib.redirect_stderr(io.StringIO()):  # warnings: the ranks will give them
            config = t.parse_args(argv)
        if not config.dry_run:
            t.check_world_size(config, int(sys.argv[1]))
except t.InputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)' "$world" "$TRAINER" "$@" || exit $?
fi

# The run is a child that gets SIGTERM when run.sh dies, whatever killed run.sh (SIGKILL cannot be
# trapped); torchrun answers SIGTERM by ending its workers. Without setpriv's --pdeathsig a single
# run replaces run.sh as before, and a batch says what is not covered.
launch=() pdeathsig=""
if setpriv --pdeathsig TERM true >/dev/null 2>&1; then
  launch=(setpriv --pdeathsig TERM --) pdeathsig=1
fi

if [ -z "${RUNS+x}" ]; then
  if [ -z "$pdeathsig" ]; then
    exec "${cmd[@]}" "$@"
  fi
  status=0
  "${launch[@]}" "${cmd[@]}" "$@" || status=$?
  exit "$status"
fi

# ---- repeated runs: a record is a claim over several runs, each with a seed the trainer draws afresh.
# RUNS=N gives the batch a log folder of its own (unless --log_dir is given) and ends with a summary
# of its runs and the records/stats.py command that tests them. A folder marked by an earlier batch
# continues that batch: its summary counts the runs already there.
log_dir="" preset=medium name="" prev="" ck_root=checkpoints save_every="" resume=""
args=()  # the user's flags without --checkpoint_dir, when every run gets a checkpoint folder of its own
for arg in "$@"; do
  case "$prev" in
    --log_dir) log_dir=$arg ;; --preset) preset=$arg ;; --run_id) name=$arg ;;
    --checkpoint_dir) ck_root=$arg ;; --save_every) save_every=$arg ;; --resume) resume=$arg ;;
  esac
  case "$arg" in
    --log_dir=*) log_dir=${arg#*=} ;; --preset=*) preset=${arg#*=} ;; --run_id=*) name=${arg#*=} ;;
    --checkpoint_dir=*) ck_root=${arg#*=} ;; --save_every=*) save_every=${arg#*=} ;; --resume=*) resume=${arg#*=} ;;
    --seed|--seed=*)
      echo "warning: RUNS=$runs with $arg: every run gets the same seed, so the runs are not independent" >&2 ;;
  esac
  if [ "$arg" != --checkpoint_dir ] && [ "$prev" != --checkpoint_dir ] && [[ "$arg" != --checkpoint_dir=* ]]; then
    args+=("$arg")
  fi
  prev=$arg
done
# the command that adds runs to this batch (printed with RUNS=<missing>)
again=(${launch_env[@]+"${launch_env[@]}"} ./run.sh "$@")
extra=()  # after the user's flags
if [ -z "$log_dir" ]; then
  log_dir="logs/${name:-$preset}-$(date +%Y%m%d-%H%M%S)"
  base=$log_dir k=2
  while [ -e "$log_dir" ]; do log_dir="$base-$k"; k=$((k + 1)); done
  extra+=("--log_dir=$log_dir")
  again+=("--log_dir=$log_dir")
fi
# Checkpoints of a batch: one folder per run, <checkpoint_dir>/<batch folder's name>/run_<k>/ (its checkpoints
# in <run_id or preset>/step_<N>/ there, as every run's; k counts
# the batch's logs), so no run refuses to save next to another's. A --resume is the user's to place.
per_run=""
if [[ -n "$save_every" && ! "$save_every" =~ ^0+$ && -z "$resume" ]]; then
  per_run=1
fi
start=${EPOCHREALTIME:-$(date +%s)}  # to the microsecond where bash has it: calls can follow within a second
start=${start/,/.}
marker="$log_dir/.run.sh-batch"  # the batch's first start, seconds since the epoch
since=$start done_before=0
if [ -f "$marker" ] && read -r since <"$marker" && [[ "$since" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  shopt -s nullglob
  logs=("$log_dir"/*.txt)
  shopt -u nullglob
  done_before=${#logs[@]}
  echo "run.sh: $runs run(s) into $log_dir/ (continuing its batch: $done_before log(s) there)" >&2
else
  since=$start
  echo "run.sh: $runs run(s) into $log_dir/" >&2
fi
mark_batch() {  # once the folder exists: the marker, unless it has one
  if [ -d "$log_dir" ] && [ ! -e "$marker" ]; then echo "$since" >"$marker" || true; fi
}
if [ -z "$pdeathsig" ]; then
  echo "run.sh: note: no setpriv --pdeathsig (util-linux) here: if run.sh is killed, its run goes on" >&2
fi
interrupted=0
trap 'interrupted=1' INT  # Ctrl-C: the run stops (the trainer says so in a line), then the batch does
status=0
mark_batch
for ((i = 1; i <= runs; i++)); do
  if [ "$interrupted" -ne 0 ]; then  # Ctrl-C between two runs
    status=130
    echo "run.sh: interrupted; not starting the remaining $((runs - i + 1))" >&2
    break
  fi
  run_cmd=("${cmd[@]}" "$@" ${extra[@]+"${extra[@]}"})
  if [ -n "$per_run" ]; then
    batch=$(basename "$log_dir") k=$((done_before + i))
    while [ -e "$ck_root/$batch/run_$k" ]; do k=$((k + 1)); done
    run_cmd=("${cmd[@]}" ${args[@]+"${args[@]}"} ${extra[@]+"${extra[@]}"} "--checkpoint_dir=$ck_root/$batch/run_$k")
    echo "run.sh: starting run $i of $runs (checkpoints: $ck_root/$batch/run_$k/)" >&2
  else
    echo "run.sh: starting run $i of $runs" >&2
  fi
  ${launch[@]+"${launch[@]}"} "${run_cmd[@]}" || status=$?
  mark_batch
  if [ "$interrupted" -ne 0 ]; then
    status=130
    echo "run.sh: interrupted in run $i of $runs; not starting the remaining $((runs - i))" >&2
    break
  fi
  if [ "$status" -ne 0 ]; then
    echo "run.sh: run $i of $runs failed with exit status $status; not starting the remaining $((runs - i))" >&2
    break
  fi
done
[ "$status" -eq 0 ] && echo "run.sh: all $runs runs finished" >&2
trap '' INT  # the summary is the batch's last word: a second Ctrl-C does not cut it
echo >&2
again_text=$(printf '%q ' "${again[@]}")
"$PYTHON" records/summary.py "$log_dir" --since "$since" --asked "$runs" --asked-at "$start" \
  --again "${again_text% }" || true
exit "$status"
