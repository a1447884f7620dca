#!/usr/bin/env bash
# Launch the trainer on every visible GPU through torchrun; with no GPU, one CPU process.
#   ./run.sh                      # the record recipe (needs GPUs and data/cached_fineweb10B.py shards)
#   ./run.sh --preset tiny        # CPU-sized run on synthetic data
#   ./run.sh --num_extra_embeds=2 # any --field=value of the Hyperparameters dataclass
#   NPROC_PER_NODE=4 ./run.sh     # choose the number of processes (GPUs) on this machine
# Multi-node: run the same command on every node with NNODES, NODE_RANK (0 .. NNODES-1) and
# MASTER_ADDR (node 0's address; MASTER_PORT defaults to 29500). World size = NNODES x processes per
# node, and it must divide the step's slices (8 for the record: 1, 2, 4 or 8 GPUs in all).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

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
  exec "${torchrun[@]}" --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK on every node}" \
    --nproc_per_node="$nproc" --master_addr="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" \
    --master_port="${MASTER_PORT:-29500}" train_gpt_medium.py "$@"
fi
if [ "$nproc" -eq 0 ]; then
  exec "$PYTHON" train_gpt_medium.py "$@"
fi
exec "${torchrun[@]}" --standalone --nproc_per_node="$nproc" train_gpt_medium.py "$@"
