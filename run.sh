#!/usr/bin/env bash
# Launch the trainer on every visible GPU through torchrun; with no GPU, one CPU process.
#   ./run.sh                      # the record recipe (needs GPUs and data/cached_fineweb10B.py shards)
#   ./run.sh --preset tiny        # CPU-sized run on synthetic data
#   ./run.sh --num_extra_embeds=2 # any --field=value of the Hyperparameters dataclass
#   NPROC_PER_NODE=4 ./run.sh     # choose the number of processes (GPUs) on this machine
#   TRAINER=records/x01_lineage/train_gpt_medium.py ./run.sh --recipe snoo  # another script (path from the repository root)
#   RUNS=10 ./run.sh              # 10 runs one after another, each with its own fresh seed and log, into
#                                 # logs/<run_id or preset>-<date>-<time>/ (or --log_dir); stops at the first
#                                 # failing run (with its exit status); ends with a summary and the next command
# Multi-node: run the same command on every node with NNODES, NODE_RANK (0 .. NNODES-1) and
# MASTER_ADDR (node 0's address; MASTER_PORT defaults to 29500). World size = NNODES x processes per
# node, and it must divide the step's slices (8 for the record: 1, 2, 4 or 8 GPUs in all).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
TRAINER=${TRAINER:-train_gpt_medium.py}
if [ ! -f "$TRAINER" ]; then
  echo "error: TRAINER=$TRAINER: no such script; give its path from the repository root, e.g. TRAINER=records/x01_lineage/train_gpt_medium.py" >&2
  exit 2
fi
runs=${RUNS:-1}
if ! [[ "$runs" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: RUNS=$runs: give the number of runs as a positive integer, e.g. RUNS=10" >&2
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
torchrun=("$PYTHON" -m torch.distributed.run)  # torchrun, with the same interpreter as $PYTHON

if [ -n "${NNODES:-}" ] && [ "${NNODES}" -gt 1 ]; then
  if [ "$nproc" -eq 0 ]; then
    echo "error: NNODES=$NNODES but no GPU is visible on this node; set NPROC_PER_NODE (CPU processes use gloo)" >&2
    exit 2
  fi
  cmd=("${torchrun[@]}" --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK on every node}"
       --nproc_per_node="$nproc" --master_addr="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
       --master_port="${MASTER_PORT:-29500}" "$TRAINER" "$@")
elif [ "$nproc" -eq 0 ]; then
  cmd=("$PYTHON" "$TRAINER" "$@")
else
  cmd=("${torchrun[@]}" --standalone --nproc_per_node="$nproc" "$TRAINER" "$@")
fi

# ---- repeated runs: a record is a claim over several runs, each with a seed the trainer draws afresh.
# RUNS=N gives the batch a log folder of its own (unless --log_dir is given) and ends with a summary
# of its runs and the records/stats.py command that tests them.
if [ -z "${RUNS+x}" ]; then
  exec "${cmd[@]}"
fi
log_dir="" preset=medium name="" prev=""
for arg in "$@"; do
  case "$prev" in
    --log_dir) log_dir=$arg ;; --preset) preset=$arg ;; --run_id) name=$arg ;;
  esac
  case "$arg" in
    --log_dir=*) log_dir=${arg#*=} ;; --preset=*) preset=${arg#*=} ;; --run_id=*) name=${arg#*=} ;;
    --seed|--seed=*)
      echo "warning: RUNS=$runs with $arg: every run gets the same seed, so the runs are not independent" >&2 ;;
  esac
  prev=$arg
done
if [ -z "$log_dir" ]; then
  log_dir="logs/${name:-$preset}-$(date +%Y%m%d-%H%M%S)"
  base=$log_dir k=2
  while [ -e "$log_dir" ]; do log_dir="$base-$k"; k=$((k + 1)); done
  cmd+=("--log_dir=$log_dir")
fi
echo "run.sh: $runs run(s) into $log_dir/" >&2
start=$(date +%s)
status=0
for ((i = 1; i <= runs; i++)); do
  echo "run.sh: starting run $i of $runs" >&2
  "${cmd[@]}" || status=$?
  if [ "$status" -ne 0 ]; then
    echo "run.sh: run $i of $runs failed with exit status $status; not starting the remaining $((runs - i))" >&2
    break
  fi
done
[ "$status" -eq 0 ] && echo "run.sh: all $runs runs finished" >&2
echo >&2
"$PYTHON" records/summary.py "$log_dir" --since "$start" --asked "$runs" || true
exit "$status"
