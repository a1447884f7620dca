"""GPT-2 Medium speedrun trainer: the current record (2025-12-31, 1041 s on 8xH100) in one script, its
device kernels beside it in triton_kernels.py (as upstream keeps its own).

    torchrun --standalone --nproc_per_node=8 train_gpt_medium.py      # the record (or ./run.sh)
    python train_gpt_medium.py --preset tiny                          # CPU, about a minute
    python train_gpt_medium.py --help                                 # every flag, grouped
    python train_gpt_medium.py --dry_run                              # counts, FLOPs, memory, optimizer table
    python train_gpt_medium.py --bench_steps=10                       # time training steps (docs/gpu.md)

Map of the file, a book in three parts.
Part I, the record (bulk), in the order data flows; what a record's diff touches:
  1. Hyperparameters   the record's values as a table, each of its ideas a switch; the claims'
                       fields in one labelled block
  2. Schedules         the step grid: batch ramp, lr, Muon momentum, windows, YaRN, multi-token
                       weights, the embedding split
  3. Optimizers        Muon (NorMuon with Polar Express, sharded) and the cautious Adam
  4. Model             parameters (declare); rotary and YaRN; masks and the attention backends;
                       attention, MLP, block; value embeddings, smear, backout; head and loss;
                       GPT; initialization and optimizer groups
  5. Data              token shards and the loaders
  6. Training          optimizers, one step, evaluation, warm-up, the timed loop
  7. main
  A claim after the record appears here only as a marked seam (`# §10 --mudd`).
Part II, beyond the record: one chapter per claim, what its PR adds (its modules, its config rule):
  8. PR #248 fp8_yarn   the FP8 head product, the transposed head
  9. PR #252 bigram     the bigram table and its exchange, the fused loss, #252's optimizer pieces
  10. PR #261 mudd      the MUDD nets and the last block's forward
  11. The seed ideas    LoRE, the value-embedding basis
Part III, machinery, below main (off in a record run's numbers): the command line and its checks,
the presets and recipes, run setup (run_training; the data a run reads, load_data; the GPU guard:
gpu_properties, check_gpu; FlexAttention's mask block on CUDA: flex_mask_block), the log (with the
console's ETA, how a run ended), checkpoints, accounting and the dry
run (with the peak model, its table of what fits, and the collectives counted: CountedCollectives),
the benchmark, the shard writer, the after-run hooks.

The earlier records (x01 .. smear, 2025-09 .. 2025-11) run from their frozen script,
records/x01_lineage/train_gpt_medium.py. Importing this module has no side effects; everything
runs inside `main(argv)`.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import difflib
import errno
import functools
import glob
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple, Optional

# The process that started this one (torchrun, for a worker), read when run as a script before torch's
# import, which takes seconds: a launcher killed during them is noticed too (StopRequests). Importing
# the module reads nothing.
PARENT_AT_START = os.getppid() if __name__ == "__main__" else None

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

def _kernels_beside_this_file():
    """triton_kernels.py from this file's folder, imported once (sys.modules["triton_kernels"]): the
    kernels this script was written with, however it was started (python path/to/it, runpy, a record
    folder's copy loaded by path). A copy from another folder already imported keeps its name, and
    this one is loaded beside it."""
    import importlib.util
    path = Path(__file__).resolve().with_name("triton_kernels.py")
    known = sys.modules.get("triton_kernels")
    if known is not None and Path(getattr(known, "__file__", "")).resolve() == path:
        return known
    spec = importlib.util.spec_from_file_location("triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if known is None:
        sys.modules["triton_kernels"] = module
    return module


kernels = _kernels_beside_this_file()  # the device's numerics (upstream's triton_kernels.py)


# #############################################################################
# Part I. The record (bulk, 2025-12-31): what ./run.sh runs, in the order data flows
# #############################################################################

# =============================================================================
# 1. Hyperparameters: the defaults ARE the record recipe (docs/bulk.md)
#
# One line per flag: type, record default, meaning, allowed values. Each flag's group says what
# changing it does, and so where `--help` lists it, what a resumed checkpoint must match and what
# makes two runs the same experiment (the log writes every field's group; records/ reads it).

def _flag(group: str):
    # counts_steps: a recipe value that is a number of training steps (or a step), so a run of another
    # length scales it (with_num_iterations); tools that shorten a run read this, never a list of names.
    # needs: the switches (fields) of which one must be on for this value to act; a run given another
    # value without them says so (inert_setting_notes).
    # peak_neutral: a value other than the record's changes neither the shapes of what is held nor how it
    # is computed, or its memory is accounted for (predicted_peak_mib): the dry run still predicts a peak
    def make(default, meaning: str, *, choices=None, at_least=None, above=None, at_most=None, below=None,
             counts_steps=False, needs=(), peak_neutral=False):
        return field(default=default, metadata=dict(group=group, meaning=meaning, choices=choices, at_least=at_least,
                                                     above=above, at_most=at_most, below=below,
                                                     counts_steps=counts_steps, needs=needs,
                                                     peak_neutral=peak_neutral))
    return make


# recipe and seed ideas change what a run computes; execution changes how (device, kernels,
# memory) or on which data, and so its time; bookkeeping changes neither (names, seeds, outputs).
recipe, idea = _flag("recipe"), _flag("seed ideas")
execution, bookkeeping = _flag("execution"), _flag("bookkeeping")
TRAINING_GROUPS = ("recipe", "seed ideas")  # a resumed checkpoint must match these
EXPERIMENT_GROUPS = ("recipe", "seed ideas", "execution")  # runs that agree on these are one experiment


LR_LIMIT = 1.0  # no learning rate of this model trains above it: every record's is 0.5 or less
# --prefix_loss_weight: #337's is 0.25; past a few the prefix term swamps the next-token loss (1e30 trains to
# nothing, 1e39 overflows fp32)
PREFIX_WEIGHT_LIMIT = 10.0


@dataclass
class Hyperparameters:
    # ---- data and batch (docs/bulk-data.md). The step grid's batch ramp is below, with the schedules
    batch_slices: int = recipe(8, "slices of train_seq_len tokens per step; each rank takes batch_slices / world size",
                               at_least=1)
    train_seq_len: int = recipe(64 * 1024, "tokens per training slice at the full batch (a multiple of "
                                "attn_block_size); the batch ramp's smaller steps take fewer", at_least=1)
    val_seq_len: int = recipe(256 * 1024, "tokens per validation slice (a multiple of attn_block_size)", at_least=1)
    val_tokens: int = recipe(10_485_760, "validation tokens, from the start of the validation shard", at_least=1,
                             peak_neutral=True)
    vocab_size: int = recipe(50257, "vocabulary (GPT-2); tables and head are padded to a multiple of 128",
                             at_least=2, at_most=65536)
    eot_token: int = recipe(50256, "end-of-text token: starts a new document in the masks", at_least=0,
                            peak_neutral=True)
    document_aligned_batches: bool = recipe(True, "each training slice is whole documents from their start, each "
                                            "cut at document_cut_tokens, the slice's last one cut to fit (off: "
                                            "contiguous slices)")
    document_cut_tokens: int = recipe(4096, "with document_aligned_batches: a document longer than this keeps only "
                                      "its first N tokens", at_least=1, needs=("document_aligned_batches",))
    # ---- model (docs/bulk-model.md)
    model_dim: int = recipe(1024, "width of the residual stream", at_least=1)
    num_layers: int = recipe(16, "transformer blocks", at_least=1)
    num_heads: int = recipe(8, "attention heads", at_least=1)
    head_dim: int = recipe(128, "width of one head (a multiple of 4: half-truncated rotary)", at_least=4)
    mlp_ratio: int = recipe(4, "MLP hidden width / model_dim", at_least=1)
    value_embed_layout: tuple[Optional[int], ...] = recipe(
        (0, 1, 2, 3, 4, None, None, None, None, None, None, 0, 1, 2, 3, 4),
        "value-embedding table of each layer, '-' for none (the record: 012..012)")
    skip_connections: tuple[tuple[int, int], ...] = recipe(
        ((9, 6), (10, 4), (11, 2)), "(target, source): before block target add the skip's weight x output of source")
    attention_free_layers: tuple[int, ...] = recipe((), "blocks with an MLP only (x01: 7)")
    long_window_layers: tuple[int, ...] = recipe((0, 4, 11, 15), "blocks with the long window; the others use "
                                                 "the short one")
    attn_block_size: int = recipe(128, "mask block size in tokens (windows count blocks of it)", at_least=1)
    max_window_tokens: int = recipe(3456, "the long window of the final validation, in tokens", at_least=1)
    attn_scale: float = recipe(0.1, "attention softmax scale at step 0 (not 1/sqrt(head_dim)); YaRN raises it",
                               above=0, peak_neutral=True)
    rope_base: float = recipe(1024.0, "rotary base: frequencies (1/base)^linspace(0, 1, head_dim/4)", above=0,
                              peak_neutral=True)
    dtype: str = recipe("auto", "weights and activations: auto = bfloat16 on CUDA, float32 on CPU",
                        choices=("auto", "bfloat16", "float32"))
    # the record's ideas (2025-12-31), each a switch: off removes that one idea from the record
    yarn_window_limit: int = recipe(13, "YaRN: each time the long window changes to at most this many blocks, "
                                    "stretch the rotary frequencies and raise the attention scale; 0: off", at_least=0,
                                    peak_neutral=True)
    rotary_bf16: bool = recipe(True, "rotary cos/sin tables stored in bfloat16 and the rotation done in the "
                               "activations' dtype (off: fp32 tables and rotation)")
    key_offset: bool = recipe(True, "long-window layers: each key's non-rotating dims are those of the previous "
                              "position (one-layer induction)")
    qkv_init_std: float = recipe(1.0, "q, k, v weights start uniform with std qkv_init_std/sqrt(model_dim) (x01: 0.5)",
                                 above=0)
    attn_output_gate: bool = recipe(True, "each head's output times sigmoid(G norm(x)[:16]), G zero at the start "
                                    "(so halved)")
    value_embed_gate: bool = recipe(True, "the value embedding enters v times 2 sigmoid(G norm(x)[:16]) per head "
                                    "(1 at the start; off: added as it is)")
    value_embed_zero_init: bool = recipe(True, "value-embedding tables start at zero (off: N(0, 1))")
    residual_scale_init: float = recipe(1.05, "initial weight of the residual stream at each block's input")
    gated_skips: bool = recipe(True, "U-net skips weighted sigmoid(k) x 2 sigmoid(g x00[:16]), k from -1.5, g from "
                               "zero (off: one learned weight from 1)")
    untie_embed_after_step: Optional[int] = recipe(
        None, "s > 0: the head matrix (N(0, 0.005^2), model dtype) is also the input embedding until the update of "
        "step s, which copies it and its optimizer state into the input embedding; auto: the odd step after a sixth "
        "of the scheduled steps (785 for the record), following --num_iterations; 0: separate tables from the start",
        at_least=0, counts_steps=True)
    smear_embed: bool = recipe(True, "each input-embedding row adds lambda x sigmoid(g e[:16]) x the previous row "
                               "(lambda from 0)")
    backout: bool = recipe(True, "head input norm(h - lambda h_b) from the last block's output h and backout_layer's "
                           "output h_b, lambda learned from 0.5 (off: norm(h))", peak_neutral=True)
    backout_layer: int = recipe(11, "the block whose output backout subtracts (with --mudd: h_b of its mixes)",
                                at_least=0, needs=("backout", "mudd"), peak_neutral=True)
    mlp_proj_transposed: bool = recipe(True, "MLP output weight stored (hidden, model_dim) and used transposed; lr "
                                       "multiplier 2")
    logit_softcap_form: str = recipe("sigmoid", "sigmoid: 23 sigmoid((z+5)/7.5), in the model dtype when training, "
                                     "fp32 when evaluating; rational: cap z/sqrt(z^2+cap^2) in fp32",
                                     choices=("rational", "sigmoid"))
    logit_softcap: float = recipe(15.0, "the rational cap's cap", above=0, peak_neutral=True)
    multi_token_prediction: bool = recipe(True, "training loss over the next 3, then 2, then 1 tokens per position, "
                                          "weighted by the step grid's multi-token schedule (mtp_weights)")
    train_loss_reduction: str = recipe("sum", "training loss over a slice's tokens (validation is a mean)",
                                       choices=("mean", "sum"))
    pad_vocab_tables: bool = recipe(True, "input and value-embedding tables padded to a multiple of 128 rows, as "
                                    "the head is")
    scalar_pad_multiple: int = recipe(8, "scalar vector padded with unused ones to a multiple of this (the "
                                      "record's GPU count)", at_least=1)
    fp32_block_weights: bool = recipe(True, "attention and MLP matrices stored in fp32 (the optimizer's master) and "
                                      "rounded to the model dtype where used (off: stored in the model dtype, Muon "
                                      "keeping the low 16 bits of a bf16 weight's fp32 master)", peak_neutral=True)
    table_multipliers: bool = recipe(True, "the record's lr and weight-decay multipliers of the tables, head and "
                                     "scalars: second input table and value embeddings lr x75 wd x5, head and input "
                                     "table wd x150, scalars lr x5 and no decay (off: 1)")
    # ---- the step grid (docs/bulk-data.md). Its schedules span the scheduled steps S = num_iterations -
    # extension_steps; a schedule tuple of n entries cuts S into n slots, slot = floor(n * step / S).
    num_iterations: int = recipe(4740, "training steps", at_least=1, peak_neutral=True)
    extension_steps: int = recipe(40, "steps at the end of num_iterations past the step grid's schedules (which span "
                                  "S = num_iterations - N steps): lr at the floor, the last slot's batch and windows",
                                  at_least=0, counts_steps=True, peak_neutral=True)
    batch_schedule: tuple[int, ...] = recipe(
        (131072, 262144, 393216) + (524288,) * 9, "tokens per step in each slot of the step grid (n entries: slot = "
        "floor(n * step / S)), multiples of batch_slices*attn_block_size; empty: batch_slices*train_seq_len every step")
    lr_peaks: tuple[float, ...] = recipe((1.0, 1.52, 1.73) + (2.0,) * 9,
                                         "lr multiplier of each slot of the step grid (slot k's once step/S > k/n), "
                                         "falling linearly over the last cooldown_frac of S to the lr floor")
    cooldown_frac: float = recipe(0.7, "fraction of S over which the lr falls linearly to lr_floor", at_least=0,
                                  at_most=1, peak_neutral=True)
    lr_floor: float = recipe(0.1, "the lr multiplier at the end of the cooldown and in the extension", at_least=0,
                             at_most=1, peak_neutral=True)
    window_schedule: tuple[int, ...] = recipe((3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23),
                                              "long window in blocks in each slot of the step grid, the short one "
                                              "min(11, long // 2); the final validation's long window is "
                                              "max_window_tokens")
    # ---- optimizers (docs/bulk-optimizers.md): Adam for tables, head and scalars; NorMuon for matrices
    head_lr: float = recipe(0.004, "Adam lr of the output head", at_least=0, at_most=LR_LIMIT, peak_neutral=True)
    embed_lr: float = recipe(0.004, "Adam lr of the input and value embeddings", at_least=0, at_most=LR_LIMIT,
                             peak_neutral=True)
    scalar_lr: float = recipe(0.008, "Adam lr of the scalar vector (residual and attention weights, skip gains)",
                              at_least=0, at_most=LR_LIMIT, peak_neutral=True)
    x0_lambdas_lr: float = recipe(0.004, "Adam lr of the per-layer input-embedding weights", at_least=0,
                                  at_most=LR_LIMIT)
    gates_lr: float = recipe(0.004, "Adam lr of the smear and skip gates", at_least=0, at_most=LR_LIMIT)
    adam_beta1: float = recipe(0.8, "Adam beta1", at_least=0, below=1, peak_neutral=True)
    adam_beta2: float = recipe(0.95, "Adam beta2", at_least=0, below=1, peak_neutral=True)
    scalar_adam_beta1: Optional[float] = recipe(0.9, "Adam beta1 of the scalar group (auto: adam_beta1)",
                                                at_least=0, below=1)
    scalar_adam_beta2: Optional[float] = recipe(0.99, "Adam beta2 of the scalar group (auto: adam_beta2)",
                                                at_least=0, below=1)
    adam_eps: float = recipe(1e-8, "Adam epsilon, added to sqrt(v) before the bias correction", above=0,
                             peak_neutral=True)
    adam_weight_decay: float = recipe(0.005, "Adam's cautious weight decay, adam_weight_decay * lr^2 (times each "
                                      "weight's wd_mul) where update and weight agree in sign", at_least=0)
    adam_odd_steps_only: bool = recipe(True, "Adam steps on odd steps only, on the summed gradients of the step "
                                       "before and its own (Muon steps every step)")
    muon_lr: float = recipe(0.015, "Muon lr (times the shape factor sqrt(max(1, rows/cols)))", at_least=0,
                            at_most=LR_LIMIT, peak_neutral=True)
    muon_momentum: float = recipe(0.95, "Muon momentum after the warm-up", at_least=0, below=1, peak_neutral=True)
    muon_momentum_start: float = recipe(0.85, "Muon momentum at step 0", at_least=0, below=1, peak_neutral=True)
    muon_momentum_warmup_steps: int = recipe(300, "steps of the linear momentum warm-up", at_least=0,
                                             counts_steps=True, peak_neutral=True)
    muon_momentum_cooldown_steps: int = recipe(50, "the Muon momentum falls linearly from muon_momentum toward "
                                               "muon_momentum_start over the last N steps; 0: no cool-down", at_least=0,
                                               counts_steps=True)
    muon_weight_decay: float = recipe(1.2, "Muon weight decay (cautious: times lr * lr_eff; else w *= 1 - lr*wd*mul)",
                                      at_least=0, peak_neutral=True)
    mlp_weight_decay_mul: float = recipe(1.0, "weight decay multiplier of the MLP matrices (x01: 2)", at_least=0,
                                         peak_neutral=True)
    orthogonalization: str = recipe("polar_express", "Muon's orthogonalization: polar_express (5 steps with their own "
                                    "coefficients on G/(1.02|G| + 1e-6), always in bf16) or newton_schulz (5 fixed "
                                    "quintic steps on G/|G|)", choices=("newton_schulz", "polar_express"))
    muon_row_normalization: bool = recipe(True, "NorMuon: scale each row of the orthogonalized update by 1/sqrt of a "
                                          "running mean of its mean square, then restore the update's Frobenius norm")
    muon_row_beta2: float = recipe(0.95, "NorMuon: decay of the running row mean square", at_least=0, below=1)
    muon_cautious_weight_decay: bool = recipe(True, "Muon decays only where update and weight agree in sign (or one is "
                                              "0), by muon_weight_decay * lr * lr_eff: quadratic in the lr schedule "
                                              "(off: w *= 1 - lr*wd everywhere)")
    muon_lr_shape: str = recipe("stored", "Muon's lr factor sqrt(max(1, rows/cols)) from the matrix as stored, leading "
                                "dims counted as rows (attention 2), or from each orthogonalized block (attention 1, "
                                "MLP in 2, MLP out 1)", choices=("blocks", "stored"), peak_neutral=True)
    # ---- the claims after bulk (Part II, docs/frontier.md): each a switch, off in the record; their
    # recipes set them
    # §8 PR #248 (fp8_yarn, docs/fp8-yarn.md): the head's product in FP8, the head stored transposed
    fp8: bool = recipe(False, "the head's training product from FP8 codes: e4m3 h/s_x and H/s_w, e5m2 gradient "
                       "G/s_g (docs/fp8-yarn.md)", peak_neutral=True)
    fp8_ranges: tuple[float, ...] = recipe((100.0, 1.6, 0.75), "with --fp8: 448 x (s_x, s_w, s_g), the |h| and |H| "
                                           "that fill e4m3's range and the gradient's numerator", needs=("fp8",),
                                           peak_neutral=True)
    head_transposed: bool = recipe(False, "the head stored (model_dim, padded vocab) and used as x @ H: the exact "
                                   "transpose, the same init", peak_neutral=True)
    # §9 PR #252 (bigram, docs/bigram.md, docs/fused-ce.md, docs/unified-optimizer.md): the bigram hash table,
    # the fused loss, each change of its optimizer table
    bigram_embed: bool = recipe(False, "each block's input adds gamma_i x a zero-init table row picked by a hash "
                                "of the token pair (docs/bigram.md)", peak_neutral=True)
    bigram_table_multiple: float = recipe(5.0, "with --bigram_embed: the hash table's rows, floor(N x the vocabulary "
                                          "table's), 2 or more (5 x 50304 = 251,520; #315: 7.5)", above=0,
                                          needs=("bigram_embed",), peak_neutral=True)
    bigram_lambda_init: float = recipe(0.05, "with --bigram_embed: every layer's gamma at the start",
                                       needs=("bigram_embed",), peak_neutral=True)
    fused_softcap_ce: bool = recipe(False, "the training loss as one op from the head's input and weight, in fp32 "
                                    "(CUDA: Triton; docs/fused-ce.md)", peak_neutral=True)
    gates_optimizer: str = recipe("muon", "the attention output and value-embedding gates: muon (group muon_gates) "
                                  "or adam (#252: gates, lr x0.1)", choices=("adam", "muon"), peak_neutral=True)
    small_params_betas: str = recipe("adam", "Adam betas of the x0 weights and Adam's gates: adam_beta1/2, or "
                                     "scalar: scalar_adam_beta1/2 (#252)", choices=("adam", "scalar"),
                                     peak_neutral=True)
    muon_scalar_rounding: str = recipe("bulk", "Muon's per-step fp32 factors: bulk (the record's fp32 products) or "
                                       "pr252 (rounded once from float64)", choices=("bulk", "pr252"),
                                       peak_neutral=True)
    adam_fp32_moments: bool = recipe(False, "Adam's moments and step in fp32 for every weight, rounded once to its "
                                     "dtype (#252; off: the weight's)", peak_neutral=True)
    # §10 PR #261 (mudd, docs/mudd.md): attention from block N, the MUDD nets, its loss variant
    attn_input_from_layer: Optional[int] = recipe(
        None, "the blocks after block N attend from norm(block N's output) instead of norm(x) (#261: 11); auto: "
        "off", at_least=0, peak_neutral=True)
    mudd: bool = recipe(False, "MUDD's two nets (#261, docs/mudd.md): after block L-2 they set the last block's "
                        "input, v and weights, after it the head's input", peak_neutral=True)
    mudd_nets: str = recipe("both", "with --mudd: which of its nets run, to ablate each alone (docs/mudd.md)",
                            choices=("both", "penultimate", "final"), needs=("mudd",), peak_neutral=True)
    mudd_lr: float = recipe(0.004, "with --mudd: Adam lr of its weights, x0.25 (betas 0.9/0.99; decay on the two "
                            "matrices only)", at_least=0, at_most=LR_LIMIT, needs=("mudd",), peak_neutral=True)
    fused_ce_variant: str = recipe("pr252", "with --fused_softcap_ce: pr252 or pr261, the numerics of PR #261's "
                                   "kernel (docs/fused-ce.md)", choices=("pr252", "pr261"),
                                   needs=("fused_softcap_ce",), peak_neutral=True)
    # ---- the short track since MUDD (Part II, sections 12-18, docs/short-track-transfer.md): candidates for
    # the next record, each a switch, off here; --recipe transfer sets them. No claim, no GPU run yet
    # §12 #264/#317 learnable XSA
    xsa_layers: tuple[int, ...] = recipe((), "blocks whose attention output loses tanh(alpha) of its component along "
                                         "v, one alpha per head from 0 (#264)", peak_neutral=True)
    xsa_lr: float = recipe(0.004, "with --xsa_layers: Adam lr of the alphas (betas 0.9/0.95, no decay)", at_least=0,
                           at_most=LR_LIMIT, needs=("xsa_layers",), peak_neutral=True)
    # §13 #253 Q and K orthogonalized per head group
    muon_qk_group_heads: int = recipe(0, "Muon orthogonalizes Q and K in row blocks of N heads each (#253: 2), each "
                                      "with its own row statistic; 0: whole", at_least=0, peak_neutral=True)
    # §14 #299 sign rows on the bigram table
    bigram_sign_rows: int = recipe(0, "with --bigram_embed: each bigram row times row (previous XOR current token) "
                                   "mod N of a fixed random +-1 table (#299: 8192); 0: off", at_least=0,
                                   needs=("bigram_embed",), peak_neutral=True)
    # §15 #322 the MLP backward from relu(pre)^2
    mlp_backward_from_post: bool = recipe(False, "the MLP keeps relu(pre)^2 only and takes relu(pre) as its square "
                                          "root in the backward (#322)", peak_neutral=True)
    # §16 #337 prefix token prediction
    prefix_loss_weight: float = recipe(0.0, "training loss adds w x the cross-entropy of the next token's longest "
                                       "byte-prefix token, w from the multi-token phases (#337: 0.25)", at_least=0,
                                       at_most=PREFIX_WEIGHT_LIMIT, peak_neutral=True)
    # §17 #306/#342 the MLP products in FP8
    fp8_mlp_up: bool = recipe(False, "training's MLP input projection from e4m3 codes, per-tensor scales max|W|/448 "
                              "and max|x|/448, bf16 backward (#306)", peak_neutral=True)
    fp8_mlp_down: bool = recipe(False, "training's MLP output projection from e4m3 codes, delayed scales: max post "
                                "x1.80 (per slice), max|W| x1.12 (#342)", peak_neutral=True)
    # §18 #315 the MUDD gate nets and DC
    attn_gate_layers: Optional[tuple[int, ...]] = recipe(
        None, "blocks whose attention keeps its output gate (none: #317's ablation); auto: all; with --mudd_gate "
        "from the gate net", needs=("attn_output_gate",), peak_neutral=True)
    mudd_gate: bool = recipe(False, "per-token XSA alphas, output gates, x0/bigram weights, skip gates and DC weights "
                             "from two small nets (#315)", peak_neutral=True)
    mudd_gate_layer: Optional[int] = recipe(None, "with --mudd_gate: its second net reads the stream at this block's "
                                            "input; auto: round(4/11 x num_layers) (6 of 16)", at_least=0,
                                            needs=("mudd_gate",), peak_neutral=True)
    mudd_gate_lr: float = recipe(0.0004, "with --mudd_gate: Adam lr of its nets (betas 0.9/0.99; decay on the two "
                                 "matrices only)", at_least=0, at_most=LR_LIMIT, needs=("mudd_gate",),
                                 peak_neutral=True)
    mudd_gate_start: str = recipe("pr315", "with --mudd_gate: starting output gates and skips, #315's (0.25, 0.5) or "
                                  "neutral: the plain model's (0.5, 1)", choices=("neutral", "pr315"),
                                  needs=("mudd_gate",), peak_neutral=True)
    dc_layers: tuple[int, ...] = recipe((), "with --mudd_gate: blocks whose attention adds the head-composed "
                                        "local-window attention (#315's DC), weights from the gate net", peak_neutral=True)
    dc_window: int = recipe(112, "with --dc_layers: DC's window in tokens (t - s < W, same document)", at_least=1,
                            needs=("dc_layers",), peak_neutral=True)
    # ---- seed ideas (docs/ideas.md): the defaults are the record; an idea that is off builds nothing
    num_extra_embeds: int = idea(1, "input embeddings beyond x00 (the record: x01)", at_least=0, at_most=4)
    x00_at_output: bool = idea(False, "mix x00 into the final normed x before the head (rejected upstream)")
    lore_input: bool = idea(False, "LoRE: input embeddings as a V x r table and an r -> d projection")
    lore_output: bool = idea(False, "LoRE: head as d -> r -> V")
    lore_rank: int = idea(128, "LoRE rank r", at_least=1, needs=("lore_input", "lore_output"))
    lore_init: str = idea("corrected", "LoRE factor init", choices=("none", "original", "corrected"),
                          needs=("lore_input", "lore_output"))
    ve_mode: str = idea("native", "value embeddings: one table per layout index (native, grouped) or a basis of K "
                        "tables mixed by coefficients (learned, frozen)", choices=("native", "grouped", "learned", "frozen"))
    ve_tables: int = idea(0, "K basis tables for learned/frozen (0: as many as value_embed_layout names)", at_least=0)
    ve_coeff_init: str = idea("canonical", "learned/frozen coefficient init", choices=("canonical", "assignment"))
    ve_coeff_lr: float = idea(0.5, "Adam lr of learned coefficients", at_least=0, at_most=LR_LIMIT, peak_neutral=True)
    ve_exec: str = idea("direct", "learned/frozen: mix gathered rows (direct) or build tables first (materialized)",
                        choices=("direct", "materialized"))
    # ---- execution: the same computation, on other hardware or data, at another speed or memory
    device: str = execution("auto", "where to run", choices=("auto", "cuda", "cpu"))
    compile: Optional[bool] = execution(None, "torch.compile the model (auto: on for CUDA, off for CPU)")
    attention: str = execution("auto", "auto: flex on CUDA, sdpa with a dense mask on CPU; fa3: FlashAttention-3 "
                               "(Hopper GPUs, the `kernels` package)",
                               choices=("auto", "flex", "sdpa", "fa3"))
    threads: int = execution(0, "CPU threads of a CPU run (0: OMP_NUM_THREADS if set, else 1)", at_least=0)
    coordinate_descent_tuning: bool = execution(False, "CUDA: let the compiler search each kernel's launch settings "
                                                "(slower compile; the record ran without)")
    activation_checkpointing: bool = execution(False, "recompute each block (and the loss in chunks) in backward")
    warmup_steps: int = execution(2, "untimed compile warm-up steps (and, on the step grid, the steps around each of "
                                  "its changes), state restored afterwards", at_least=0)
    train_files: str = execution("data/fineweb10B/fineweb_train_*.bin", "training shards (a glob)")
    val_files: str = execution("data/fineweb10B/fineweb_val_*.bin", "validation shards (a glob)")
    synthetic_data: bool = execution(False, "generate the tiny preset's shards into data/synthetic/ if missing "
                                     "(never elsewhere)")
    # ---- bookkeeping: names, seeds, outputs, checkpoints, tool modes
    preset: str = bookkeeping("medium", "starting point the other flags override", choices=("medium", "tiny"))
    recipe: str = bookkeeping("bulk", "a record's recipe (or a candidate's) on top of the preset (see the list at the "
                              "end of --help): it sets the fields it names, your flags override them")
    run_id: str = bookkeeping("", "log file is <log_dir>/<run_id or preset>_<uuid>.txt")
    seed: Optional[int] = bookkeeping(None, "init and warm-up seed; unset: a fresh one per run, written to the log",
                                      at_least=0, at_most=2**64 - 1)  # torch's generators take 64 bits
    log_dir: str = bookkeeping("logs", "folder of the run logs")
    val_every: int = bookkeeping(250, "validate every N steps (and at the end); 0: only at the end", at_least=0)
    nonfinite_check_every: int = bookkeeping(25, "look for a nan/inf training loss every N steps (a host sync)",
                                             at_least=1)
    token_bytes_file: str = bookkeeping("data/gpt2_token_bytes.npy", "bytes per token id, for val_bpb ('' = off; "
                                        "a path you give must be such a table)")
    save_every: int = bookkeeping(0, "checkpoint every N steps and at the end; 0: never", at_least=0)
    checkpoint_dir: str = bookkeeping("checkpoints", "checkpoints go to <checkpoint_dir>/<run_id or preset>/step_<N>/")
    keep_checkpoints: int = bookkeeping(0, "with --save_every: keep the newest N checkpoints of the run, deleting older "
                                        "ones after each save; 0: keep all", at_least=0, needs=("save_every",))
    resume: str = bookkeeping("", "a checkpoint folder, or 'latest' (the newest valid one of this run name)")
    force_resume: bool = bookkeeping(False, "resume even if the config differs in fields that change training")
    dry_run: bool = bookkeeping(False, "build on the meta device, print counts and FLOPs, exit")
    # what fits where (docs/scale.md): neither changes a number of the run
    gpu_memory_gib: Optional[float] = bookkeeping(
        None, "memory per GPU the predicted peak is held against: the dry run's table of what fits (auto: 80, the "
        "record's H100s) and a run's check before it compiles (auto: the GPU's own; more runs what it refuses)",
        above=0)
    gpu_count: Optional[int] = bookkeeping(None, "with --dry_run: GPUs of its table of what fits (auto: WORLD_SIZE "
                                           "under torchrun, else 8, the record's)", at_least=1, needs=("dry_run",))
    bench_steps: int = bookkeeping(0, "benchmark: build and compile as a run, then time N training steps on random "
                                   "tokens (no data, no log) and print ms/step, tokens/s, TFLOP/s, MFU, memory; "
                                   "0: train", at_least=0)
    bench_at_step: Optional[int] = bookkeeping(None, "with --bench_steps: time at this step of the schedule only; "
                                               "unset: at the first and the last step", at_least=0,
                                               needs=("bench_steps",))
    # after the run (tools/metrics.py, tools/hellaswag.py; README "After the run"): no number of the run changes
    metrics_jsonl: str = bookkeeping("", "write one JSON object per step line and per validation to this file ('auto': "
                                     "beside the log, <log>.jsonl; '': off); made from the log's own lines, no "
                                     "extra host sync")
    tracker: str = bookkeeping("none", "also feed those records to wandb or tensorboard (imported only when asked)",
                               choices=("none", "wandb", "tensorboard"))
    eval_hellaswag: bool = bookkeeping(False, "after training, untimed: HellaSwag accuracy (acc_norm by mean ending "
                                       "loss, acc by sum) on rank 0, in a log line of its own")
    hellaswag_file: str = bookkeeping("", "HellaSwag rows (.jsonl or .parquet) for --eval_hellaswag; '': the "
                                      "validation set from the Hugging Face hub, fetched once and cached",
                                      needs=("eval_hellaswag",))

    # ---- derived quantities (no state of their own)
    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // 128) * 128

    @property
    def table_rows(self) -> int:
        """Rows of the input and value-embedding tables."""
        return self.padded_vocab_size if self.pad_vocab_tables else self.vocab_size

    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def init_seed(self) -> int:
        """The seed of the initial values and warm-up tokens: --seed, or 0 where no run drew one
        (a library call; `main` draws a fresh seed for every run)."""
        return 0 if self.seed is None else self.seed

    @property
    def value_embed_tables(self) -> list[Optional[int]]:
        return list(self.value_embed_layout)

    @property
    def num_value_embeds(self) -> int:
        """K, the number of value-embedding tables."""
        if self.ve_mode in ("learned", "frozen") and self.ve_tables > 0:
            return self.ve_tables
        used = [t for t in self.value_embed_layout if t is not None]
        return max(used) + 1 if used else 0

    @property
    def skips(self) -> dict[int, int]:
        """{target layer: source layer}."""
        return dict(self.skip_connections)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.attention_free_layers]

    @property
    def long_layers(self) -> set[int]:
        return set(self.long_window_layers)

    @property
    def gated_layers(self) -> list[int]:
        """The blocks whose attention has an output gate (§18 --attn_gate_layers; auto: every attention
        block where --attn_output_gate)."""
        if not self.attn_output_gate:
            return []
        chosen = self.attention_layers if self.attn_gate_layers is None else self.attn_gate_layers
        return sorted(set(chosen))


# =============================================================================
# 2. Schedules on the step grid (docs/bulk-data.md): each a pure function of the step. S =
# num_iterations - extension_steps scheduled steps; a schedule tuple of n entries cuts them into n
# slots (slot = floor(n * step / S)); steps S .. num_iterations - 1 are the extension. The float
# expressions keep the record's order of operations (x = step / S first), so every value, boundary
# steps included, is the record's to the last bit.

SHORT_WINDOW_CAP = 11  # blocks: in the scheduled steps the short window is min(11, long // 2)
EMBEDDING_SPLIT_FRACTION = 2 / 3 / 4  # of S, rounded up to an odd step: where tied embeddings untie


def scheduled_steps(config: Hyperparameters) -> int:
    """S, the steps the grid's schedules span; the extension steps follow them."""
    return config.num_iterations - config.extension_steps


def grid_slot(step: int, config: Hyperparameters, slots: int) -> int:
    """The slot (0 .. slots-1) of a scheduled step on a grid of `slots` slots."""
    return int(slots * (step / scheduled_steps(config)))


def batch_tokens(step: int, config: Hyperparameters) -> int:
    """Training tokens of step `step`, all slices together: the batch_schedule's slot (the last
    slot's in the extension), or batch_slices x train_seq_len."""
    schedule = config.batch_schedule
    if not schedule:
        return config.batch_slices * config.train_seq_len
    if step >= scheduled_steps(config):
        return schedule[-1]
    return schedule[grid_slot(step, config, len(schedule))]


def slice_tokens(step: int, config: Hyperparameters) -> int:
    """Tokens of one slice (one micro-batch; one GPU's sequence in the 8-GPU record) at `step`."""
    return batch_tokens(step, config) // config.batch_slices


def grid_lr_multiplier(step: int, config: Hyperparameters, floor: float) -> float:
    """The grid's lr multiplier: lr_peaks[k] once step/S > k/n (strictly: a step exactly on a slot
    boundary keeps the previous peak), from step/S >= 1 - cooldown_frac a straight line from the
    peak down to `floor` at S, and `floor` in the extension."""
    S = scheduled_steps(config)
    if step > S:
        return floor
    peaks, x = config.lr_peaks, step / S
    peak = peaks[0]
    for k in range(1, len(peaks)):
        if x > k / len(peaks):
            peak = peaks[k]
    if x >= 1 - config.cooldown_frac:
        w = (1 - x) / config.cooldown_frac
        return peak * w + (1 - w) * floor
    return peak


def lr_schedule(step: int, config: Hyperparameters) -> float:
    """The lr multiplier every optimizer group applies at `step`."""
    return grid_lr_multiplier(step, config, config.lr_floor)


def momentum_schedule(step: int, config: Hyperparameters) -> float:
    """The Muon momentum at `step`: the warm-up from muon_momentum_start, then muon_momentum, and
    over the last muon_momentum_cooldown_steps steps a straight line back down (the last step stops
    one step short of muon_momentum_start)."""
    start, end = config.muon_momentum_start, config.muon_momentum
    warmup, cooldown = config.muon_momentum_warmup_steps, config.muon_momentum_cooldown_steps
    cooldown_start = config.num_iterations - cooldown
    if step < warmup:
        return start + step / warmup * (end - start)
    if step > cooldown_start:
        return end - (step - cooldown_start) / cooldown * (end - start)
    return end


def attention_windows(step: int, config: Hyperparameters) -> tuple[int, int]:
    """(long, short) attention windows in blocks at `step`; step num_iterations is the final
    validation. The slot's long window and min(11, long // 2); in the extension the last slot's
    (short: its half); at the final validation max_window_tokens with the extension's short window."""
    schedule = config.window_schedule
    if step >= config.num_iterations:
        return config.max_window_tokens // config.attn_block_size, schedule[-1] // 2
    if step >= scheduled_steps(config):
        return schedule[-1], schedule[-1] // 2
    long = schedule[grid_slot(step, config, len(schedule))]
    return long, min(SHORT_WINDOW_CAP, long // 2)


def yarn_changes(config: Hyperparameters) -> list[tuple[int, int, int]]:
    """(step, old long window, new long window) at each training step where the long window changes
    to at most yarn_window_limit blocks: where RoPE is rescaled (YaRN). The final validation's
    longer window is not one. No limit (0): none."""
    limit = config.yarn_window_limit
    if not limit:
        return []
    changes, long = [], attention_windows(0, config)[0]
    for step in range(1, config.num_iterations):
        new = attention_windows(step, config)[0]
        if new != long and new <= limit:
            changes.append((step, long, new))
        long = new
    return changes


def multi_token_weights(step: int, config: Hyperparameters) -> tuple[float, ...]:
    """Loss weights of the next, second-next and third-next token (multi-token prediction) at
    `step`: three weights over the first twelfth of S, the third falling from 0.25 toward 0; two
    over the second twelfth, the second falling from 0.5 toward 0; then next-token only."""
    x = step / (scheduled_steps(config) / 4)
    if x < 1 / 3:
        return (1.0, 0.5, 0.25 * (1 - 3 * x))
    if x < 2 / 3:
        return (1.0, 0.5 * (1 - (3 * x - 1)))
    return (1.0,)


def embedding_split_step(config: Hyperparameters) -> int:
    """The step after whose optimizer step tied input embedding and head become two tables: a
    sixth of S rounded up, made odd (an odd step is one where the every-other-step Adam steps)."""
    return math.ceil(EMBEDDING_SPLIT_FRACTION * scheduled_steps(config)) | 1


def untie_step(config: Hyperparameters) -> int:
    """The step after whose update tied embeddings untie (0: never tied): --untie_embed_after_step,
    or where it is auto, embedding_split_step (so a run of another length splits where the record
    would at that length)."""
    step = config.untie_embed_after_step
    return embedding_split_step(config) if step is None else step


def is_validation_step(step: int, config: Hyperparameters) -> bool:
    """Validation runs before the training step of every val_every-th step, and at the end."""
    return step == config.num_iterations or (config.val_every > 0 and step % config.val_every == 0)


def grid_changes(config: Hyperparameters) -> list[int]:
    """Training steps where the grid's batch shape or phase changes: a new batch size, a window_schedule's
    new long window, a new number of multi-token weights, the first step after the embedding split
    (--untie_embed_after_step), the first extension step."""
    N, split = config.num_iterations, untie_step(config)
    changes = {scheduled_steps(config)} if config.extension_steps else set()
    if split and split + 1 < N:
        changes.add(split + 1)
    for step in range(1, N):
        if (batch_tokens(step, config) != batch_tokens(step - 1, config)
                or config.multi_token_prediction
                and len(multi_token_weights(step, config)) != len(multi_token_weights(step - 1, config))
                or attention_windows(step, config) != attention_windows(step - 1, config)):
            changes.add(step)
    return sorted(changes)


def warmup_schedule(config: Hyperparameters) -> list[int]:
    """The steps the untimed compile warm-up runs: the first warmup_steps steps and the steps around
    each change of the step grid (so every batch shape and phase compiles before the clock starts).
    warmup_steps=0: none."""
    if not config.warmup_steps:
        return []
    steps = set(range(config.warmup_steps))
    for change in grid_changes(config):
        steps |= {change - 1, change, change + 1}
    return sorted(s for s in steps if 0 <= s < config.num_iterations)


# =============================================================================
# 3. Optimizers (docs/bulk-optimizers.md): Muon (NorMuon with Polar Express) for the matrices inside
#    the blocks, a cautious Adam for tables, head, scalars and small gates. Each part of Muon is
#    switched by its own field (section 1); the arithmetic that rounds as CUDA does is in
#    triton_kernels.py (as_cuda, fp32_product).

_compiled_functions: dict = {}


def compiled(fn, **options):
    """`fn` under torch.compile with static shapes and `options`, created on first use and kept for
    the process (never at import: compiling needs a C++ or Triton toolchain and takes seconds). One
    compiled function serves every caller with the same options; it compiles again for each new
    input shape or dtype."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _compiled_functions:
        _compiled_functions[key] = torch.compile(fn, dynamic=False, **options)
    return _compiled_functions[key]


# (a, b, c) of each Newton-Schulz iteration: quintic steps tuned to pull singular values into
# a band around 1 quickly rather than to converge exactly.
NEWTON_SCHULZ_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def orthogonalize(G: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T for each matrix in the last two dims, iterating in `dtype`."""
    X = G.float()
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    transposed = X.size(-2) > X.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        X = X.mT
    for a, b, c in NEWTON_SCHULZ_COEFFS:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if transposed else X


def fp32_from_halves(weight: torch.Tensor, low_bits: torch.Tensor) -> torch.Tensor:
    """The fp32 master value: bf16 bits are its high half, `low_bits` (int16) its low half."""
    high = weight.view(torch.int16).to(torch.int32) << 16
    return (high | (low_bits.to(torch.int32) & 0xFFFF)).view(torch.float32)


def store_halves(master: torch.Tensor, weight: torch.Tensor, low_bits: torch.Tensor) -> None:
    """Split an fp32 master value back into the bf16 weight (truncated) and its low 16 bits."""
    bits = master.view(torch.int32)
    weight.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    low_bits.copy_(bits.to(torch.int16))  # int32 -> int16 keeps the low 16 bits


def multiplier_key(p: nn.Parameter) -> tuple:
    """(shape, lr_mul, wd_mul): a parameter's lr and weight-decay multipliers are attributes set
    where it is created (absent: 1.0); Muon groups matrices that share all three."""
    return p.shape, getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)


def orthogonalized_shape(p: torch.Tensor, group: dict) -> torch.Size:
    """The shape Muon orthogonalizes: the matrix itself, or with group["blocks"] = k its k row
    blocks (the merged attention weight: q, k, v, o), whatever the storage's leading dims."""
    blocks = group.get("blocks", 1)
    if blocks == 1:
        return p.shape
    return torch.Size((blocks, p.numel() // (blocks * p.shape[-1]), p.shape[-1]))


def block_view(p: torch.Tensor, group: dict):
    """A function viewing tensors shaped like `p` in orthogonalized_shape (the tensor itself when equal)."""
    shape = orthogonalized_shape(p, group)
    return lambda t: t if t.shape == shape else t.view(shape)


# (a, b, c) of the five Polar Express steps. Each step's coefficients are tuned for where that step
# finds the singular values (the first lifts tiny ones hard, the last settle near 1), so five steps
# land closer to the polar factor than five repetitions of one polynomial.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# G is divided by 1.02 |G|_F + 1e-6 first: the 2% margin keeps every singular value below 1 despite
# the bf16 rounding of the norm.
POLAR_EXPRESS_NORM_SCALE, POLAR_EXPRESS_EPS = 1.02, 1e-6


def polar_express(G: torch.Tensor, coeffs=POLAR_EXPRESS_COEFFS, norm_scale: float = POLAR_EXPRESS_NORM_SCALE,
                  eps: float = POLAR_EXPRESS_EPS, dtype=torch.bfloat16, split_last_product: bool = False) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T for each matrix in the last two dims, every operation in
    `dtype` (bf16 in the record): G is cast, a tall matrix transposed (so A below is the smaller
    Gram matrix), divided by norm_scale*|G|_F + eps, then each step is X <- a X + (b A + c A^2) X
    with A = X X^T. Each step rounds where the record's kernels round: A; b A + c A A^T once; and
    a X + B X once, or with `split_last_product` (the record does this for the MLP matrices) B X
    and then + a X. With Newton-Schulz's coefficients, norm_scale 1 and eps 1e-7 it computes the
    polynomial `orthogonalize` does (only the roundings of the fused steps differ)."""
    X = G.to(dtype)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    X = (X / kernels.as_cuda.add_(X.norm(dim=(-2, -1), keepdim=True) * norm_scale, eps)).contiguous()
    matmul, addmm = kernels.as_cuda.matmul, kernels.as_cuda.addmm  # addmm: beta*t + alpha*(a @ b), rounded once
    for a, b, c in coeffs:
        A = matmul(X, X.mT)
        B = addmm(A, A, A.mT, beta=b, alpha=c)
        X = kernels.as_cuda.add_(matmul(B, X), X, alpha=a) if split_last_product else addmm(X, B, X, beta=a, alpha=1.0)
    return X.mT if transposed else X


def nesterov_momentum(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: torch.Tensor,
                      one_minus_momentum: torch.Tensor) -> torch.Tensor:
    """Muon's momentum, in place, and its Nesterov output m*b + (1-m)*g (EMA form, as Muon). An fp32
    buffer: Muon's own arithmetic. A bf16 buffer (the record's gates): each lerp computed in fp32
    and rounded to bf16, which is what a bf16 lerp with a Python-float weight computes (a bf16
    lerp with a tensor weight would round the weight to bf16 first)."""
    grad = grad.float()
    if momentum_buffer.dtype == torch.float32:
        momentum_buffer.lerp_(grad, one_minus_momentum)
        return grad.lerp(momentum_buffer, momentum)
    momentum_buffer.copy_(momentum_buffer.float().lerp_(grad, one_minus_momentum))
    return grad.lerp(momentum_buffer.float(), momentum).to(momentum_buffer.dtype)


def normuon_row_normalize(update: torch.Tensor, row_mean_square: torch.Tensor, beta2: float,
                          reduce_dim: int) -> torch.Tensor:
    """NorMuon's row normalization, in place: r = mean over `reduce_dim` of update^2 (fp32; one
    value per row for reduce_dim=-1), row_mean_square <- lerp toward r by 1 - beta2 (in its own
    dtype, no bias correction), then each row is scaled by 1/sqrt(max(row_mean_square, 1e-10)) and
    the whole matrix by |update|_F / |scaled|_F (its Frobenius norm is kept). The order and dtype
    of every operation are the record's; the norms are computed from r, not from the update; the
    reciprocal square root is CUDA's (as_cuda)."""
    r = update.float().square().mean(dim=reduce_dim, keepdim=True)
    n = update.size(reduce_dim)
    norm = r.sum(dim=(-2, -1), keepdim=True).mul_(n).sqrt_()
    row_mean_square.lerp_(r.to(row_mean_square.dtype), 1 - beta2)
    row_scale = kernels.as_cuda.rsqrt_(row_mean_square.clamp_min(1e-10))
    scaled_norm = ((r * n) * row_scale.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    scale = row_scale * (norm / scaled_norm.clamp_min_(1e-10))
    return update.mul_(scale.type_as(update))


def normuon_reduce_dim(p: torch.Tensor, group: dict) -> int:
    """The dim NorMuon's statistic averages over: -1 (one value per stored row) for gates and for
    matrices with at least as many stored rows as columns (leading dims count as rows), else -2
    (one per column). Rows are as stored: an MLP output matrix stored transposed gets one value
    per hidden unit."""
    rows, cols = p.numel() // p.shape[-1], p.shape[-1]
    return -1 if group.get("gate", False) or rows >= cols else -2


def cautious_step(weight: torch.Tensor, update: torch.Tensor, wd_factor: torch.Tensor,
                  lr_factor: torch.Tensor) -> None:
    """Cautious weight decay and the step, in place: entries where update*weight >= 0 decay by
    wd_factor*lr_factor, then weight -= lr_factor*update. Every product in fp32 with the fp32
    factors, in the record's order (w - w*mask*wd*lr) - update*lr, rounded once to the weight's
    dtype: what the compiled step computes on the GPU, where the compiler keeps the fused chain in
    fp32 (a bf16 update or gate weight is widened as it is loaded, and the record's cast of the
    factors to a gate's bf16 is dropped inside the chain). Uncompiled, a bf16 update times an fp32
    0-d factor would be rounded to bf16, and a gate's every product too."""
    w, u = weight.float(), update.float()
    wd, lr = wd_factor.float(), lr_factor.float()
    same_sign = (u * w) >= 0
    weight.copy_(w - w * same_sign * wd * lr - u * lr)


def decoupled_step(master: torch.Tensor, update: torch.Tensor, decay: torch.Tensor, step_size: torch.Tensor) -> None:
    """Muon's step, in place: master *= 1 - lr*wd*wd_mul, then master += step_size*update."""
    master.mul_(decay)
    master.addcmul_(update.float(), step_size)


def muon_shape_factor(p: torch.Tensor, group: dict, lr_shape: str) -> float:
    """Muon's lr factor sqrt(max(1, rows/cols)): of the matrix as stored, leading dims counted as
    rows (lr_shape "stored": the merged attention weight 4096 x 1024 gets 2), or of each block
    Muon orthogonalizes ("blocks": q, k, v, o 1024 x 1024 each get 1, as #252's banks)."""
    rows, cols = ((p.numel() // p.shape[-1], p.shape[-1]) if lr_shape == "stored"
                  else orthogonalized_shape(p, group)[-2:])
    return max(1.0, rows / cols) ** 0.5


class Muon(torch.optim.Optimizer):
    """Muon as the record runs it (NorMuon), for the matrices inside the blocks and the heads'
    gates. Per matrix: Nesterov momentum (EMA form), orthogonalization (Polar Express, or
    Newton-Schulz), the row normalization, then the step with cautious weight decay, quadratic in
    the lr (decay factor weight_decay * wd_mul * lr * lr_eff with lr_eff = lr * lr_mul * shape
    factor), where the shape factor is sqrt(max(1, rows/cols)) of the stored matrix or of each
    block. Each part is a switch; with all four at their x01 setting (newton_schulz, no row
    normalization, decoupled decay w *= 1 - lr*wd*wd_mul, block shape) it is plain Muon.

    Matrices are sorted by size and dealt round-robin to ranks within groups of one shape and one
    pair of multipliers; each rank updates its own (holding their state) and all-gathers the rest.
    The owner's p.grad must hold the sum over ranks (GradientExchange reduce-scatters it there). Dtypes: a group with "gate": True keeps its
    momentum and row statistic in the gates' dtype and updates them in place in it (bf16 on a GPU,
    as the record: no fp32 master). Other matrices have fp32 state; a bf16 matrix keeps the 16 low
    bits of its fp32 master (the record stores its matrices in fp32, so it has none).

    With compile_update the three steps the record compiles (orthogonalization, row
    normalization, the step) are compiled separately, each with fullgraph, so the compiler fuses
    the same operations as the record's; the momentum runs eagerly, as there. Each step's
    scalars are 0-d fp32 tensors refilled in place, so a new lr or momentum never recompiles.
    """

    SCALARS = ("momentum", "one_minus_momentum", "decay", "step_size", "lr_factor", "wd_factor")

    def __init__(self, param_groups: list[dict], lr: float, momentum: float, weight_decay: float,
                 rank: int = 0, world_size: int = 1, compile_update: bool = False, *,
                 collectives: Optional["Collectives"] = None,
                 orthogonalization: str = "polar_express", row_normalization: bool = True, row_beta2: float = 0.95,
                 cautious_weight_decay: bool = True, lr_shape: str = "stored", scalar_rounding: str = "bulk"):
        groups = []
        for group in param_groups:  # split each group by shape (a gather moves one shape) and by multipliers
            params = sorted(group["params"], key=lambda p: p.numel(), reverse=True)
            for shape, lr_mul, wd_mul in dict.fromkeys(multiplier_key(p) for p in params):
                groups.append({**group, "params": [p for p in params if multiplier_key(p) == (shape, lr_mul, wd_mul)],
                               "lr_mul": lr_mul, "wd_mul": group.get("wd_mul", 1.0) * wd_mul})
        super().__init__(groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, wd_mul=1.0))
        self.rank, self.world_size = rank, world_size
        self.collectives = collectives or (Collectives(world_size, rank) if world_size > 1 else None)
        self.orthogonalization, self.lr_shape = orthogonalization, lr_shape
        self.row_normalization, self.row_beta2 = row_normalization, row_beta2
        self.cautious_weight_decay, self.scalar_rounding = cautious_weight_decay, scalar_rounding
        part = (lambda fn: compiled(fn, fullgraph=True)) if compile_update else (lambda fn: fn)
        self.orthogonalize = part(polar_express if orthogonalization == "polar_express" else orthogonalize)
        self.row_normalize, self.cautious_step, self.decoupled_step = (
            part(normuon_row_normalize), part(cautious_step), part(decoupled_step))
        # per group, the update's scalars: device tensors refilled in place (no recompile, no host sync)
        self.scalars = [{name: torch.zeros((), device=group["params"][0].device) for name in self.SCALARS}
                        for group in self.param_groups]
        for group in self.param_groups:
            for p in self.owned(group):
                self.state[p] = self.new_state(group, p)

    def new_state(self, group: dict, p: nn.Parameter) -> dict:
        gate = group.get("gate", False)
        dtype = p.dtype if gate else torch.float32
        state = dict(momentum_buffer=torch.zeros_like(p, dtype=dtype))
        if p.dtype == torch.bfloat16 and not gate:
            state["low_bits"] = torch.zeros_like(p, dtype=torch.int16)
        if self.row_normalization:
            shape = list(orthogonalized_shape(p, group))
            shape[normuon_reduce_dim(p, group)] = 1
            state["row_mean_square"] = torch.zeros(shape, dtype=dtype, device=p.device)
        state.update(qk_group_state(self, group, p, dtype))  # §13 --muon_qk_group_heads
        return state

    def owned(self, group: dict) -> list[nn.Parameter]:
        return group["params"][self.rank::self.world_size]

    @torch.no_grad()
    def step(self):
        pending = []
        for group, scalars in zip(self.param_groups, self.scalars):
            self._fill_scalars(group, scalars)
            params, W = group["params"], self.world_size
            for base in range(0, len(params), W):
                chunk = params[base:base + W]
                mine = chunk[self.rank] if self.rank < len(chunk) else None
                if mine is not None:
                    self.update_matrix(group, scalars, mine)
                if W > 1:  # everyone sends its updated matrix (or padding) and receives the rest
                    send = mine.detach().clone() if mine is not None else torch.zeros_like(chunk[0])
                    outputs = [chunk[r] if r < len(chunk) and r != self.rank else torch.empty_like(send)
                               for r in range(W)]
                    pending.append(self.collectives.all_gather_list(outputs, send, group.get("name", "muon")))
        for work in pending:
            work.wait()

    def update_matrix(self, group: dict, scalars: dict[str, torch.Tensor], p: nn.Parameter) -> None:
        """This rank's step of one matrix it owns, on views split into the group's blocks."""
        if group.get("qk_rows"):  # §13 --muon_qk_group_heads
            return qk_grouped_update(self, group, scalars, p)  # §13 --muon_qk_group_heads
        state, as_blocks = self.state[p], block_view(p, group)
        weight, low_bits = as_blocks(p.data), state.get("low_bits")
        g = nesterov_momentum(as_blocks(p.grad), as_blocks(state["momentum_buffer"]), scalars["momentum"],
                              scalars["one_minus_momentum"])
        update = self.normalized_update(g, group, weight.dtype, state, "row_mean_square", normuon_reduce_dim(p, group))
        self.apply_update(weight, low_bits, as_blocks, update, scalars)

    def normalized_update(self, g, group: dict, dtype, state: dict, statistic: str, reduce_dim: int) -> torch.Tensor:
        """The orthogonalized momentum g, NorMuon-normalized with state[statistic] along reduce_dim."""
        if self.orthogonalization == "polar_express":
            update = self.orthogonalize(g, split_last_product=group.get("split_last_product", False))
        else:
            update = self.orthogonalize(g, dtype)
        if self.row_normalization:
            update = self.row_normalize(update, state[statistic], self.row_beta2, reduce_dim)
        return update

    def apply_update(self, weight, low_bits, as_blocks, update, scalars: dict[str, torch.Tensor]) -> None:
        """The step (cautious or decoupled) on the weight, on its fp32 master where bf16 keeps low bits."""
        master = fp32_from_halves(weight, as_blocks(low_bits)) if low_bits is not None else weight
        if self.cautious_weight_decay:
            self.cautious_step(master, update, scalars["wd_factor"], scalars["lr_factor"])
        else:
            self.decoupled_step(master, update, scalars["decay"], scalars["step_size"])
        if low_bits is not None:
            store_halves(master, weight, as_blocks(low_bits))

    def _fill_scalars(self, group: dict, scalars: dict[str, torch.Tensor]) -> None:
        """Momentum, and the step's factors, computed in Python floats and rounded once to fp32.
        Cautious: lr_factor = lr * lr_mul * shape factor and wd_factor = wd_mul * weight_decay * lr,
        each product rounded to fp32 as the record's fp32 multiplier vectors round it (fp32_product;
        §9's pr252_muon_factors round as #252 does). Otherwise the decay 1 - lr*wd*wd_mul and the step
        size -lr * lr_mul * shape factor."""
        m, lr = group["momentum"], group["lr"]
        shape_factor = muon_shape_factor(group["params"][0], group, self.lr_shape)
        values = dict(momentum=m, one_minus_momentum=1 - m)
        if self.scalar_rounding == "pr252":  # §9 --muon_scalar_rounding=pr252
            values.update(pr252_muon_factors(group, shape_factor, self.cautious_weight_decay))
        elif self.cautious_weight_decay:
            values.update(lr_factor=kernels.fp32_product(shape_factor * group["lr_mul"], lr),
                          wd_factor=kernels.fp32_product(group["wd_mul"], group["weight_decay"], lr))
        if not self.cautious_weight_decay:
            values.update(decay=1 - lr * group["weight_decay"] * group["wd_mul"],
                          step_size=-lr * group["lr_mul"] * shape_factor)
        for name, value in values.items():
            scalars[name].fill_(float(value))  # a kernel launch on CUDA, not a host-to-device copy


def cautious_adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, wd_mul: float) -> None:
    """One parameter's step of the record's Adam, in place, operation by operation in the
    record's order and dtypes (its step runs uncompiled): moments m, v in the weight's dtype;
    u = lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps), so eps sits
    where torch's would be eps / sqrt(1 - beta2^t); then where u*p > 0 (strictly) u += lr^2 * wd *
    wd_mul * p; p -= u. Bias corrections and factors are Python floats, as there. Each operation
    rounds as its CUDA kernel does (as_cuda)."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    t = state["step"]
    kernels.as_cuda.add_(m.mul_(beta1), grad, alpha=1 - beta1)
    kernels.as_cuda.addcmul_(v.mul_(beta2), grad, grad, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
    denom = kernels.as_cuda.add_(v.sqrt(), eps)
    update = m.div(denom).mul_(lr * (bias2 ** 0.5 / bias1))
    same_sign = (update * p) > 0
    kernels.as_cuda.addcmul_(update, p, same_sign, value=lr * weight_decay * wd_mul * lr)
    p.add_(update, alpha=-1.0)


class CautiousAdam(torch.optim.Optimizer):
    """The bulk record's Adam (cautious_adam_step for each parameter with a gradient). A parameter's
    `lr_mul` and `wd_mul` attributes (absent: 1) multiply its group's lr and weight decay; its `betas`
    attribute (absent: the group's) replaces the group's betas. State per parameter as PyTorch's Adam
    names it: step (a Python int, counting this parameter's steps), exp_avg and exp_avg_sq, created at
    construction in the weight's dtype. That is the dtype the record's timed run steps with: its
    optimizer creates bf16 moments for every weight, but after its compile warm-up it restores the
    initial optimizer state with load_state_dict, which casts each state tensor to its weight's dtype,
    so its fp32 scalars and x0 weights train with fp32 moments and its bf16 tables, head and gates with
    bf16 ones. With fp32_moments (#252) every weight has fp32 moments and steps by fp32_adam_step.

    On W ranks, as the records' sharded Adam: a tensor adam_rows shards has moments for this rank's
    rows only; the rank steps those rows with their summed gradient (GradientExchange.reduced), then
    every rank's rows are all-gathered into the weight. Any other tensor is stepped whole, on every rank
    alike, with its all-reduced gradient. With compile_update (CUDA) #252's fp32 step runs compiled,
    fullgraph, as #252 compiles it (its per-step factors 0-d device tensors refilled in place, so a new
    step never recompiles); the bulk record's bf16 step runs uncompiled, as the record's does."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, fp32_moments: bool = False, rank: int = 0, world_size: int = 1,
                 compile_update: bool = False, collectives: Optional["Collectives"] = None):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fp32_moments, self.rank, self.world_size = fp32_moments, rank, world_size
        self.collectives = collectives or (Collectives(world_size, rank) if world_size > 1 else None)
        self.exchange: Optional["GradientExchange"] = None  # the Runner's, on more than one rank
        self.update = compiled(fp32_adam_update, fullgraph=True) if fp32_moments and compile_update else fp32_adam_update
        self.rows = {p: adam_rows(p, rank, world_size) for group in self.param_groups for p in group["params"]}
        for group in self.param_groups:
            for p in group["params"]:
                moment = torch.zeros_like(self.shard(p), dtype=torch.float32 if fp32_moments else p.dtype)
                self.state[p] = dict(step=0, exp_avg=moment, exp_avg_sq=torch.zeros_like(moment))
        # §9 #252's per-step factors (step size, decay) as 0-d device tensors, one pair per parameter
        self.factors = {p: torch.zeros(2, device=p.device) for p in self.rows} if fp32_moments else {}

    def shard(self, p: nn.Parameter, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What this rank steps of p (or of t, a tensor of p's shape): its rows (a view), or all of it."""
        rows, t = self.rows[p], p if t is None else t
        return t if rows is None else t[rows[0]:rows[1]]

    def gradient(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """The summed gradient of shard(p), None where p has none this step (the untied embedding
        before the split). Without an exchange the gradient is already summed (one rank, or a test)."""
        if self.exchange is not None:
            return self.exchange.reduced.get(p)
        return None if p.grad is None else self.shard(p, p.grad)

    @torch.no_grad()
    def step(self):
        gathers = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self.gradient(p)
                if grad is None:  # no gradient, no step
                    continue
                b1, b2 = getattr(p, "betas", (beta1, beta2))  # a parameter's own betas (declare) win
                args = (self.shard(p), grad, self.state[p], group["lr"] * getattr(p, "lr_mul", 1.0), b1, b2,
                        group["eps"], group["weight_decay"], getattr(p, "wd_mul", 1.0))
                if self.fp32_moments:  # §9 --adam_fp32_moments
                    fp32_adam_step(*args, factors=self.factors[p], update=self.update)
                else:
                    cautious_adam_step(*args)
                if self.rows[p] is not None:  # every rank's rows into the weight
                    mine = self.shard(p) if self.collectives.in_place_gather else self.shard(p).clone()
                    gathers.append(self.collectives.all_gather(p.data, mine, group["name"]))
        for work in gathers:
            work.wait()

    def copy_state(self, source: nn.Parameter, target: nn.Parameter, transposed: bool = False) -> None:
        """target's state becomes a copy of source's (the split of --untie_embed_after_step), its moments
        transposed where the two are stored transposed to each other. Where the two hold the same rows
        here, a copy on the rank; else (transposed and sharded) the source's moments are all-gathered
        first, once, and this rank keeps its rows of target."""
        copied = {}
        for k, v in self.state[source].items():
            if not torch.is_tensor(v):
                copied[k] = copy.deepcopy(v)
            elif not transposed and self.rows[source] == self.rows[target]:
                copied[k] = v.clone()
            else:
                whole = v
                if self.rows[source] is not None:
                    whole = v.new_empty(source.shape)
                    mine = v if self.collectives.in_place_gather else v.clone()
                    self.collectives.all_gather(whole, mine, "split").wait()
                whole = whole.t() if transposed else whole
                rows = self.rows[target]
                copied[k] = (whole if rows is None else whole[rows[0]:rows[1]]).contiguous().clone()
        self.state[target] = copied


# =============================================================================
# 4. Model (docs/bulk-model.md)

# ---- parameters: each says where it belongs where it is made (declare). Its optimizer group,
# its lr and weight-decay multipliers (both optimizers read them) and how it starts are attributes
# of the parameter itself: parameter_groups, init_parameters and the accounting read them, so an
# idea's parameters live in its module and nowhere else.

def declare(p: nn.Parameter, group: str, init, lr_mul: float = 1.0, wd_mul: float = 1.0,
            betas: Optional[tuple[float, float]] = None, lr: Optional[str] = None) -> nn.Parameter:
    """p with its optimizer group (a name of GROUP_ORDER, or a new one), its multipliers, its own
    Adam betas (None: its group's), `init(shape, generator)` -> its fp32 initial value (drawn from a
    stream of its own), and for an Adam group the Hyperparameters field of the group's lr (a group
    named muon_* steps with Muon, at muon_lr). An init is a module-level function or a
    functools.partial of one, so a parameter still pickles."""
    p.group, p.init, p.lr_mul, p.wd_mul, p.lr_field = group, init, lr_mul, wd_mul, lr
    if betas is not None:
        p.betas = tuple(betas)
    return p


def normal(shape, gen, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def uniform(shape, gen, bound: float) -> torch.Tensor:
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def zeros(shape, gen) -> torch.Tensor:
    return torch.zeros(shape)


def constant(shape, gen, values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(shape)


def normal_init(std: float):
    return functools.partial(normal, std=std)


def uniform_init(bound: float):
    return functools.partial(uniform, bound=bound)


def constant_init(values) -> functools.partial:
    return functools.partial(constant, values=tuple(values))


# ---- rotary position embedding and YaRN

def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); rotates the halves (x1, x2) in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).type_as(x)


def apply_rotary_in_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """--rotary_bf16: the same rotation without the fp32 round trip: x (B, T, H, D) in its own dtype
    times the tables (bf16), each product and sum rounded as the dtypes say."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :x.size(1), None, :], sin[None, :x.size(1), None, :]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)


# YaRN's interpolation ramp: frequencies turning at most YARN_ALPHA times over the old window are
# stretched fully (by old/new), those turning YARN_BETA times or more are kept, linear in between
YARN_ALPHA, YARN_BETA = 1, 32


def yarn_rescale(freqs: torch.Tensor, scale: float, old_window: int, new_window: int, block_size: int
                 ) -> tuple[torch.Tensor, float]:
    """One YaRN change of the long window from old_window to new_window blocks: (frequencies, attention
    scale) afterwards. freqs (D/2,) fp32; the scale is a Python float (float64)."""
    turns = block_size * old_window * freqs / (2 * math.pi)  # full turns over the old window
    ratio = old_window / new_window
    ramp = torch.clamp((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0, 1)
    return freqs * (ratio + ramp * (1 - ratio)), scale * (0.2 * math.log(new_window / old_window) + 1)


class RotaryTables(nn.Module):
    """Rotary cos/sin tables for every position a sequence can have, and the attention scale, held
    as buffers and rewritten in place (the compiled model reads them, so a change never
    recompiles). They are a function of the YaRN changes applied so far (`set_changes`), not
    training state: the Runner derives the changes from the step, so a restored or resumed run
    rebuilds the same tables. Built with --yarn_window_limit or --rotary_bf16."""

    def __init__(self, config: Hyperparameters):
        super().__init__()
        self.config = config
        positions = max(config.train_seq_len, config.val_seq_len)
        dtype = torch.bfloat16 if config.rotary_bf16 else torch.float32
        self.register_buffer("cos", torch.empty(positions, config.head_dim // 2, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(positions, config.head_dim // 2, dtype=dtype), persistent=False)
        # the scale the attention multiplies q.k by: a 0-d tensor for the compiled FlexAttention
        # path, and the same value as a Python float for SDPA, which takes only a float
        self.register_buffer("scale", torch.empty((), dtype=torch.float32), persistent=False)
        self.scale_value = config.attn_scale
        self.changes: Optional[tuple] = None  # what the tables hold; None: not built yet

    @torch.no_grad()
    def set_changes(self, changes: tuple[tuple[int, int], ...]) -> None:
        """Tables and scale after the YaRN changes ((old, new) windows in blocks, in order) from the
        base frequencies; nothing to do if they already hold these."""
        if changes == self.changes:
            return
        cfg, device = self.config, self.cos.device
        quarter = cfg.head_dim // 4
        freqs = (1 / cfg.rope_base) ** torch.linspace(0, 1, quarter, dtype=torch.float32, device=device)
        freqs = torch.cat([freqs, freqs.new_zeros(quarter)])
        scale = cfg.attn_scale
        for old, new in changes:
            freqs, scale = yarn_rescale(freqs, scale, old, new, cfg.attn_block_size)
        theta = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32, device=device), freqs)
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())
        self.scale.fill_(scale)
        self.scale_value, self.freqs, self.changes = scale, freqs, changes


# ---- masks and the attention backends: document-causal sliding windows (block level first, then
# what each backend consumes: flex's BlockMask, SDPA's dense mask, FA3's cumulative lengths)

def candidate_blocks(ids: torch.Tensor, block_size: int, eot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-level structure of document-causal attention over a packed sequence.

    Returns (docs (T,), full (nb, nb), partial (nb, nb)): key block j is a candidate of query
    block i if j <= i and their documents overlap; it is full if j < i and both blocks lie in one
    document (no token-level mask needed), partial otherwise.
    """
    docs = (ids == eot).cumsum(0)
    nb = ids.numel() // block_size
    first_doc = docs.view(nb, block_size)[:, 0]
    last_doc = docs.view(nb, block_size)[:, -1]
    q, k = torch.arange(nb, device=ids.device)[:, None], torch.arange(nb, device=ids.device)[None, :]
    candidate = (k <= q) & (first_doc[:, None] <= last_doc[None, :])
    one_doc = first_doc == last_doc
    full = (k < q) & one_doc[:, None] & one_doc[None, :] & (first_doc[:, None] == first_doc[None, :])
    return docs, full, candidate & ~full


def most_recent_first(blocks: torch.Tensor) -> torch.Tensor:
    """Per query row, the selected key block indices in descending order, then the rest. (nb, nb) int32"""
    nb = blocks.size(-1)
    key = blocks.to(torch.int32) * nb + torch.arange(nb, device=blocks.device, dtype=torch.int32)
    return key.argsort(dim=-1, descending=True).to(torch.int32)

# Token windows: a query at position q sees the keys k of its own document with q - W <= k <= q,
# W = window x block size tokens. For query block i and w = window blocks, key blocks i-w+1 .. i-1
# lie entirely within reach (q - k <= w*bs - 1); block i-w only partly ("the window's edge"),
# the diagonal block only causally; blocks before i-w not at all.

def token_windowed_blocks(full: torch.Tensor, partial: torch.Tensor, window: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """candidate_blocks' (full, partial) restricted to a token window of `window` blocks: full
    blocks at the window's edge become partial, blocks beyond it are dropped. (nb, nb) bools."""
    nb = full.size(-1)
    q, k = torch.arange(nb, device=full.device)[:, None], torch.arange(nb, device=full.device)[None, :]
    inside, edge = k > q - window, k == q - window
    return full & inside, (partial & (inside | edge)) | (full & edge)


def token_window_masks(ids: torch.Tensor, long_window: torch.Tensor, short_window: torch.Tensor,
                       config: Hyperparameters, backend: str, flex_block: Optional[int] = None):
    """(long, short) token-window masks for one packed sequence: FlexAttention BlockMasks, or
    dense (T, T) bools for SDPA. Both keep the selected full blocks entirely and, inside the
    selected partial blocks, the token rule: causal, same document, at most W positions back.
    The windows are device tensors (blocks): a new window rebuilds the masks without recompiling.
    `flex_block`: the BlockMask's block size (flex_mask_block, Part III), a multiple of attn_block_size
    (default: attn_block_size itself)."""
    bs, T = config.attn_block_size, ids.numel()
    docs, full, partial = candidate_blocks(ids, bs, config.eot_token)
    group = (flex_block or bs) // bs

    def build(w):
        reach = w * bs  # W in tokens, a 0-d tensor the mask_mod reads

        def token_rule(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx]) & (q_idx - kv_idx <= reach)

        keep_full, keep_partial = token_windowed_blocks(full, partial, w)
        if backend == "flex":
            if group > 1:
                keep_full, keep_partial = grouped_blocks(keep_full, keep_partial, group)
            count = lambda blocks: blocks.sum(-1, dtype=torch.int32)[None, None]
            return BlockMask.from_kv_blocks(count(keep_partial), most_recent_first(keep_partial)[None, None],
                                            count(keep_full), most_recent_first(keep_full)[None, None],
                                            BLOCK_SIZE=bs * group, mask_mod=token_rule, seq_lengths=(T, T))
        pos = torch.arange(ids.numel(), device=ids.device)
        expand = lambda m: m.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
        return expand(keep_full) | (expand(keep_partial) & token_rule(None, None, pos[:, None], pos[None, :]))

    return build(long_window), build(short_window)


# Past dynamo's recompile limit a compiled function silently runs eagerly, and FlexAttention run
# eagerly ignores the BlockMask's block lists, where the sliding window lives: the loss changes
# with no error. Runs with flex make that an error, with room for every graph a run compiles (each
# batch shape, training and evaluation, the tied and untied embedding, the MTP lengths).
RECOMPILE_LIMIT = 64


def fail_instead_of_eager_fallback() -> None:
    """Dynamo raises at the recompile limit instead of falling back to eager (process-wide)."""
    config = torch._dynamo.config
    config.fail_on_recompile_limit_hit = True
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def attention_backend(config: Hyperparameters, device_type: str) -> str:
    """flex, sdpa or fa3: --attention, where auto means flex on CUDA and sdpa elsewhere."""
    if config.attention != "auto":
        return config.attention
    return "flex" if device_type == "cuda" else "sdpa"


# --attention=fa3: FlashAttention-3's variable-length kernel (the record's attention; its fetch:
# triton_kernels.flash_attention_3). It takes documents as cumulative lengths and a window of W
# tokens back, the token-window mask above; a window is a number, so each one is its own graph.

@dataclass(frozen=True)
class VarlenWindow:
    """The token-window mask in FA3's terms: documents as cumulative lengths (a fixed count of
    them, unused ones empty), the longest a document can be, and the window W in tokens (a query
    sees keys q-W .. q of its own document)."""
    cu_seqlens: torch.Tensor  # (max_docs + 2,) int32
    max_seqlen: int
    reach: int


def varlen_windows(ids: torch.Tensor, windows: tuple[int, int], config: Hyperparameters, training: bool):
    """(long, short) VarlenWindows of one packed sequence; windows (long, short) in blocks. A
    document starts at each end-of-text token, as in the masks (doc id = cumsum(ids == eot)). Room
    for ceil128(T / 300) documents, as the record (its median document is about 400 tokens);
    any beyond that share the last one's slot. Training sequences of whole documents cut at
    document_cut_tokens are at most that long; anything else at most T."""
    T = ids.numel()
    max_docs = max(-(-(T // 300) // 128) * 128, 128)
    docs = (ids == config.eot_token).cumsum(0).clamp_max(max_docs)
    lengths = torch.zeros(max_docs + 1, dtype=torch.int32, device=ids.device).scatter_add_(
        0, docs, torch.ones_like(docs, dtype=torch.int32))
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = min(T, config.document_cut_tokens) if training and config.document_aligned_batches else T
    return tuple(VarlenWindow(cu_seqlens, longest, w * config.attn_block_size) for w in windows)


def attend(q, k, v, mask, scale: float, scale_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of (B, T, H, D) tensors under a BlockMask (flex), a dense bool mask (SDPA)
    or a VarlenWindow (FA3, B = 1). With `scale_tensor` (a 0-d fp32 tensor of the same value as
    `scale`, rewritten in place by YaRN) flex multiplies the scores by the tensor, so a new scale
    needs no recompile."""
    if isinstance(mask, VarlenWindow):
        y = kernels.flash_attention_3()(q[0], k[0], v[0], cu_seqlens_q=mask.cu_seqlens, cu_seqlens_k=mask.cu_seqlens,
                                max_seqlen_q=mask.max_seqlen, max_seqlen_k=mask.max_seqlen, causal=True,
                                softmax_scale=scale, window_size=(mask.reach, 0))
        return (y[0] if isinstance(y, tuple) else y)[None]  # some builds also return the log-sum-exp
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, BlockMask):
        # FlexAttention run eagerly evaluates mask_mod everywhere and ignores the BlockMask's block
        # lists, which carry the sliding window: it always runs compiled, inside the compiled model
        # or compiled on its own (and never falls back to eager past the recompile limit)
        if torch.compiler.is_compiling():
            flex = flex_attention
        else:
            fail_instead_of_eager_fallback()
            flex = compiled(flex_attention)
        if scale_tensor is None:
            y = flex(q, k, v, block_mask=mask, scale=scale)
        else:  # q.k in fp32, times 1.0, times the scale: the product the scale argument would give
            y = flex(q, k, v, block_mask=mask, score_mod=lambda score, b, h, q_idx, kv_idx: score * scale_tensor,
                     scale=1.0)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return y.transpose(1, 2)


# ---- attention, MLP, block

def shift_stationary_keys(k: torch.Tensor) -> torch.Tensor:
    """--key_offset: k (B, T, H, D) with the dims rotary leaves alone (the second quarter of each
    half: D/4..D/2 and 3D/4..D) taken from position t-1 (position 0 keeps its own). Out of place,
    from the unshifted k. The shift runs over the packed sequence: a document's first key carries
    the previous document's last token in those dims."""
    D = k.size(-1)
    dims = torch.arange(D, device=k.device)
    stationary = ((dims >= D // 4) & (dims < D // 2)) | (dims >= 3 * D // 4)
    previous = torch.cat([k[:, :1], k[:, :-1]], dim=1)
    return torch.where(stationary, previous, k)


# the record's gates read the first GATE_INPUTS features of a normed residual stream
GATE_INPUTS = 16


class Gate(nn.Module):
    """A gate's pre-activation: (..., outputs) = G x[..., :16], G (outputs, 16) zero at the start,
    stored in the model dtype. Callers apply the sigmoid and their scale."""

    def __init__(self, outputs: int, dtype: torch.dtype, lr_mul: float, wd_mul: float, group: str = "muon_gates"):
        super().__init__()
        self.weight = declare(nn.Parameter(torch.empty(outputs, GATE_INPUTS, dtype=dtype)), group, zeros,
                              lr_mul, wd_mul, lr=None if group.startswith("muon") else "gates_lr")

    def forward(self, x):
        return F.linear(x[..., :GATE_INPUTS], self.weight.type_as(x))


def qkvo_init(shape, gen, std: float) -> torch.Tensor:
    """q, k, v uniform with std `std`/sqrt(fan_in); the output projection (the 4th) zero."""
    value = uniform(shape, gen, 3**0.5 * std / shape[-1] ** 0.5)
    value[3] = 0
    return value


class AttentionArgs(NamedTuple):
    """What a layer's attention reads besides its input, made per layer by GPT.forward."""
    ve: Optional[torch.Tensor]  # (T, d) the layer's value embedding, or None
    lambdas: torch.Tensor  # (2,) lambda0 on the qkv weights, lambda1 on the output weights
    cos: torch.Tensor  # (T, head_dim // 2) rotary tables
    sin: torch.Tensor
    mask: object  # a BlockMask (flex), a dense bool mask (SDPA) or a VarlenWindow (FA3)
    scale: Optional[float]  # the softmax scale as a number, or None with
    scale_tensor: Optional[torch.Tensor]  # a 0-d fp32 tensor rewritten in place by YaRN (flex)
    v_extra: Optional[torch.Tensor] = None  # §10 --mudd's last block: (B, T, H, D) added to v
    ve_gate: Optional[torch.Tensor] = None  # §10 --mudd's last block: (B, T, H, 1), the value-embedding gate
    gated: Optional["GatedAttention"] = None  # §18 --mudd_gate: the block's per-token XSA, DC and output gate


class Attention(nn.Module):
    """Multi-head attention over the packed sequence, reading norm(x): q, k, v from one merged
    weight, lambda0 scaling the qkv weights (after the q/k norms, only v) and lambda1 the output
    weights; q and k RMS-normed and rotated; the value embedding added to v (gated per head with
    --value_embed_gate); each head's output gated with --attn_output_gate; the key offset on the
    long-window layers and the YaRN scale are further switches."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype, layer: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = config.num_heads, config.head_dim, config.attn_scale
        self.qkv_init_std = config.qkv_init_std
        self.key_offset = config.key_offset and layer in config.long_layers
        self.rotate = apply_rotary_in_dtype if config.rotary_bf16 else apply_rotary
        # q, k, v, o merged, (4, attn_dim, model_dim); o is stored as the record stores it (rows are
        # output features: y @ o^T). Muon orthogonalizes the four matrices separately
        self.qkvo_w = declare(nn.Parameter(torch.empty(4, config.attn_dim, config.model_dim,
                                                       dtype=torch.float32 if config.fp32_block_weights else dtype)),
                              "muon_attn", functools.partial(qkvo_init, std=config.qkv_init_std))
        # gates: group muon_gates (§9 --gates_optimizer=adam: the Adam group gates), lr multiplier 0.1, zero init
        group = "gates" if config.gates_optimizer == "adam" else "muon_gates"
        self.output_gate = (Gate(config.num_heads, dtype, lr_mul=0.1, wd_mul=1.0, group=group)
                            if layer in config.gated_layers and not config.mudd_gate else None)  # §18
        gated_ve = config.value_embed_gate and config.value_embed_tables[layer] is not None
        self.value_gate = Gate(config.num_heads, dtype, lr_mul=0.1, wd_mul=1.0, group=group) if gated_ve else None
        self.xsa = XSA(config) if layer in config.xsa_layers and not config.mudd_gate else None  # §12, §18

    def forward(self, x: torch.Tensor, a: AttentionArgs) -> torch.Tensor:
        """x = norm of the residual stream (B, T, d) -> (B, T, d). The scale: a.scale, or a.scale_tensor
        where that is given, else --attn_scale."""
        B, T = x.shape[:2]
        H, D = self.num_heads, self.head_dim
        w_qkv = a.lambdas[0] * self.qkvo_w[:3].flatten(0, 1).type_as(x)
        q, k, v = F.linear(x, w_qkv).view(B, T, 3 * H, D).chunk(3, dim=-2)  # each (B, T, H, D)
        if a.v_extra is not None:  # §10 --mudd
            v = v + a.v_extra
        q, k = rms_norm(q), rms_norm(k)
        q, k = self.rotate(q, a.cos, a.sin), self.rotate(k, a.cos, a.sin)
        if self.key_offset:
            k = shift_stationary_keys(k)
        if a.ve is not None:
            ve = a.ve.view_as(v)
            if a.ve_gate is not None:  # §10 --mudd's gate replaces the block's own
                ve = a.ve_gate * ve
            elif self.value_gate is not None:
                ve = 2 * torch.sigmoid(self.value_gate(x)).view(B, T, H, 1) * ve
            v = v + ve
        scale = self.scale if a.scale is None and a.scale_tensor is None else a.scale
        y = attend(q, k, v, a.mask, scale, a.scale_tensor)
        if a.gated is not None:  # §18 --mudd_gate: DC, XSA and the output gate from the gate nets
            y = gated_attention(y, q, k, v, a.scale_tensor if scale is None else scale, a.gated)
        y = y if self.xsa is None else self.xsa(y, v)  # §12 --xsa_layers
        if self.output_gate is not None:
            y = y * torch.sigmoid(self.output_gate(x)).view(B, T, H, 1)
        y = y.reshape(B, T, -1)
        return F.linear(y, a.lambdas[1] * self.qkvo_w[3].type_as(y))


class MLP(nn.Module):
    def __init__(self, config: Hyperparameters, dtype: torch.dtype):
        super().__init__()
        hidden = config.mlp_ratio * config.model_dim
        dtype = torch.float32 if config.fp32_block_weights else dtype  # --fp32_block_weights: the master itself
        wd_mul = config.mlp_weight_decay_mul
        self.fc_w = declare(nn.Parameter(torch.empty(hidden, config.model_dim, dtype=dtype)), "muon_mlp",
                            uniform_init(3**0.5 * 0.5 / config.model_dim**0.5), wd_mul=wd_mul)  # std 0.5/sqrt(fan_in)
        # --mlp_proj_transposed stores the output weight as the record does, (hidden, model_dim)
        # like fc_w, which is the shape its optimizer sees; lr multiplier 2. It starts at zero
        self.transposed = config.mlp_proj_transposed
        proj_shape = (hidden, config.model_dim) if self.transposed else (config.model_dim, hidden)
        self.proj_w = declare(nn.Parameter(torch.empty(*proj_shape, dtype=dtype)), "muon_mlp", zeros,
                              lr_mul=2.0 if self.transposed else 1.0, wd_mul=wd_mul)
        self.from_post = config.mlp_backward_from_post  # §15 --mlp_backward_from_post
        self.fp8_up = config.fp8_mlp_up  # §17 --fp8_mlp_up
        self.fp8_down = FP8DownScales(config.batch_slices) if config.fp8_mlp_down else None  # §17 --fp8_mlp_down

    def forward(self, x):  # (B, T, d) -> (B, T, d): relu(x W_fc^T)^2 W_proj^T
        if self.from_post or (self.fp8_up or self.fp8_down is not None) and self.training:  # §15, §17 --fp8_mlp_*
            return short_track_mlp(self, x)
        hidden = F.relu(F.linear(x, self.fc_w.type_as(x))).square()  # (B, T, hidden)
        proj = self.proj_w.T if self.transposed else self.proj_w
        return F.linear(hidden, proj.type_as(hidden))


class BlockArgs(NamedTuple):
    """What a block reads besides the residual stream x, made per layer by GPT.forward."""
    inputs: list  # x00, x01, ... (each (1, T, d)) and §9 the bigram rows: the block input's mixing terms
    resid_weight: torch.Tensor  # rho, the residual stream's weight
    input_weights: tuple  # one weight per entry of inputs
    attn: AttentionArgs
    attn_source: Optional[torch.Tensor] = None  # §10 --attn_input_from_layer: attention reads norm(this)
    mudd: Optional["LastBlockMix"] = None  # §10 --mudd: the last block's per-token weights


class Block(nn.Module):
    def __init__(self, config: Hyperparameters, layer: int, dtype: torch.dtype):
        super().__init__()
        self.attn = Attention(config, dtype, layer) if layer in config.attention_layers else None
        self.mlp = MLP(config, dtype)
        self.first = layer == 0  # the first block's input x is x00 itself: its weights fold into one

    def forward(self, x: torch.Tensor, args: BlockArgs) -> torch.Tensor:
        if args.mudd is not None:  # §10 --mudd's last block
            return mudd_last_block(self, x, args)
        # mix the residual stream with every input embedding: x = rho*x + a0*x00 + a1*x01 + ...
        if self.first:  # (rho + a0)*x00 + a1*x01 + ...
            x = (args.resid_weight + args.input_weights[0]) * x
            for lam, x0 in zip(args.input_weights[1:], args.inputs[1:]):
                x = x + lam * x0
        else:
            x = args.resid_weight * x
            for lam, x0 in zip(args.input_weights, args.inputs):
                x = x + lam * x0
        if self.attn is not None:
            attn_in = x if args.attn_source is None else args.attn_source  # §10 --attn_input_from_layer
            x = x + self.attn(rms_norm(attn_in), args.attn)
        return x + self.mlp(rms_norm(x))


# ---- the pieces outside the blocks: value embeddings, the smear, the backout (each switched by its field)

class ValueEmbeddings(nn.Module):
    """The per-layer value embeddings: K tables, layer l looking up table layout[l] (the record:
    K=5, 012..012; --ve_mode=grouped names other groupings). §11's ValueEmbeddingBasis mixes them."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.layout = config.value_embed_tables  # table per layer or None
        self.tables = nn.ModuleList(nn.Embedding(config.table_rows, config.model_dim, dtype=dtype)
                                    for _ in range(config.num_value_embeds))
        # --value_embed_zero_init: zeros (the record), else N(0, 1); --table_multipliers: lr x75, wd x5
        lr_mul, wd_mul = (75.0, 5.0) if config.table_multipliers else (1.0, 1.0)
        for table in self.tables:
            declare(table.weight, "value_embed", zeros if config.value_embed_zero_init else normal_init(1.0),
                    lr_mul, wd_mul, lr="embed_lr")
        self.coeffs = None  # §11's basis: its coefficients

    def forward(self, ids) -> list[Optional[torch.Tensor]]:
        """One (T, d) tensor per layer, or None where the layer has no value embedding."""
        rows = [table(ids) for table in self.tables]
        return [rows[t] if t is not None else None for t in self.layout]


def smear_embedding(e: torch.Tensor, gate: Gate, weight: torch.Tensor) -> torch.Tensor:
    """--smear_embed: e (T, d) with row t >= 1 plus weight * sigmoid(gate(e_t)) * e_(t-1), from the
    unsmeared rows, over the whole packed sequence (a document's first token gets some of the
    previous document's last one). `weight` is the learned scalar, 0 at the start."""
    amount = weight * torch.sigmoid(gate(e[1:]))  # (T-1, 1)
    return torch.cat([e[:1], e[1:] + amount * e[:-1]])


class Backout(nn.Module):
    """--backout: the head's input norm(h - lambda*h_b) from the last block's output h and block
    `layer`'s output h_b; lambda = `weight`, fp32, from 0.5, in the Adam "scalar" group with the
    record's multipliers for its scalars (lr_mul 5, wd_mul 0)."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.weight = declare(nn.Parameter(torch.empty(1, dtype=torch.float32)), "scalar", constant_init([0.5]),
                              lr_mul=5.0, wd_mul=0.0, lr="scalar_lr")

    def forward(self, h: torch.Tensor, h_b: torch.Tensor) -> torch.Tensor:  # (T, d) each
        return rms_norm(h - self.weight[0] * h_b)


# ---- head and loss

class Head(nn.Module):
    """The record's output head: d -> V_pad, fp32 storage, zero init, matmul in the model dtype.
    With --untie_embed_after_step it doubles as the input embedding until the split: then it is
    stored in the model dtype (it is looked up as a table) and starts N(0, 0.005^2).
    --head_transposed stores it (d, V_pad) and computes x @ H; --fp8 (fp8_scales given) makes the
    training product FP8HeadProduct (validation keeps the plain product)."""

    def __init__(self, dim: int, padded_vocab: int, dtype: torch.dtype = torch.float32, init_std: float = 0.0,
                 wd_mul: float = 1.0, transposed: bool = False,
                 fp8_scales: Optional[tuple[float, float, float]] = None):
        super().__init__()
        init = normal_init(init_std) if init_std else zeros
        shape = (dim, padded_vocab) if transposed else (padded_vocab, dim)
        self.weight = declare(nn.Parameter(torch.empty(shape, dtype=dtype)), "head",
                              functools.partial(transposed_draw, init=init) if transposed else init, wd_mul=wd_mul,
                              lr="head_lr")
        self.transposed, self.fp8_scales = transposed, fp8_scales

    def table(self) -> torch.Tensor:
        """The weight as a (V_pad, d) table (a view): row t is token t's vector."""
        return self.weight.t() if self.transposed else self.weight

    def forward(self, x):
        if self.fp8_scales is not None and self.training:  # §8 --fp8
            return FP8HeadProduct.apply(x, self.weight, self.transposed, self.fp8_scales)
        w = self.weight.to(x.dtype)
        return x @ w if self.transposed else F.linear(x, w)


def sigmoid_softcap(z: torch.Tensor) -> torch.Tensor:
    """--logit_softcap_form=sigmoid, in z's dtype."""
    return kernels.SIGMOID_CAP * torch.sigmoid((z + kernels.SIGMOID_SHIFT) / kernels.SIGMOID_TEMPERATURE)


def multi_token_targets(targets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For multi-token prediction: ((T, n) the target k positions after each position's own,
    (T, n) whether that target lies inside the sequence); column 0 is the next-token target."""
    T = targets.numel()
    ahead = torch.arange(T, device=targets.device)[:, None] + torch.arange(n, device=targets.device)[None, :]
    inside = ahead < T
    return targets[ahead.clamp_max(T - 1)], inside


def multi_token_loss(logits: torch.Tensor, targets: torch.Tensor, inside: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """sum_t sum_k w_k (logsumexp(z_t) - z_t[y_(t+k)]): every k from the same logits z_t (n, V),
    targets and inside (n, K) from multi_token_targets, weights (K,). Terms past the sequence are
    zero; no document mask, no normalization by the weights' sum (as the record)."""
    losses = torch.logsumexp(logits, dim=-1, keepdim=True) - logits.gather(1, targets)
    return (torch.where(inside, losses, 0) * weights).sum()


# With --activation_checkpointing the training loss runs in chunks of this many tokens: the fp32
# logits of 8192 tokens x 50304 are 1.6 GB instead of 13 GB for a 65,536-token sequence.
LOSS_CHUNK_TOKENS = 8192


def train_loss_scale(config: Hyperparameters) -> float:
    """The factor the trainer multiplies each slice's loss by before its backward, 1 / (micro-steps x
    ranks) = 1 / batch_slices (the ranks' gradients are then summed: the mean over the step's slices).
    The pr261 fused loss makes its gradient in the forward for exactly this upstream gradient."""
    return 1.0 / config.batch_slices


def scalar_layout(config: Hyperparameters) -> list[tuple[str, list[float]]]:
    """The scalar vector's slots in order, (name, initial values): the record's residual weights,
    attention lambdas, smear weight, skip gains, padding. (Its backout weight, which the record
    also keeps there, is the Backout module's own parameter.) Without --gated_skips a learned
    weight per layer (from 1, used at the skips' sources) comes first."""
    L = config.num_layers
    slots = [] if config.gated_skips else [("skip_w", [1.0] * L)]
    slots += [("resid", [config.residual_scale_init] * L), ("attn_lambdas", [0.5, 1.0] * L)]
    if config.smear_embed:
        slots.append(("smear", [0.0]))
    if config.gated_skips:
        slots.append(("skip_gain", [-1.5] * len(config.skip_connections)))
    # padded, with the backout's weight counted as the record counts it, to a multiple of its GPU count
    backout_weights = 1 if config.backout else 0
    pad = -(sum(len(values) for _, values in slots) + backout_weights) % config.scalar_pad_multiple
    if pad:
        slots.append(("pad", [1.0] * pad))  # unused
    return slots


# ---- the model

class GPT(nn.Module):
    """The record model. All structure comes from `config`; parameters are created empty and
    filled by `init_parameters` (or left unfilled on the meta device). `dtype` (bf16 in the
    record) is the storage of embeddings and the activations' dtype."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        if config.fused_softcap_ce:  # §9: its ops registered before anything compiles (met inside a traced
            kernels.fused_ce_ops()  # forward, the registration itself would break the graph: dynamo cannot trace it)
        V, d, L = config.table_rows, config.model_dim, config.num_layers
        r = config.lore_rank
        self.embeds = nn.ModuleList(
            LowRankEmbedding(V, r, d, config.lore_init, dtype, *self.embed_multipliers(i)) if config.lore_input
            else nn.Embedding(V, d, dtype=dtype) for i in range(1 + config.num_extra_embeds))
        for i, embed in enumerate(self.embeds):
            if not config.lore_input:
                declare(embed.weight, "embed", normal_init(1.0), *self.embed_multipliers(i), lr="embed_lr")
        basis = config.ve_mode in ("learned", "frozen")  # §11 the value-embedding basis
        self.value_embeds = (ValueEmbeddingBasis if basis else ValueEmbeddings)(config, dtype)
        self.skips, self.long_layers = config.skips, config.long_layers  # parsed once, not per step
        self.blocks = nn.ModuleList(Block(config, i, dtype) for i in range(L))
        # --untie_embed_after_step: the head is also the input table until the split, so it is
        # stored in the model dtype and starts N(0, 0.005^2); untied from the start, fp32 and zero
        tied = untie_step(config) > 0
        head_wd_mul = 150.0 if config.table_multipliers else 1.0
        head_options = dict(wd_mul=head_wd_mul, transposed=config.head_transposed,  # §8 --head_transposed, --fp8
                            fp8_scales=fp8_training_scales(config) if config.fp8 else None)
        self.head = (LowRankHead(d, r, config.padded_vocab_size, config.lore_init, head_wd_mul) if config.lore_output
                     else Head(d, config.padded_vocab_size, dtype, init_std=0.005, **head_options) if tied
                     else Head(d, config.padded_vocab_size, **head_options))
        # one fp32 vector of named slots (scalar_layout): residual weights, attention lambdas, ...;
        # --table_multipliers: lr x5, no weight decay
        self.scalar_layout = scalar_layout(config)
        self.scalars = declare(nn.Parameter(torch.empty(sum(len(v) for _, v in self.scalar_layout),
                                                        dtype=torch.float32)),
                               "scalar", constant_init([v for _, values in self.scalar_layout for v in values]),
                               *((5.0, 0.0) if config.table_multipliers else (1.0, 1.0)), lr="scalar_lr")
        # per layer the weights of x00, x01, ... at the block's input (L x (1 + extra)); lr multiplier
        # 5, no weight decay, zero at the start
        self.x0_lambdas = declare(nn.Parameter(torch.empty(L * (1 + config.num_extra_embeds), dtype=torch.float32)),
                                  "x0_lambdas", zeros, lr_mul=5.0, wd_mul=0.0, lr="x0_lambdas_lr"
                                  ) if not config.mudd_gate else None  # §18 --mudd_gate sets them per token
        # --x00_at_output: final x = w0 * norm(x) + w1 * x00 (rejected upstream), starting as the
        # record (x00 weighted 0)
        self.output_mix = (declare(nn.Parameter(torch.empty(2, dtype=torch.float32)), "scalar",
                                   constant_init([1.0, 0.0]), lr="scalar_lr") if config.x00_at_output else None)
        self.backout = Backout(config.backout_layer) if config.backout else None
        self.bigram = BigramEmbedding(config, dtype) if config.bigram_embed else None  # §9 --bigram_embed
        self.mudd = Mudd(config) if config.mudd else None  # §10 --mudd
        self.prefix = PrefixTargets(config) if config.prefix_loss_weight else None  # §16 --prefix_loss_weight
        self.gate_net = MuddGate(config) if config.mudd_gate else None  # §18 --mudd_gate
        # --smear_embed and --gated_skips: (1, 16) gates, Adam group gates, lr multiplier 0.01, no decay
        self.smear_gate = Gate(1, dtype, lr_mul=0.01, wd_mul=0.0, group="gates") if config.smear_embed else None
        self.skip_gates = (nn.ModuleList(Gate(1, dtype, lr_mul=0.01, wd_mul=0.0, group="gates")
                                         for _ in config.skip_connections)
                           if config.gated_skips and not config.mudd_gate else None)  # §18 --mudd_gate sets them
        self.skip_index = {target: j for j, (target, _) in enumerate(config.skip_connections)}
        # rotary tables and the attention scale as buffers, rewritten in place by YaRN
        self.rotary = RotaryTables(config)
        # a Python flag: embeds[0] gets no gradient at all until the split; a compiled model
        # compiles each state once
        self.embed_tied = tied

    def embed_multipliers(self, i: int) -> tuple[float, float]:
        """--table_multipliers: x00's table as the head (it becomes its copy), lr x1 wd x150; the
        others lr x75 wd x5."""
        if not self.config.table_multipliers:
            return 1.0, 1.0
        return (1.0, 150.0) if i == 0 else (75.0, 5.0)

    def scalar_slots(self) -> dict[str, torch.Tensor]:
        """Views of the scalar vector by slot name (scalar_layout)."""
        names, sizes = zip(*((name, len(values)) for name, values in self.scalar_layout))
        return dict(zip(names, self.scalars.split(list(sizes))))

    def mixing_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer, the block input's weight on the residual stream (L,) and on each input
        embedding (L, 1 + extra)."""
        return self.scalar_slots()["resid"], (None if self.x0_lambdas is None  # §18 --mudd_gate
                                              else self.x0_lambdas.view(self.config.num_layers, -1))

    def forward(self, input_seq: torch.Tensor, target_seq: torch.Tensor, window,
                reduction: Optional[str] = None, mtp_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Cross-entropy of one packed sequence. input_seq (T,) int32, target_seq (T,) int64; window:
        the [long, short] windows in blocks (a device tensor, so a new value needs no recompile; two
        numbers for fa3). reduction: "mean", "sum" or "none" (per token, (T,)); default:
        --train_loss_reduction in training mode, the mean in evaluation. mtp_weights (K,) (training
        only): the multi-token prediction loss with these weights; None: the next-token loss."""
        cfg = self.config
        T = input_seq.numel()
        reduction = reduction or (cfg.train_loss_reduction if self.training else "mean")
        (long_mask, short_mask), cos, sin, scale, scale_tensor = self.attention_inputs(input_seq, window)
        x0s = self.input_embeddings(input_seq)  # each (1, T, d)
        ves = self.value_embeds(input_seq)  # per layer (T, d) or None
        slots = self.scalar_slots()
        resid_weights, x0_weights = self.mixing_weights()
        attn_lambdas = slots["attn_lambdas"].view(cfg.num_layers, 2)
        # activation checkpointing keeps only each block's input and recomputes the block in backward
        recompute = cfg.activation_checkpointing and torch.is_grad_enabled()
        block_inputs, bigram_rows, gammas = x0s, None, None
        if self.bigram is not None:  # §9 --bigram_embed: gamma_i x its rows, the last term of block i's mixing
            bigram_rows, gammas = self.bigram(input_seq)
            block_inputs = x0s + [bigram_rows]
        attn_from = cfg.attn_input_from_layer  # §10: the blocks after it attend from its output
        x, outputs, last_mix = x0s[0], [], None
        nets = gated = None  # §18 --mudd_gate
        for i, block in enumerate(self.blocks):
            if self.gate_net is not None:  # §18 --mudd_gate: net 0 before block 0, net 1 at mudd_gate_layer's input
                nets, gated = self.gate_net.at_block(i, x, x0s[0], input_seq, nets, slots)
            if i in self.skips:
                skip = self.skip_weight(i, x0s[0], slots) if gated is None or gated.skip is None \
                    else gated.skip  # §18 --mudd_gate
                x = x + skip * outputs[self.skips[i]]
            mask = long_mask if i in self.long_layers else short_mask
            attn = AttentionArgs(ves[i], attn_lambdas[i], cos, sin, mask, scale, scale_tensor,
                                 gated=None if gated is None else gated.attn)  # §18 --mudd_gate
            weights = (x0_weights[i] if gammas is None else (*x0_weights[i], gammas[i])) if gated is None \
                else gated.input_weights  # §18 --mudd_gate
            args = BlockArgs(block_inputs, resid_weights[i], weights, attn, mudd=last_mix,  # §10 --mudd
                             attn_source=outputs[attn_from] if attn_from is not None and i > attn_from else None)
            x = checkpoint(block, x, args, use_reentrant=False) if recompute else block(x, args)
            outputs.append(x)
            if self.mudd is not None:  # §10 --mudd: after block L-2 its penultimate net mixes the stream
                x, last_mix = self.mudd.after_block(i, x, x0s[0], outputs, bigram_rows)
        if self.mudd is not None:  # §10 --mudd: its final mix, in place of the backout
            x = self.mudd.before_head(x, x0s[0], outputs, ves)
        if self.backout is not None:
            x = self.backout(x[0], outputs[self.backout.layer][0])  # (T, d)
        else:
            x = rms_norm(x[0])  # (T, d)
        if self.output_mix is not None:  # §11 --x00_at_output
            x = self.output_mix[0] * x + self.output_mix[1] * x0s[0][0]
        # with recomputation the (T, V) logits would dominate memory: one recomputed chunk at a time
        num_chunks = max(T // LOSS_CHUNK_TOKENS, 1) if recompute else (1 if self.training else 4)
        return self.loss(x, target_seq, num_chunks, reduction, recompute,
                         mtp_weights if self.training else None)

    def attention_inputs(self, input_seq: torch.Tensor, window) -> tuple:
        """What every layer's attention reads in this forward: the (long, short) masks of the backend,
        the rotary tables (T, head_dim // 2) and the softmax scale (a number, or None and a 0-d tensor)."""
        cfg, T = self.config, input_seq.numel()
        backend = attention_backend(cfg, input_seq.device.type)
        if backend == "fa3":  # the windows as numbers (Runner.window)
            masks = varlen_windows(input_seq, window, cfg, self.training)
        else:
            masks = token_window_masks(input_seq, window[0], window[1], cfg, backend,
                                       flex_mask_block(cfg, input_seq.device.type))
        scale, scale_tensor = cfg.attn_scale, None
        if cfg.yarn_window_limit:  # a scale that changes: the tensor for flex, its float for SDPA and FA3
            scale, scale_tensor = (None, self.rotary.scale) if backend == "flex" else (self.rotary.scale_value, None)
        return masks, self.rotary.cos[:T], self.rotary.sin[:T], scale, scale_tensor

    def input_embeddings(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """x00, x01, ...: each input embedding of the tokens, RMS-normed, (1, T, d). x00's table is
        the head matrix while tied (--untie_embed_after_step), then smeared (--smear_embed)."""
        if not self.embed_tied and self.smear_gate is None:
            return [rms_norm(embed(ids))[None] for embed in self.embeds]
        first = F.embedding(ids, self.head.table()) if self.embed_tied else self.embeds[0](ids)
        if self.smear_gate is not None:
            first = smear_embedding(first, self.smear_gate, self.scalar_slots()["smear"][0])
        return [rms_norm(first)[None]] + [rms_norm(embed(ids))[None] for embed in self.embeds[1:]]

    def skip_weight(self, target: int, x00: torch.Tensor, slots: dict) -> torch.Tensor:
        """The U-net skip into block `target`: a learned weight (of the source layer), or with
        --gated_skips sigmoid(gain) * 2 sigmoid(gate(x00)), (1, T, 1)."""
        if self.skip_gates is None:
            return slots["skip_w"][self.skips[target]]
        j = self.skip_index[target]
        return torch.sigmoid(slots["skip_gain"][j]) * 2 * torch.sigmoid(self.skip_gates[j](x00))

    @torch.no_grad()
    def untie_embedding(self, optimizers) -> None:
        """The split of --untie_embed_after_step: the input embedding becomes a copy of the head
        matrix, and in every optimizer that holds state for the head, its state becomes a copy of
        the head's (tensors cloned: moments, step counts), so it goes on as if it had been trained
        as the head so far. From now on the forward reads it. A --head_transposed head's weight and
        moments are transposed into the table's layout."""
        head, table = self.head.weight, self.embeds[0].weight
        table.copy_(self.head.table())
        for opt in optimizers:
            if head in opt.state:  # Adam's (CautiousAdam.copy_state: its sharded rows included)
                if isinstance(opt, CautiousAdam):
                    opt.copy_state(head, table, transposed=self.head.transposed)  # §8 --head_transposed
                else:  # any other torch optimizer (the tests'): every tensor of the head's shape, as a table
                    as_table = (lambda t: t.t().contiguous()) if self.head.transposed else (lambda t: t.clone())
                    opt.state[table] = {k: as_table(v) if torch.is_tensor(v) and v.shape == head.shape
                                        else v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                        for k, v in opt.state[head].items()}
        self.embed_tied = False

    def loss(self, x: torch.Tensor, targets: torch.Tensor, num_chunks: int, reduction: str = "mean",
             recompute: bool = False, mtp_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Soft-capped logits and cross-entropy (or the multi-token loss); chunks bound the (T, V)
        logits' memory. reduction: mean, sum or none (per token)."""
        per_token = reduction == "none"
        prefix = self.prefix.terms(targets) if self.prefix is not None and self.training else None  # §16 (p(y), w)
        if prefix is not None and mtp_weights is None:  # §16 --prefix_loss_weight: it rides the multi-token loss
            mtp_weights = torch.ones(1, device=x.device)
        if self.config.fused_softcap_ce and self.training and not per_token:  # §9 --fused_softcap_ce
            return fused_training_loss(self, x, targets, reduction, mtp_weights, prefix)  # §16 prefix: (p(y), w)
        if mtp_weights is not None and not per_token:
            ahead, inside = multi_token_targets(targets, mtp_weights.numel())
            if prefix is not None:  # §16 --prefix_loss_weight: one more column, the prefix target
                ahead, inside, mtp_weights = prefix_columns(ahead, inside, mtp_weights, prefix)
            part = lambda xc, tc, ic: multi_token_loss(self.logits(xc), tc, ic, mtp_weights)
            chunks = zip(x.chunk(num_chunks), ahead.chunk(num_chunks), inside.chunk(num_chunks))
            parts = [checkpoint(part, *c, use_reentrant=False) if recompute else part(*c) for c in chunks]
        else:
            parts = [checkpoint(self.chunk_loss, xc, tc, per_token, use_reentrant=False) if recompute
                     else self.chunk_loss(xc, tc, per_token)
                     for xc, tc in zip(x.chunk(num_chunks), targets.chunk(num_chunks))]
        if per_token:
            return torch.cat(parts)
        # bf16 chunk sums (the sigmoid cap in training) are added in fp32
        total = sum(parts) if len(parts) == 1 or parts[0].dtype == torch.float32 else sum(p.float() for p in parts)
        return total if reduction == "sum" else total / targets.numel()

    def chunk_loss(self, x: torch.Tensor, targets: torch.Tensor, per_token: bool) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), targets, reduction="none" if per_token else "sum")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Soft-capped logits (n, V_pad) of final-normed rows x. rational: 15 z / sqrt(z^2 + 225) in fp32.
        --logit_softcap_form=sigmoid: in the model dtype in training, fp32 in evaluation."""
        if self.config.logit_softcap_form == "sigmoid":
            z = self.head(x)
            return sigmoid_softcap(z if self.training else z.float())
        cap, z = self.config.logit_softcap, self.head(x).float()
        return cap * z * torch.rsqrt(z.square() + cap * cap)

# ---- initialization: one random stream per parameter (matched init across configurations)

def _param_generator(seed: int, name: str) -> torch.Generator:
    """A random stream of its own for each parameter: adding or removing other modules never
    changes this parameter's initial values (matched initialization across configurations)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@torch.no_grad()
def init_parameters(model: GPT, seed: int) -> None:
    """Every parameter starts as it declared (`declare`): drawn in fp32 on the CPU from the stream of
    its name, then cast and copied. The frozen value-embedding coefficients are a buffer."""
    for name, p in model.named_parameters():
        p.copy_(p.init(p.shape, _param_generator(seed, name)))
    if model.bigram is not None and model.bigram.signs is not None:  # §14 --bigram_sign_rows
        model.bigram.signs.fill(seed)  # §14 --bigram_sign_rows: its fixed table, from a stream of its own name
    if model.value_embeds.coeffs is not None and not isinstance(model.value_embeds.coeffs, nn.Parameter):
        model.value_embeds.coeffs.copy_(model.value_embeds.initial_coeffs())
    model.rotary.changes = None
    model.rotary.set_changes(())  # the base tables
    if model.prefix is not None:  # §16 --prefix_loss_weight: its table, from the token byte files
        model.prefix.fill_table()
    reset_fp8_down_scales(model)  # §17 --fp8_mlp_down: its scales' starting values (no module without it)


def weight_dtype(config: Hyperparameters, device) -> torch.dtype:
    """bf16 is the record; CPUs without bf16 matrix units run it 10-15x slower than fp32, so
    `auto` picks fp32 there (the bf16 paths stay covered by the tests)."""
    if config.dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return getattr(torch, config.dtype)


def build_model(config: Hyperparameters, device="cpu") -> GPT:
    """The model on `device`, initialized; on the meta device, shapes only."""
    with torch.device("meta"):
        model = GPT(config, weight_dtype(config, device))
    if torch.device(device).type == "meta":
        return model
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}  # lr_mul, wd_mul, ...
    model.to_empty(device=device)  # new Parameter objects: the attributes set at creation are put back
    for name, p in model.named_parameters():
        p.__dict__.update(attributes[name])
    init_parameters(model, config.init_seed)
    return model


# The optimizer groups in the order the accounting lists them. Adam: head, tables, coefficients,
# scalars, x0 weights, small gates; Muon: the matrices in the blocks, LoRE's small dense factors,
# the heads' gates. A new idea may declare a group of its own (it follows these).
GROUP_ORDER = ("head", "embed", "value_embed", "ve_coeff", "scalar", "muon_attn", "muon_mlp", "muon_lore",
               "x0_lambdas", "gates", "muon_gates")


def parameter_groups(model: GPT) -> dict[str, list[nn.Parameter]]:
    """Every parameter in the optimizer group it declared, in GROUP_ORDER (groups with nothing are
    left out), each group's parameters in the model's order."""
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_ORDER}
    for p in model.parameters():
        groups.setdefault(p.group, []).append(p)
    return {name: ps for name, ps in groups.items() if ps}

# =============================================================================
# 5. Data: shards of uint16 GPT-2 tokens behind a 256 x int32 header

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256


class InputError(Exception):
    """Bad input from the user (flags, data files, checkpoints): main prints the message, exit code 2."""


class ShardError(InputError, ValueError):
    """A shard file that cannot be used; the message names the file and the problem."""


def shard_token_count(path) -> int:
    """Validate a shard's header against its size; return its token count."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_INTS * 4:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_INTS * 4}-byte header (truncated file?)")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {SHARD_MAGIC}); not a token shard")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    claimed, present = int(header[2]), (size - HEADER_INTS * 4) // 2
    if present < claimed:
        raise ShardError(f"{path}: header claims {claimed} tokens but the file holds {present} (truncated download?); "
                         "delete it and download it again")
    return claimed


def read_shard(path) -> torch.Tensor:
    """All tokens of a validated shard as a uint16 CPU tensor."""
    n = shard_token_count(path)
    tokens = np.fromfile(path, dtype=np.uint16, count=n, offset=HEADER_INTS * 4)
    return torch.from_numpy(tokens)


class DataLoader:
    """Consecutive steps of `batch_slices` contiguous slices of `seq_len` tokens (+1 for the last
    target) across sorted shards; a shard's tail that cannot hold a whole step is skipped.

    This rank yields its slices rank*k .. rank*k + k-1 (k = batch_slices // world_size) as the
    (inputs int32, targets int64) micro-batches it accumulates; every world size sees the
    same tokens per step as the 8-GPU record.
    """

    def __init__(self, files: list[str], seq_len: int, batch_slices: int, rank: int, world_size: int, device):
        self.files, self.seq_len, self.batch_slices, self.device = files, seq_len, batch_slices, torch.device(device)
        self.host_inputs: list[torch.Tensor] = []  # the last batch's inputs on the host (train_step's host_inputs)
        k = batch_slices // world_size
        self.slices = range(rank * k, (rank + 1) * k)
        self.file_index, self.position, self.tokens = 0, 0, None

    def _load(self):
        self.tokens = read_shard(self.files[self.file_index])
        if self.device.type == "cuda":
            self.tokens = self.tokens.pin_memory()

    def next_batch(self, seq_len: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches of slices of `seq_len` tokens (a batch ramp's step size), or of the loader's."""
        seq_len = seq_len or self.seq_len
        step_tokens = self.batch_slices * seq_len
        if self.tokens is None:
            self._load()
        while self.position + step_tokens + 1 > self.tokens.numel():
            self.file_index, self.position = self.file_index + 1, 0
            if self.file_index >= len(self.files):
                raise RuntimeError(f"ran out of data: {len(self.files)} shard(s) hold fewer steps than requested")
            self._load()
        batches, self.host_inputs = [], []
        for s in self.slices:
            start = self.position + s * seq_len
            host = self.tokens[start:start + seq_len + 1]
            buf = host.to(device=self.device, dtype=torch.int32, non_blocking=True)
            batches.append((buf[:-1], buf[1:].to(torch.int64)))
            self.host_inputs.append(host[:-1])  # the §9 bigram exchange's rows, read on the host
        self.position += step_tokens
        return batches


class DocumentAlignedLoader:
    """Training slices of whole documents (--document_aligned_batches), as the 2025-12-31 record's
    8 GPUs read them: slice k of a step is its k-th GPU's sequence, whatever the world size.

    A document runs from an end-of-text token (which starts it) to the next one; a piece is a
    document's first min(length, cut_tokens) tokens. Slice 0 of a step takes pieces in shard order
    until it holds slice_tokens + 1 tokens, its last piece cut short to fit exactly; the rest of
    that document is dropped and slice 1 starts at the next document, and so on. Inputs are the
    first slice_tokens tokens, targets the same shifted by one (so a cut piece's last position
    predicts the next piece's end-of-text). Tokens before a shard's first end-of-text are never
    used. When a step's slices do not all fit in what is left of the shard, that step is taken
    whole from the start of the next shard instead. Each slice starts with an end-of-text and
    holds no other, so its documents are exactly the runs between its end-of-text tokens.

    This rank yields its slices rank*k .. rank*k + k-1 (k = num_slices // world_size) as
    (inputs int32, targets int64) micro-batches. The position (the shard and the token where the
    next step's first document starts) is what a checkpoint saves; the step size is an argument of
    each call, so a resumed run continues with the same tokens across a batch-size change.
    """

    def __init__(self, files: list[str], num_slices: int, cut_tokens: int, eot_token: int, rank: int,
                 world_size: int, device):
        self.files, self.num_slices, self.cut_tokens, self.eot = files, num_slices, cut_tokens, eot_token
        self.device = torch.device(device)
        self.host_inputs: list[torch.Tensor] = []  # the last batch's inputs on the host (train_step's host_inputs)
        k = num_slices // world_size
        self.slices = range(rank * k, (rank + 1) * k)
        self.file_index, self.position, self.tokens = 0, 0, None

    def _load(self):
        """Read the shard and index its documents: starts (n,) token positions of the end-of-text
        tokens; ends[i] = tokens in pieces 0 .. i-1 (n+1,), so pieces i .. j-1 hold ends[j] - ends[i]."""
        self.tokens = read_shard(self.files[self.file_index]).numpy()
        self.starts = np.flatnonzero(self.tokens == self.eot)
        lengths = np.diff(self.starts, append=self.tokens.size)
        self.ends = np.concatenate([[0], np.cumsum(np.minimum(lengths, self.cut_tokens))])
        self.next_doc = int(np.searchsorted(self.starts, self.position))  # the first document at or after position

    def _walk(self, seq_len: int) -> Optional[list[tuple[np.ndarray, np.ndarray]]]:
        """(piece starts, piece lengths) of every slice of one step from the next document on, or
        None if the shard's documents run out first."""
        doc, plan = self.next_doc, []
        for _ in range(self.num_slices):
            need = self.ends[doc] + seq_len + 1
            stop = int(np.searchsorted(self.ends, need))  # the fewest pieces doc .. stop-1 that hold seq_len + 1
            if stop >= self.ends.size:
                return None
            lengths = np.diff(self.ends[doc:stop + 1])
            lengths[-1] -= self.ends[stop] - need  # the last piece cut to fit
            plan.append((self.starts[doc:stop], lengths))
            doc = stop
        self.next_doc = doc
        return plan

    def next_batch(self, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches, each slice seq_len tokens."""
        if self.tokens is None:
            self._load()
        while (plan := self._walk(seq_len)) is None:
            self.file_index, self.position = self.file_index + 1, 0
            if self.file_index >= len(self.files):
                raise ShardError(f"--train_files: the documents of the {len(self.files)} shard(s) ran out before "
                                 "the run's last step; add shards or lower --num_iterations")
            self._load()
        self.position = int(self.starts[self.next_doc]) if self.next_doc < self.starts.size else int(self.tokens.size)
        batches, self.host_inputs = [], []
        for s in self.slices:
            starts, lengths = plan[s]
            offsets = np.cumsum(lengths) - lengths  # where each piece begins in the slice
            index = np.repeat(starts - offsets, lengths) + np.arange(seq_len + 1)
            host = torch.from_numpy(self.tokens[index].astype(np.int32))
            if self.device.type == "cuda":
                host = host.pin_memory()
            buf = host.to(self.device, non_blocking=True)
            batches.append((buf[:-1], buf[1:].to(torch.int64)))
            self.host_inputs.append(host[:-1])  # the §9 bigram exchange's rows, read on the host
        return batches


def train_loader(config: Hyperparameters, files: list[str], rank: int, world_size: int, device):
    """The training data loader a run uses: contiguous slices, or whole documents."""
    if config.document_aligned_batches:
        return DocumentAlignedLoader(files, config.batch_slices, config.document_cut_tokens, config.eot_token,
                                     rank, world_size, device)
    return DataLoader(files, config.train_seq_len, config.batch_slices, rank, world_size, device)

# =============================================================================
# 6. Training: optimizers, one step, evaluation, warm-up, the timed loop

# Muon group options: the attention weight is orthogonalized as its 4 row blocks (q, k, v, o);
# the MLP's last Polar Express product is split (as the record does); the gates keep their state
# in their own dtype.
MUON_GROUP_OPTIONS = dict(muon_attn=dict(blocks=4), muon_mlp=dict(split_last_product=True), muon_gates=dict(gate=True))


def build_optimizers(model: GPT, config: Hyperparameters, rank: int, world_size: int,
                     compile_updates: bool = False, collectives: Optional["Collectives"] = None
                     ) -> list[torch.optim.Optimizer]:
    """Adam for the head, the embeddings, the scalars and the small gates; Muon for the matrices
    inside the blocks and the heads' gates (the updates the records compile compiled with
    `compile_updates`: Muon's, and #252's fp32 Adam step). A parameter's `lr_mul` / `wd_mul` attributes
    multiply its group's lr / decay in both. `collectives`: the run's, on more than one rank."""
    cfg = config
    adam_groups, muon_groups = optimizer_groups(model, config)
    adam = CautiousAdam(adam_groups, lr=cfg.head_lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                        weight_decay=cfg.adam_weight_decay, fp32_moments=cfg.adam_fp32_moments,  # §9
                        rank=rank, world_size=world_size, compile_update=compile_updates, collectives=collectives)
    muon_args = dict(lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay,
                     rank=rank, world_size=world_size, compile_update=compile_updates, collectives=collectives)
    muon = Muon(muon_groups, **muon_args, orthogonalization=cfg.orthogonalization,
                row_normalization=cfg.muon_row_normalization, row_beta2=cfg.muon_row_beta2,
                cautious_weight_decay=cfg.muon_cautious_weight_decay, lr_shape=cfg.muon_lr_shape,
                scalar_rounding=cfg.muon_scalar_rounding)  # §9 --muon_scalar_rounding
    optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def optimizer_groups(model: GPT, config: Hyperparameters) -> tuple[list[dict], list[dict]]:
    """(Adam's param groups, Muon's) from what each parameter declared: an Adam group's lr from the
    field its parameters name, its betas adam_beta1/2 (the scalars' and, with §9
    --small_params_betas=scalar, the x0 weights' and gates': scalar_adam_beta1/2; a parameter's own
    betas win inside CautiousAdam); a muon_* group's options from MUON_GROUP_OPTIONS."""
    cfg, groups = config, parameter_groups(model)
    betas, scalar_betas = (cfg.adam_beta1, cfg.adam_beta2), (
        cfg.adam_beta1 if cfg.scalar_adam_beta1 is None else cfg.scalar_adam_beta1,
        cfg.adam_beta2 if cfg.scalar_adam_beta2 is None else cfg.scalar_adam_beta2)
    group_betas = dict(scalar=scalar_betas)
    if cfg.small_params_betas == "scalar":  # §9 #252: the x0 weights and small gates step like the scalars
        group_betas.update(x0_lambdas=scalar_betas, gates=scalar_betas)
    adam = [dict(params=ps, lr=getattr(cfg, adam_lr_field(name, ps)), name=name, betas=group_betas.get(name, betas))
            for name, ps in groups.items() if not name.startswith("muon")]
    muon = [dict(params=ps, name=name, **MUON_GROUP_OPTIONS.get(name, {}))
            for name, ps in groups.items() if name.startswith("muon")]
    add_qk_groups(muon, cfg)  # §13 --muon_qk_group_heads
    return adam, muon


def adam_lr_field(group: str, params: list[nn.Parameter]) -> str:
    """The Hyperparameters field of an Adam group's lr, as its parameters declared it (one for all)."""
    named = {p.lr_field for p in params}
    if len(named) != 1 or None in named:
        raise ValueError(f"parameter group {group}: its parameters name the Adam lr fields {sorted(map(str, named))}; "
                         "each must declare one, the same (declare(..., lr=...)), or be in a muon_ group")
    return named.pop()


def set_schedules(optimizers, step: int, config: Hyperparameters) -> None:
    """Each group's lr for `step`; Muon's momentum."""
    mult, momentum = lr_schedule(step, config), momentum_schedule(step, config)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
            if isinstance(opt, Muon):
                group["momentum"] = momentum


# ---- the exchange: who sends which gradient and which weights to whom, and who holds what (the
#      records' machine plan: docs/bulk-optimizers.md, "The exchange")

ADAM_SHARD_MIN_ELEMENTS = 1024  # smaller Adam tensors are all-reduced and stepped whole on every rank, as the records'


def adam_rows(p: torch.Tensor, rank: int, world_size: int) -> Optional[tuple[int, int]]:
    """The rows [start, stop) of an Adam tensor whose moments this rank holds and steps: its 1/W share
    of the first dimension, for tensors of at least 1024 elements whose rows split W ways (the records'
    sharded Adam); None for any other (and at world size 1): all-reduced, stepped whole on every rank."""
    if world_size == 1 or p.numel() < ADAM_SHARD_MIN_ELEMENTS or p.shape[0] % world_size:
        return None
    rows = p.shape[0] // world_size
    return rank * rows, (rank + 1) * rows


class Collectives:
    """The optimizers' collectives, every one through here: torch.distributed's asynchronous calls on
    the run's process group (world_size ranks, this one `rank`), each named by the parameter group it
    moves. The dry run and the bench count these same calls through CountedCollectives (Part III)."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank
        self.in_place_gather = False  # set by the Runner on NCCL: an all-gather may read its input from its output

    def all_reduce(self, t: torch.Tensor, group: str):
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: str):
        """out (n, ...) <- the sum over ranks of this rank's n rows of inp (W n, ...)."""
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch 2.13 / 2.11
        return scatter(out, inp, op=dist.ReduceOp.SUM, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str):
        """out (W n, ...) <- every rank's inp (n, ...), in rank order."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 / 2.11
        return gather(out, inp, async_op=True)

    def all_gather_list(self, outs: list[torch.Tensor], inp: torch.Tensor, group: str):
        """outs[r] <- rank r's inp (every one of inp's shape)."""
        return dist.all_gather(outs, inp, async_op=True)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: str):
        """Rank r's in_splits[s] rows of inp go to rank s; out holds what each rank sent here, in rank order."""
        return dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)


class _MuonBucket:
    """W matrices of one Muon shape group (the last bucket of a group may hold fewer): rank r owns the
    r-th. Their gradients are stacked as they arrive, and reduce-scattered once all have."""

    def __init__(self, params: list[nn.Parameter], group: str):
        self.params, self.group, self.stack, self.arrived, self.out = params, group, None, 0, None


class GradientExchange:
    """Where each gradient goes once it is final (a hook in the last micro-batch's backward, so the
    exchange overlaps the rest of the backward), as the records send it:
      Muon matrices   stacked W at a time within their shape group (zero-padded, as the records pad),
                      reduce-scattered: each rank receives the sum of the one matrix of the W it owns
                      (Muon.owned; the others' gradients are freed once stacked);
      sharded Adam    (adam_rows) reduce-scattered by rows: each rank receives the sum of its rows;
      whole Adam      all-reduced in place;
      the bigram table, with bigram_exchange_is_sparse: after the backward, each rank sends the rows its
                      own tokens touched to the ranks owning them (counts, indices, rows), and adds what
                      it receives to its own rows, rank by rank.
    The loss is pre-divided by world size x micro-steps, so every sum is the global mean. Adam's tensors
    in `held` (on an even step of --adam_odd_steps_only) keep their local gradient on their rank for the
    next backward to add to. After wait(), the owner of a Muon matrix finds its sum in p.grad (its other
    ranks None), and reduced[p] is the summed gradient of what this rank steps of an Adam tensor."""

    def __init__(self, adam_groups: list[dict], muon_groups: list[dict], rank: int, world_size: int,
                 collectives: "Collectives", sparse_table: Optional[nn.Parameter] = None, hooks: bool = True):
        """The groups as the optimizers hold them (dicts with params and a name); hooks: on every
        parameter of the groups (off: the dry run hands each gradient over itself)."""
        self.rank, self.world_size, self.collectives = rank, world_size, collectives
        self.armed, self.held, self.pending, self.reduced = False, frozenset(), [], {}
        self.sparse_table = sparse_table
        self.touched = None if sparse_table is None else np.zeros(sparse_table.shape[0], dtype=bool)
        self.plan: dict[nn.Parameter, tuple] = {}  # p -> (kind, its Muon bucket or its Adam group's name)
        self.slot: dict[nn.Parameter, int] = {}  # a Muon matrix's place in its bucket (= its owner's rank)
        for group in muon_groups:
            params = group["params"]
            for base in range(0, len(params), world_size):
                bucket = _MuonBucket(params[base:base + world_size], group["name"])
                for slot, p in enumerate(bucket.params):
                    self.plan[p] = ("muon", bucket)
                    self.slot[p] = slot
        for group in adam_groups:
            for p in group["params"]:
                rows = adam_rows(p, rank, world_size)
                kind = "sparse" if p is sparse_table else "whole" if rows is None else "rows"
                self.plan[p] = (kind, group.get("name", "adam"))
        self.buckets = list({id(b): b for kind, b in self.plan.values() if kind == "muon"}.values())
        if world_size > 1 and hooks:
            for p in self.plan:
                p.register_post_accumulate_grad_hook(self.arrive)

    def arrive(self, p: nn.Parameter) -> None:
        """p's gradient is final for this step (the hook): start its exchange."""
        if not self.armed or p in self.held:
            return
        kind, where = self.plan[p]
        coll, W = self.collectives, self.world_size
        if kind == "muon":
            bucket = where
            if bucket.stack is None:
                bucket.stack = p.grad.new_empty(W, *p.shape)
                bucket.stack[len(bucket.params):].zero_()  # the padding of a group's last bucket
            bucket.stack[self.slot[p]].copy_(p.grad)
            p.grad = None  # the stack holds it now
            bucket.arrived += 1
            if bucket.arrived == len(bucket.params):
                bucket.out = bucket.stack.new_empty(1, *p.shape)
                self.pending.append(coll.reduce_scatter(bucket.out, bucket.stack, bucket.group))
        elif kind == "rows":
            out = p.grad.new_empty(p.shape[0] // W, *p.shape[1:])
            self.pending.append(coll.reduce_scatter(out, p.grad, where))
            self.reduced[p] = out
        elif kind == "whole":
            self.pending.append(coll.all_reduce(p.grad, where))
            self.reduced[p] = p.grad

    def reset(self) -> None:
        """Nothing touched, nothing half-exchanged (after the warm-up's restore)."""
        if self.touched is not None:
            self.touched[:] = False
        self.reduced.clear()

    def touch(self, host_inputs: torch.Tensor) -> None:
        """A micro-batch's inputs (T,) on the host: the bigram rows its tokens read (the sparse exchange's
        rows to send), a mask over the table's rows until the next exchange (#261's)."""
        if self.touched is not None:
            self.touched[bigram_ids(host_inputs.cpu(), self.touched.size).numpy()] = True

    def wait(self) -> None:
        """After the backward: the sparse rows, then every exchange complete."""
        table = self.sparse_table
        if table is not None and table not in self.held and table.grad is not None:
            self.reduced[table] = send_touched_rows(self, table)  # §9 the bigram table's rows to their owners
            table.grad = None
        for work in self.pending:
            work.wait()
        self.pending.clear()
        for bucket in self.buckets:
            if bucket.out is None:
                continue
            for r, p in enumerate(bucket.params):
                p.grad = bucket.out[0] if r == self.rank else None
            bucket.stack, bucket.arrived, bucket.out = None, 0, None
        for p in self.reduced:
            if self.plan[p][0] == "rows":
                p.grad = None  # its rows' sum is in reduced[p]


NO_STEP = 2**62  # "no non-finite loss yet"; a step number larger than any run


def compile_enabled(config: Hyperparameters, device: torch.device) -> bool:
    """--compile, where auto means on for CUDA and off elsewhere (the CPU path stays eager)."""
    return config.compile if config.compile is not None else device.type == "cuda"


class Runner:
    """Holds what a training run needs: model (compiled or not), optimizers, devices, ranks.
    `collectives`: the optimizers' on more than one rank (None: a Collectives of its own)."""

    def __init__(self, config: Hyperparameters, device: torch.device, rank: int = 0, world_size: int = 1,
                 collectives: Optional[Collectives] = None):
        self.config, self.device, self.rank, self.world_size = config, device, rank, world_size
        self.micro_steps = config.batch_slices // world_size
        make_fp8_head_kernels(config, device.type)  # §8 --fp8
        self.model = build_model(config, device)
        self.fp8_downs = fp8_down_modules(self.model)  # §17 --fp8_mlp_down: its scales, found once
        if world_size > 1:
            for p in self.model.parameters():
                dist.broadcast(p.detach(), 0)
        use_compile = compile_enabled(config, device)
        self.backend = attention_backend(config, device.type)
        if self.backend == "fa3":
            kernels.flash_attention_3()  # fetched before anything is compiled
        # more than one rank: every collective of the optimizers through one Collectives (the bench's counts them)
        self.collectives = (collectives or Collectives(world_size, rank)) if world_size > 1 else None
        if self.collectives is not None:
            self.collectives.in_place_gather = device.type == "cuda"  # NCCL gathers from inside its output
        self.optimizers = build_optimizers(self.model, config, rank, world_size, compile_updates=use_compile,
                                           collectives=self.collectives)
        if use_compile:
            fail_instead_of_eager_fallback()
        # --adam_odd_steps_only: on even steps Adam's gradients stay on each rank, unreduced, and the
        # next backward adds to them; Adam then steps on the sum (see train_step)
        self.adam_params = frozenset(p for g in self.optimizers[0].param_groups for p in g["params"])
        self.stepped_every_step = [p for p in self.model.parameters() if p not in self.adam_params]
        self.compiled = use_compile
        self.forward = torch.compile(self.model, dynamic=False) if use_compile else self.model
        self.exchange = None
        if world_size > 1:
            sparse = self.model.bigram.table if bigram_exchange_is_sparse(config, world_size) else None  # §9 its rows
            adam, muon = self.optimizers
            self.exchange = GradientExchange(adam.param_groups, muon.param_groups, rank, world_size, self.collectives,
                                             sparse)
            for opt in self.optimizers:
                opt.exchange = self.exchange
        # the [long, short] windows in blocks, one device tensor refilled in place
        self.window_blocks = torch.ones(2, dtype=torch.int32, device=device)
        self.yarn_steps = yarn_changes(config)  # --yarn_window_limit: where the rotary tables are rescaled
        self.split_step = untie_step(config)  # 0: the input embedding is its own table from the start
        # multi-token prediction weights: one small device buffer, refilled in place (mtp_input)
        self.mtp_buffer = torch.zeros(0, device=device)
        # the first step whose loss was nan/inf, kept on the device: checking it costs a host sync,
        # so the loop reads it only where it syncs anyway (validation, checkpoints, the end)
        self.first_nonfinite = torch.full((), NO_STEP, dtype=torch.int64, device=device)

    def window(self, step: int) -> torch.Tensor:
        """The forward's window tensor for `step`; with YaRN, also the rotary tables of that step."""
        if self.yarn_steps:
            self.model.rotary.set_changes(tuple((old, new) for s, old, new in self.yarn_steps if s <= step))
        # one device tensor refilled in place: torch.tensor(..., device="cuda") each step would be
        # a blocking host-to-device copy; fill_ is an ordinary kernel launch
        long, short = attention_windows(step, self.config)
        if self.backend == "fa3":  # FA3 takes its window as numbers: each pair is its own compiled graph
            return long, short
        self.window_blocks[0].fill_(long)
        self.window_blocks[1].fill_(short)
        return self.window_blocks

    def set_embedding_tie(self, step: int) -> None:
        """--untie_embed_after_step: whether step `step` reads the input embedding from the head."""
        if self.split_step:
            self.model.embed_tied = step <= self.split_step

    def mtp_input(self, weights) -> Optional[torch.Tensor]:
        """The forward's mtp_weights for a step's list of weights: None for the next-token loss (no
        list, or [1]), else a view of one device buffer refilled in place (a kernel launch per
        weight, no host-device copy; each length is its own compiled shape)."""
        if weights is None or list(weights) == [1.0]:
            return None
        if self.mtp_buffer.numel() < len(weights):
            self.mtp_buffer = torch.zeros(len(weights), device=self.device)
        view = self.mtp_buffer[:len(weights)]
        for k, w in enumerate(weights):
            view[k].fill_(w)
        return view

    def train_step(self, step: int, batches, mtp_weights=None, host_inputs=None) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the (unsynced) mean loss.
        mtp_weights: this step's multi-token prediction weights (a list of floats); None: the
        schedule's with --multi_token_prediction, else the next-token loss. host_inputs: the
        micro-batches' inputs on the host, for the bigram table's sparse exchange (None: the inputs
        themselves, copied to the host where they are on a GPU: a sync the loaders' copies avoid)."""
        window, scale = self.window(step), train_loss_scale(self.config)  # = 1 / (micro-steps x ranks)
        self.set_embedding_tie(step)
        if self.model.prefix is not None:  # §16 --prefix_loss_weight: this step's weight of the prefix term
            self.model.prefix.set_step(step)
        if mtp_weights is None and self.config.multi_token_prediction:
            mtp_weights = multi_token_weights(step, self.config)
        mtp = self.mtp_input(mtp_weights)
        adam_waits = self.config.adam_odd_steps_only and step % 2 == 0
        exchange = self.exchange
        if exchange is not None:
            exchange.held = self.adam_params if adam_waits else frozenset()
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(batches):
            if exchange is not None:
                exchange.armed = i == len(batches) - 1
                exchange.touch(inputs if host_inputs is None else host_inputs[i])  # §9 the sparse rows
            if self.fp8_downs:  # §17 --fp8_mlp_down: this micro-batch's slice
                set_fp8_down_slice(self.fp8_downs, self.rank * self.micro_steps + i)  # §17 --fp8_mlp_down
            loss = self.forward(inputs, targets, window) if mtp is None else self.forward(inputs, targets, window,
                                                                                        mtp_weights=mtp)
            (loss * scale).backward()
            total += loss.detach() / len(batches)
        self.first_nonfinite.masked_fill_(~torch.isfinite(total) & (self.first_nonfinite > step), step)
        if exchange is not None:
            exchange.wait()
        set_schedules(self.optimizers, step, self.config)
        for opt in self.optimizers:
            if not (adam_waits and opt is self.optimizers[0]):
                opt.step()
        if exchange is not None:
            exchange.reduced.clear()
        if self.fp8_downs:  # §17 --fp8_mlp_down: the weight scales after the step
            refresh_fp8_down_weights(self.fp8_downs, step)  # §17 --fp8_mlp_down
        if adam_waits:  # Adam's local gradients stay for the next (odd) step's backward to add to
            for p in self.stepped_every_step:
                p.grad = None
        else:
            self.model.zero_grad(set_to_none=True)
        if step == self.split_step > 0:  # the split: right after this step's update
            self.model.untie_embedding(self.optimizers)
        return total

    def nonfinite_step(self) -> Optional[int]:
        """The first step (0-based) whose training loss was not finite on any rank, or None. Syncs."""
        first = self.first_nonfinite.clone()
        if self.world_size > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        first = int(first.item())
        return None if first == NO_STEP else first

    @torch.no_grad()
    def evaluate(self, step: int, val_tokens: torch.Tensor, token_bytes: Optional[torch.Tensor] = None
                 ) -> tuple[float, Optional[float]]:
        """(mean loss, bits per byte) over the fixed validation tokens, the same for every world
        size. BPB = nats / (ln 2 x bytes) over targets with a byte length (end-of-text has none
        and is left out of both sums); None without a byte table."""
        cfg, window = self.config, self.window(step)
        self.set_embedding_tie(step)
        self.model.eval()
        step_tokens = cfg.batch_slices * cfg.val_seq_len
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, nats with bytes, bytes
        for start in range(0, cfg.val_tokens, step_tokens):
            for s in range(self.rank * self.micro_steps, (self.rank + 1) * self.micro_steps):
                buf = val_tokens[start + s * cfg.val_seq_len: start + (s + 1) * cfg.val_seq_len + 1]
                buf = buf.to(device=self.device, dtype=torch.int32, non_blocking=True)
                targets = buf[1:].to(torch.int64)
                losses = self.forward(buf[:-1], targets, window, reduction="none")
                sums[0] += losses.sum()
                if token_bytes is not None:
                    nbytes = token_bytes[targets]
                    sums[1] += (losses * (nbytes > 0)).sum()
                    sums[2] += nbytes.sum()
        if self.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        self.model.train()
        nats, nats_with_bytes, nbytes = sums.tolist()
        return nats / cfg.val_tokens, (nats_with_bytes / (math.log(2) * nbytes) if token_bytes is not None else None)

    def random_batches(self, gen: torch.Generator, seq_len: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One step of uniformly random tokens with the run's shapes (slices of seq_len tokens, a
        batch ramp's step; train_seq_len if None): every rank draws the whole step's batch_slices
        slices and keeps its own, as the DataLoader splits real data."""
        return self.random_step(gen, seq_len)[0]

    def random_step(self, gen: torch.Generator, seq_len: Optional[int] = None) -> tuple[list, list[torch.Tensor]]:
        """random_batches' micro-batches and their inputs on the host (train_step's host_inputs)."""
        cfg = self.config
        tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_slices, (seq_len or cfg.train_seq_len) + 1), generator=gen)
        host = tokens[self.rank * self.micro_steps:(self.rank + 1) * self.micro_steps]
        mine = host.to(self.device)
        return [(row[:-1].to(torch.int32), row[1:].to(torch.int64)) for row in mine], [row[:-1] for row in host]

    def warmup(self, steps: Optional[list[int]] = None) -> list[int]:
        """Untimed steps on random tokens to compile kernels (those of warmup_schedule, each with
        its step's batch shape; `steps` instead where given, if warmup_steps is not 0), then restore
        the exact initial state. The peak memory statistics restart afterwards: the warm-up holds a
        copy of the whole state, which a run's logged peak must not include. Returns the steps run."""
        cfg = self.config
        saved = capture_state(self.model, self.optimizers)
        gen = torch.Generator().manual_seed(cfg.init_seed)
        # the grid's phases are visited to compile their graphs; run eagerly, the first steps do
        if not cfg.warmup_steps:
            steps = []
        elif steps is None:
            steps = warmup_schedule(cfg) if self.compiled else list(range(cfg.warmup_steps))
        for step in steps:
            batches, host_inputs = self.random_step(gen, slice_tokens(step, cfg))
            self.train_step(step, batches, host_inputs=host_inputs)
        restore_state(self.model, self.optimizers, saved)
        if self.exchange is not None:
            self.exchange.reset()  # rows an even warm-up step touched
        self.set_embedding_tie(0)  # the warm-up may have passed the split
        self.model.zero_grad(set_to_none=True)  # gradients an odd-step Adam was still holding
        self.first_nonfinite.fill_(NO_STEP)
        del saved
        reset_peak_memory(self.device)
        return list(steps)


class Stopwatch:
    """Training time between barriers: `stop` and `start` sync the device (and the ranks), so the
    clock never counts queued work of the untimed part or misses that of the timed part."""

    def __init__(self, device: torch.device, world_size: int):
        self.device, self.world_size, self.t0 = device, world_size, None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.world_size > 1:
            dist.barrier()

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Milliseconds since `start`."""
        self._sync()
        return 1000 * (time.perf_counter() - self.t0)

    def peek(self) -> float:
        """Milliseconds since `start`, without a sync (the step lines' approximate time)."""
        return 1000 * (time.perf_counter() - self.t0)


def train(config: Hyperparameters, device: torch.device, rank: int = 0, world_size: int = 1,
          log: Optional[RunLog] = None, data: Optional[RunData] = None, resume: Optional[tuple] = None) -> dict:
    """The timed run: validate every val_every steps and at the end, log the step lines,
    checkpoint every save_every steps; `data` as load_data gives it (read here if None);
    `resume` = (folder, meta) of a validated checkpoint."""
    cfg, N, log = config, config.num_iterations, log or RunLog(None)
    data = data or load_data(cfg)
    train_files, val_tokens = data.train_files, data.val_tokens
    runner = Runner(cfg, device, rank, world_size)
    log.write_lines(accounting_lines(runner.model, cfg))
    token_bytes = token_bytes_on_device(data, cfg, device, log)
    runner.warmup()
    loader = train_loader(cfg, train_files, rank, world_size, device)
    start, train_time_ms, last_checkpoint = resume_from(resume, runner, loader, log)
    eta = Eta(start, step_work(cfg, flops_per_token(cfg, runner.model)["weights"]))
    history, clock = [], Stopwatch(device, world_size)
    clock.start()
    for step in range(start, N + 1):
        last = step == N
        validate = is_validation_step(step, cfg)
        save = cfg.save_every > 0 and step > start and (last or step % cfg.save_every == 0)
        if validate or save:
            train_time_ms += clock.stop()  # ---- the clock stops for validation and checkpoints
            stop_if_nonfinite(runner, step, last_checkpoint)
            if validate:
                history.append(validate_and_log(runner, step, val_tokens, token_bytes, train_time_ms, log,
                                                last_checkpoint))
            if save:
                last_checkpoint = save_checkpoint(runner, loader, step, train_time_ms)
                log.write(f"checkpoint: {last_checkpoint}")
                if cfg.keep_checkpoints and rank == 0:
                    for note in prune_checkpoints(last_checkpoint.parent, cfg.keep_checkpoints):
                        log.write(note)
            clock.start()  # ---- and starts again
        if last:
            break
        loss = runner.train_step(step, loader.next_batch(slice_tokens(step, cfg)), host_inputs=loader.host_inputs)
        if step == 0:
            log_step0_loss(loss, world_size, log)
        if (step + 1) % cfg.nonfinite_check_every == 0:
            stop_if_nonfinite(runner, step + 1, last_checkpoint)
        approx_ms = train_time_ms + clock.peek()
        log.write(f"step:{step + 1}/{N} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / (step + 1):.2f}ms",
                  console=(step + 1) % 10 == 0 or step + 1 == N, console_suffix=eta.text(step + 1))
    log_run_end(runner, history[-1], device, log)
    return dict(val_history=history, final_val_loss=history[-1]["val_loss"], train_time_ms=train_time_ms,
                model=runner.model, checkpoint=last_checkpoint)

# ---- what train() does besides training: resume, the non-finite check, validation, log lines

def stop_if_nonfinite(runner: Runner, step: int, last_checkpoint: Optional[Path]) -> None:
    """Raise NonFiniteLossError if any training loss so far was nan/inf (one host sync)."""
    bad, N = runner.nonfinite_step(), runner.config.num_iterations
    if bad is not None:
        raise NonFiniteLossError(f"non-finite training loss (nan or inf) in step {bad + 1}/{N} (the step "
                                 f"logged as step:{bad + 1}/{N}); stopped at step {step} without saving; "
                                 f"last good checkpoint: {last_checkpoint or 'none'}")


def validate_and_log(runner: Runner, step: int, val_tokens: torch.Tensor, token_bytes: Optional[torch.Tensor],
                     train_time_ms: float, log: RunLog, last_checkpoint: Optional[Path]) -> dict:
    """Evaluate, write the val line (val_bpb appended after the speedrun's fields, so parsers keep
    working); package_ms = training time + this evaluation (the final one's is the package time)."""
    N, eval_start = runner.config.num_iterations, time.perf_counter()
    val_loss, val_bpb = runner.evaluate(step, val_tokens, token_bytes)
    if not math.isfinite(val_loss):
        raise NonFiniteLossError(f"non-finite validation loss {val_loss} at step {step}/{N}; stopped "
                                 f"without saving; last good checkpoint: {last_checkpoint or 'none'}")
    bpb = f" val_bpb:{val_bpb:.6f}" if val_bpb is not None else ""
    log.write(f"step:{step}/{N} val_loss:{val_loss:.6f} train_time:{train_time_ms:.0f}ms "
              f"step_avg:{train_time_ms / max(step, 1):.2f}ms{bpb}")
    return dict(step=step, val_loss=val_loss, val_bpb=val_bpb, train_time_ms=train_time_ms,
                package_ms=train_time_ms + 1000 * (time.perf_counter() - eval_start))


# ---- copies of the training state (the warm-up's restore; checkpoints use them too)

def capture_state(model: nn.Module, optimizers, device=None) -> dict:
    """Copies of every parameter and optimizer state tensor, keyed by parameter name (copied to
    `device` if given: a checkpoint stages them on the CPU)."""
    names = {p: n for n, p in model.named_parameters()}
    return dict(model={k: _copy(v, device) for k, v in model.state_dict().items()},
                optimizers=[optimizer_state(opt, names, device) for opt in optimizers])


def optimizer_state(opt: torch.optim.Optimizer, names: dict, device=None) -> dict:
    """One optimizer's state by parameter name (a sharded Muon holds only the matrices it owns)."""
    return dict(state={names[p]: {k: _copy(v, device) for k, v in s.items()} for p, s in opt.state.items()},
                groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _copy(v, device=None):
    if not torch.is_tensor(v):
        return v
    return v.detach().clone() if device is None else v.detach().to(device, copy=True)


def restore_state(model: nn.Module, optimizers, saved: dict) -> None:
    """Put back exactly what `capture_state` saw (states created since are dropped). State tensors
    go to their parameter's device; a saved state without "groups" (a checkpoint) leaves the groups
    to the schedules, which depend on the step only."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(saved["model"][k])
    for opt, opt_saved in zip(optimizers, saved["optimizers"]):
        step_on_device = opt.defaults.get("fused") or opt.defaults.get("capturable")  # else Adam keeps it on the CPU
        opt.state.clear()
        for name, s in opt_saved["state"].items():
            p = params[name]
            opt.state[p] = {k: _copy(v, p.device if k != "step" or step_on_device else "cpu") for k, v in s.items()}
        for group, g in zip(opt.param_groups, opt_saved.get("groups", [])):
            group.update(g)

# =============================================================================
# 7. main

def main(argv: Optional[list[str]] = None) -> int:
    """Run the trainer with command-line flags. Exit codes (exit_code): 0 done, 1 stopped on a non-finite
    loss, 2 bad input (flags, data files, checkpoints, output folders; found before training starts),
    3 a checkpoint, the log or the synthetic data could not be written (disk full, permissions):
    the run stops, a half-written checkpoint is removed, earlier ones stay intact; 130 Ctrl-C; 143
    SIGTERM, or a worker's launcher (torchrun) gone. The log's last line says which (run_ending)."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    try:
        if "-h" in argv or "--help" in argv:
            print(help_text(), flush=True)
            return 0
        config = parse_args(argv)
        with STOPS.armed(launcher=(PARENT_AT_START or os.getppid()) if "RANK" in os.environ else None):
            return run_training(config, rank)  # Part III's run setup, then train()
    except BrokenPipeError:  # `--help | head`: the reader left; nothing more to say
        silence_stdout()
        return 0
    except (InputError, NonFiniteLossError) as e:  # every rank meets these: said once (say_once)
        say_once(f"error: {e}", rank)
        return exit_code(e)
    except WriteError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt as e:  # Ctrl-C (torchrun passes it on to every rank), SIGTERM: a line, not a traceback
        if rank == 0:
            cause = interruption_cause(e)
            say(f"interrupted {'(Ctrl-C)' if cause == 'SIGINT' else 'by ' + cause}: the run stopped; its log and "
                "checkpoints so far are kept")
        return exit_code(e)


# #############################################################################
# Part II. Beyond the record: the claims after bulk, one chapter each (docs/frontier.md). Each is
# switched by its fields (the claims' block of the table in section 1), off by default; its
# recipe is a row of RECIPES.
# #############################################################################


# =============================================================================
# 8. PR #248 (fp8_yarn, docs/fp8-yarn.md): the head's training product in FP8 (--fp8), the head
#    stored transposed (--head_transposed). The FP8 codes and products: triton_kernels.py.

FP8_RANGE_BOUNDS = (1e-30, 1e30)  # --fp8_ranges: r / 448 / batch_slices and its reciprocal stay normal float32


def fp8_scales(config: Hyperparameters) -> tuple[float, float, float]:
    """(s_x, s_w, s_g): the scales of the head's input, weight and output gradient."""
    return tuple(r / kernels.FP8_E4M3_MAX for r in config.fp8_ranges)


def fp8_training_scales(config: Hyperparameters) -> tuple[float, float, float]:
    """The scales the training product quantizes with: s_g times the trainer's loss scale
    (train_loss_scale, 1 / batch_slices). The records' 8 GPUs backpropagate each rank's summed loss
    unscaled and average the gradients after; this trainer scales the loss first, so the gradient
    reaching the head is that many times smaller, and dividing by s_g alone would move its e5m2
    codes down by as many binades (more of them flushed to zero). Scaled so, the codes are the
    records' at any world size and accumulation."""
    s_x, s_w, s_g = fp8_scales(config)
    return s_x, s_w, s_g * train_loss_scale(config)


class FP8HeadProduct(torch.autograd.Function):
    """--fp8: the head's training product from FP8 codes (PR #248's head): logits = s_x s_w (x8 @ w8)
    in x's dtype; backward g8 = e5m2(G / s_g), dx = s_g s_w (g8 @ w8^T), dW = s_x s_g (x8^T @ g8)
    in fp32, cast to the weight's dtype. The quantizers pass gradients straight through (no
    derivative of the rounding, none lost to saturation). Only the codes are kept for backward.
    apply(x (T, d), weight as stored, transposed, (s_x, s_w, s_g)) -> (T, V)."""

    @staticmethod
    def forward(ctx, x, weight, transposed: bool, scales: tuple[float, float, float]):
        x8, w8 = kernels.fp8_head_codes(x, weight, scales)
        ctx.save_for_backward(x8, w8)
        ctx.transposed, ctx.scales, ctx.dtypes = transposed, scales, (x.dtype, weight.dtype)
        return kernels.fp8_head_logits(x8, w8, transposed, scales, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, w8 = ctx.saved_tensors
        g8 = kernels.to_fp8(grad, ctx.scales[2], torch.float8_e5m2)
        dx, dw = kernels.fp8_head_backward(g8, x8, w8, ctx.transposed, ctx.scales, *ctx.dtypes)
        return dx, dw, None, None


def make_fp8_head_kernels(config: Hyperparameters, device_type: str) -> None:
    """The head backward's Triton transpose (kernels.fp8_transpose) made before anything compiles, on
    CUDA with --fp8: made on first use inside the traced backward, triton.jit would break the graph and
    the head's product and its backward would run eagerly."""
    if config.fp8 and device_type == "cuda":
        kernels.fp8_transpose_kernel()


def check_fp8_head(cfg: Hyperparameters) -> None:
    """§8's config rules: the FP8 product and the transposed layout are the full head's; three FP8
    ranges whose scales stay normal float32 numbers."""
    for flag in ("fp8", "head_transposed"):
        require(not (getattr(cfg, flag) and cfg.lore_output), flag,
                "applies to the record's full head, not LoRE's low-rank one: drop --lore_output or this flag")
    require(len(cfg.fp8_ranges) == 3 and all(r > 0 for r in cfg.fp8_ranges), "fp8_ranges",
            f"{to_text(cfg.fp8_ranges)} must be three positive numbers (|h|, |H| and the gradient's, each / 448 a "
            "scale)")
    low, high = FP8_RANGE_BOUNDS
    require(all(low <= r <= high for r in cfg.fp8_ranges), "fp8_ranges",
            f"{to_text(cfg.fp8_ranges)}: each range must be in [{low:g}, {high:g}]; beyond, its scale r/448 (the "
            "gradient's times 1/batch_slices) or the scale's reciprocal leaves float32's normal numbers and the "
            "codes become 0 or inf")


def transposed_draw(shape, gen, init) -> torch.Tensor:
    """init drawn in the transposed shape and transposed: a (d, V) head starts as the exact
    transpose of the (V, d) one (same stream, same values)."""
    return init(tuple(reversed(shape)), gen).t()


# =============================================================================
# 9. PR #252 (bigram, docs/bigram.md, docs/fused-ce.md, docs/unified-optimizer.md): the bigram hash
#    table (--bigram_embed) and its sparse exchange, the fused softcapped loss (--fused_softcap_ce;
#    its kernels: triton_kernels.py), #252's Adam in fp32 (--adam_fp32_moments)

BIGRAM_CURRENT_MUL, BIGRAM_PREVIOUS_MUL = 36313, 27191
BIGRAM_TABLE_BETAS, BIGRAM_LAMBDA_BETAS = (0.75, 0.95), (0.9, 0.95)


def int32_wrap(x):
    """x as a 32-bit two's-complement int would hold it (wrap-around), for a Python int or an int64
    tensor (both `%` are floor-mod): the record hashes in int32, whose overflow is made explicit here
    instead of relied on."""
    return (x + 2**31) % 2**32 - 2**31


def bigram_ids(ids: torch.Tensor, table_rows: int) -> torch.Tensor:
    """The table row of each position of one rank's sequence `ids` (T,), int64: with M = table_rows - 1,
    h_0 = M; h_1 = (36313 t_1 XOR 27191 M) mod M; h_i = (36313 t_i XOR 27191 t_(i-1)) mod M for i >= 2,
    every product wrapped to int32, XOR on the two's-complement values, floor-mod. Position 1 takes M
    as its previous token because the record overwrites position 0 with M before it hashes. Across
    documents, no seed. Pure tensor ops in int64 (CPU, CUDA, compiled)."""
    M = table_rows - 1
    t = ids.long()
    current = int32_wrap(BIGRAM_CURRENT_MUL * t[1:])
    first_previous = t.new_full((min(1, t.numel() - 1),), int32_wrap(BIGRAM_PREVIOUS_MUL * M))  # a Python int
    previous = torch.cat([first_previous, int32_wrap(BIGRAM_PREVIOUS_MUL * t[1:-1])])
    return torch.cat([t.new_full((1,), M), torch.remainder(current ^ previous, M)])


class BigramEmbedding(nn.Module):
    """--bigram_embed: a table of bigram_table_multiple x table_rows rows (model dtype, zero at the
    start) read at bigram_ids of the input, and one weight gamma per layer (fp32, from
    --bigram_lambda_init, used in the model dtype). Block i adds gamma_i x row to its input mixing.
    Optimizer: Adam group `bigram` (lr embed_lr x75, wd x5, betas 0.75/0.95; --table_multipliers off:
    x1) and `bigram_lambdas` (lr embed_lr, no decay, betas 0.9/0.95)."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype):
        super().__init__()
        rows = bigram_table_rows(config)  # §14 --bigram_table_multiple: a float
        lr_mul, wd_mul = (75.0, 5.0) if config.table_multipliers else (1.0, 1.0)
        self.table = declare(nn.Parameter(torch.empty(rows, config.model_dim, dtype=dtype)), "bigram", zeros,
                             lr_mul, wd_mul, betas=BIGRAM_TABLE_BETAS, lr="embed_lr")
        self.lambdas = declare(nn.Parameter(torch.empty(config.num_layers, dtype=torch.float32)), "bigram_lambdas",
                               constant_init([config.bigram_lambda_init] * config.num_layers), lr_mul=1.0, wd_mul=0.0,
                               betas=BIGRAM_LAMBDA_BETAS, lr="embed_lr"
                               ) if not config.mudd_gate else None  # §18 --mudd_gate sets them per token
        self.signs = BigramSigns(config, dtype) if config.bigram_sign_rows else None  # §14 --bigram_sign_rows

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (1, T, d), not normed; gammas (L,) cast to the rows' dtype, None with §18 --mudd_gate)."""
        rows = F.embedding(bigram_ids(ids, self.table.shape[0]), self.table)[None]
        if self.signs is not None:  # §14 --bigram_sign_rows: each row times its +-1 vector
            rows = self.signs(ids, rows)
        return rows, None if self.lambdas is None else self.lambdas.to(rows.dtype)


def send_touched_rows(exchange: "GradientExchange", table: nn.Parameter) -> torch.Tensor:
    """The table's sparse exchange (#252/#261's): the rows this rank's tokens touched since the last
    exchange (exchange.touched, from the host's tokens), sorted and split by owner (rows [r n, (r+1) n)
    on rank r, as adam_rows shards them); the counts by an all-to-all of host tensors (no device sync),
    then the indices and the rows. Each rank adds what the others sent to its own rows, one sending rank
    at a time in rank order (no row twice in one index_add: the same order on every device), and
    returns them: the sum of every rank's gradient on its n rows. A row no rank touched has a zero
    gradient everywhere, and one a rank did not touch is zero on that rank: nothing it leaves out adds."""
    coll, W, rank = exchange.collectives, exchange.world_size, exchange.rank
    group, n, grad = exchange.plan[table][1], table.shape[0] // W, table.grad
    rows = np.flatnonzero(exchange.touched)
    exchange.touched[:] = False
    cuts = np.searchsorted(rows, np.arange(0, (W + 1) * n, n))
    send = torch.from_numpy(np.diff(cuts))
    send[rank] = 0  # its own rows stay
    recv = torch.empty_like(send)
    coll.all_to_all(recv, send, [1] * W, [1] * W, group).wait()
    send_sizes, recv_sizes = send.tolist(), recv.tolist()  # host tensors: no device sync
    index = torch.from_numpy(np.concatenate([rows[:cuts[rank]], rows[cuts[rank + 1]:]]))
    if grad.is_cuda:  # from pinned memory, queued on the stream: no wait for the device
        index = index.pin_memory()
    index = index.to(grad.device, non_blocking=True)
    got_index = index.new_empty(sum(recv_sizes))
    coll.all_to_all(got_index, index, recv_sizes, send_sizes, group).wait()
    got = grad.new_empty(sum(recv_sizes), grad.shape[1])
    coll.all_to_all(got, grad.index_select(0, index), recv_sizes, send_sizes, group).wait()
    mine, start = grad[rank * n:(rank + 1) * n], 0
    for size in recv_sizes:
        mine.index_add_(0, got_index[start:start + size] - rank * n, got[start:start + size])
        start += size
    return mine


def bigram_exchange_is_sparse(config: Hyperparameters, world_size: int) -> bool:
    """Whether --bigram_embed's table gradient goes by send_touched_rows: where its rows are sharded
    (adam_rows: they split world_size ways) and surely fewer rows are sent than the reduce-scatter
    moves, whatever the tokens: the positions a rank reads per Adam step (a bound on the rows it
    touches) < the table's rows. Otherwise it is reduce-scattered by rows, overlapping the backward,
    as every other sharded tensor (the record on 8 GPUs: 131,072 positions < 251,520 rows: sparse, as
    #261's 8 GPUs with one micro-step)."""
    rows = bigram_table_rows(config)  # §14 --bigram_table_multiple: a float
    if not config.bigram_embed or world_size == 1 or adam_rows(torch.empty(rows, config.model_dim, device="meta"), 0, world_size) is None:
        return False
    positions = (2 if config.adam_odd_steps_only else 1) * (config.batch_slices // world_size) * config.train_seq_len
    return positions < rows


class FusedSoftcapCE(torch.autograd.Function):
    """The loss from fused_ce_forward; its gradient from fused_ce_backward (dh, dH only). grad_scale
    given (the pr261 variant): the forward also makes dL/dl for an upstream gradient of grad_scale
    (fused_ce261_forward) and the backward multiplies it into dh, dH, ignoring its own input."""

    @staticmethod
    def forward(ctx, h, H, cols, wts, transposed, scales, grad_scale, s_w_all):
        fp8 = scales is not None
        s_x, s_w, s_g = scales if fp8 else (1.0, 1.0, 1.0)
        ctx.pr261 = grad_scale is not None
        if ctx.pr261:  # the gradient's FP8 scale times grad_scale: the codes do not depend on it
            s_g = s_g * grad_scale
            loss, dl = kernels.fused_ce_ops()[2](h, H, cols, wts, s_w_all, transposed, fp8, s_x, s_w, s_g, grad_scale)
            ctx.save_for_backward(dl, h, H)
        else:
            loss, logits, lse = kernels.fused_ce_ops()[0](h, H, cols, wts, transposed, fp8, s_x, s_w)
            ctx.save_for_backward(h, H, logits, lse, cols, wts)
        ctx.args = (transposed, fp8, s_x, s_w, s_g)
        return loss

    @staticmethod
    def backward(ctx, g):
        if ctx.pr261:  # g is not read: the gradient was made for grad_scale in the forward
            dh, dH = kernels.fused_ce_ops()[3](*ctx.saved_tensors, *ctx.args)
        else:
            dh, dH = kernels.fused_ce_ops()[1](g, *ctx.saved_tensors, *ctx.args)
        return dh, dH, None, None, None, None, None, None


def fused_softcap_ce(h: torch.Tensor, H: torch.Tensor, targets: torch.Tensor,
                     weights: Optional[torch.Tensor] = None, transposed: bool = False,
                     scales: Optional[tuple[float, float, float]] = None, variant: str = "pr252",
                     grad_scale: Optional[float] = None,
                     prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """sum_t sum_k w_k (LSE_t - z_t[y_(t+k)]) (fp32) of z = 23 sigmoid((l + 5) / 7.5) over all of H's
    columns, l = h H (H stored (V, d), or (d, V) if transposed). weights: the MTP weights (K,),
    None: the next token only. scales (s_x, s_w, s_g), --fp8: the product and its gradients from FP8
    codes (fp8_matmul), the logits bf16; None: in h's dtype. variant "pr261" (docs/fused-ce.md): PR
    #261's numerics; grad_scale (required there) is the gradient the loss will receive from above:
    its backward gives the gradient for that, whatever it receives. prefix (§16 --prefix_loss_weight):
    (p(y_t) (T,), w (1,)), one more term w (LSE_t - z_t[p(y_t)]) per row where p(y_t) >= 0."""
    if variant not in kernels.FUSED_CE_VARIANTS:
        raise ValueError(f"fused_softcap_ce: variant {variant!r} is not one of {', '.join(kernels.FUSED_CE_VARIANTS)}")
    if (variant == "pr261") != (grad_scale is not None):
        raise ValueError("fused_softcap_ce: grad_scale is given with variant pr261 only, and always there")
    if weights is None:
        weights = torch.ones(1, device=h.device)
    cols, wts = kernels.fused_ce_terms(targets, weights, H.shape[1] if transposed else H.shape[0],
                                       *(prefix or ()))  # §16 --prefix_loss_weight: its column last
    s_w_all = None
    if variant == "pr261":  # #261's S_w: every weight, added in order in fp32
        terms = weights.float().unbind()
        if prefix is not None:  # §16: per row, #337's order: the prefix's weight (0 where none) first
            terms = (wts[:, -1] + terms[0],) + terms[1:]
        s_w_all = functools.reduce(torch.add, terms)
    return FusedSoftcapCE.apply(h, H, cols, wts, transposed, None if scales is None else tuple(scales),
                                None if grad_scale is None else float(grad_scale), s_w_all)


def check_fused_loss(cfg: Hyperparameters) -> None:
    """§9's config rule: the fused loss computes the sigmoid cap from the full head."""
    if cfg.fused_softcap_ce:
        require(cfg.logit_softcap_form == "sigmoid", "fused_softcap_ce",
                "computes the sigmoid cap: it needs --logit_softcap_form=sigmoid")
        require(not cfg.lore_output, "fused_softcap_ce",
                "needs the full head matrix: it cannot be used with --lore_output")


def fused_training_loss(model: GPT, x: torch.Tensor, targets: torch.Tensor, reduction: str,
                        mtp_weights: Optional[torch.Tensor], prefix=None) -> torch.Tensor:
    """GPT.loss in training with --fused_softcap_ce: one op over all rows of x (T, d) (it bounds its
    own memory), the head as stored ((d, V) with --head_transposed), FP8 codes with --fp8. pr261
    makes the gradient in the forward, for the upstream gradient the trainer will give this loss
    (train_loss_scale, and 1/T for a mean), and scales s_g by it itself; pr252 takes the trainer's
    loss scale in s_g (fp8_training_scales). prefix: §16's (p(y_t), w), or None."""
    cfg = model.config
    grad_scale = None
    if cfg.fused_ce_variant == "pr261":
        grad_scale = train_loss_scale(cfg) / (1 if reduction == "sum" else targets.numel())
    scales = (fp8_scales if grad_scale is not None else fp8_training_scales)(cfg)
    total = fused_softcap_ce(x, model.head.weight, targets, mtp_weights, cfg.head_transposed,
                             scales if cfg.fp8 else None, variant=cfg.fused_ce_variant, grad_scale=grad_scale,
                             prefix=prefix)  # §16 --prefix_loss_weight
    return total if reduction == "sum" else total / targets.numel()


def pr252_muon_factors(group: dict, shape_factor: float, cautious: bool) -> dict:
    """--muon_scalar_rounding=pr252: Muon's per-step factors as #252's compiled steps take them: each
    float64 product rounded once to fp32, and 1 - momentum formed in fp32 from the fp32 momentum."""
    f32, m, lr = np.float32, group["momentum"], group["lr"]
    values = dict(one_minus_momentum=f32(1) - f32(m))
    if cautious:
        values.update(lr_factor=f32(shape_factor * group["lr_mul"] * lr),
                      wd_factor=f32(group["wd_mul"] * group["weight_decay"] * lr))
    return values


def fp32_adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, wd_mul: float, factors: Optional[torch.Tensor] = None,
                   update=None) -> None:
    """The same Adam as #252 computes it (--adam_fp32_moments): fp32 moments, every operation in
    fp32 in its compiled step's order, the weight rounded to its dtype once at the end. With
    c = lr * sqrt(1 - beta2^t) / (1 - beta1^t) and d = lr^2 * wd * wd_mul, each a Python float
    rounded once to fp32 (filled into `factors`, a (2,) fp32 device tensor, in place: a compiled
    `update` then never recompiles; a new one if None): fp32_adam_update. Each multiply and add is
    rounded separately uncompiled (the GPU's compiled kernel may fuse some into FMAs, one rounding
    fewer: not reproduced on the CPU)."""
    state["step"] += 1
    t = state["step"]
    factors = torch.zeros(2, device=p.device) if factors is None else factors
    factors[0].fill_(float(np.float32(lr * ((1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t)))))
    factors[1].fill_(float(np.float32(lr * lr * weight_decay * wd_mul)))  # #252's order of the product
    (update or fp32_adam_update)(p, grad, state["exp_avg"], state["exp_avg_sq"], beta1, beta2, eps, factors)


def fp32_adam_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, beta1: float,
                     beta2: float, eps: float, factors: torch.Tensor) -> None:
    """In place, #252's step in fp32 with (c, d) = factors: m = m*b1 + g*(1-b1); v = v*b2 + (1-b2)*(g*g);
    u = m / (sqrt(v) + eps) * c; u += d * p where u*p > 0; p = p - u (rounded to p's dtype)."""
    g, w = grad.float(), p.float()
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_(g.square().mul_(1 - beta2))
    u = m.div(v.sqrt().add_(eps)).mul_(factors[0])
    u.add_((w * ((u * w) > 0)).mul_(factors[1]))
    p.copy_(w.sub_(u))


# =============================================================================
# 10. PR #261 (mudd, docs/mudd.md): MUDD connections at the last two blocks, replacing the backout
#     (--mudd, --mudd_nets), attention from block N (--attn_input_from_layer), #261's loss variant
#     (--fused_ce_variant=pr261: its numerics in triton_kernels.py)

MUDD_HIDDEN = 64  # width of each of its two small nets
MUDD_SOURCES = 3  # the penultimate net's sources: x00, h_b, its own block's output
MUDD_SCALE = 0.2 / MUDD_SOURCES**0.5  # every output is (net + bias) x this
MUDD_V_GAIN = 1.15  # the value mix's factor
MUDD_EARLY_LAYER = 4  # the final mix's fifth source: this block's output
MUDD_BETAS = (0.9, 0.99)


def mudd_bias(shape, gen) -> torch.Tensor:
    """The biases b (2 nets, 2 rows, 8 outputs), fp32 here and rounded to bf16 where stored: zero, but
    the final net's h_b weight -4.34 (x MUDD_SCALE: the backout's -0.5) and the penultimate net's
    last-block weights r_a = r_m = 1.05, p_a = p_m = 1 and psi = 0.05 (each / MUDD_SCALE). In bf16:
    -4.34375, 9.0625, 8.6875, 0.43359, so r = 1.046875, p = 1, psi = 0.050049 in bf16 outputs."""
    b = torch.zeros(shape)
    b[1, 1, 1] = -4.34
    b[0, 0, 4] = b[0, 1, 4] = 1.05 / MUDD_SCALE
    b[0, 0, 5] = b[0, 1, 5] = 1.0 / MUDD_SCALE
    b[0, 0, 7] = 0.05 / MUDD_SCALE
    return b


class LastBlockMix(NamedTuple):
    """What --mudd's penultimate net gives the last block, each (1, T, 1) unless noted: v (1, T, H,
    D) added to its v; ve_gate (1, T, H, 1) its value-embedding gate; its residual weights r_a, p_a,
    r_m, p_m; the weights of x00 and of the bigram rows b at its attention sum, and those tensors."""
    v: torch.Tensor
    ve_gate: torch.Tensor
    resid_attn: torch.Tensor
    out_attn: torch.Tensor
    resid_mlp: torch.Tensor
    out_mlp: torch.Tensor
    x00_weight: torch.Tensor
    bigram_weight: torch.Tensor
    x00: torch.Tensor
    bigram: torch.Tensor


class Mudd(nn.Module):
    """--mudd (PR #261): two small nets, k = 0 after block L-2, k = 1 after the last block, each
    a = GELU(W1[k] h) (64 wide, exact GELU, from the raw stream h), D = (a W2[k] + b[k]) x MUDD_SCALE,
    (2, 8) per token. Weights bf16 whatever the model dtype (as the record stores them, so the bf16
    biases give its starting weights): W1 (2, 64, d) uniform +-1/sqrt(d), W2 (2, 64, 2, 8) zero, b
    (mudd_bias). Adam group `mudd`: lr x0.25 of --mudd_lr, betas 0.9/0.99, wd x1 on W1 and W2, none
    on b. Each matmul's output and each named result is rounded once to the stream's dtype."""

    def __init__(self, config: Hyperparameters):
        super().__init__()
        d, bf16 = config.model_dim, torch.bfloat16
        self.heads, self.head_dim = config.num_heads, config.head_dim
        # --mudd_nets: which nets run; h_b is backout_layer's output
        self.layers, self.h_b_layer, self.nets = config.num_layers, config.backout_layer, config.mudd_nets
        self.w1 = declare(nn.Parameter(torch.empty(2, MUDD_HIDDEN, d, dtype=bf16)), "mudd", uniform_init(d**-0.5),
                          lr_mul=0.25, wd_mul=1.0, betas=MUDD_BETAS, lr="mudd_lr")
        self.w2 = declare(nn.Parameter(torch.empty(2, MUDD_HIDDEN, 2, 8, dtype=bf16)), "mudd", zeros,
                          lr_mul=0.25, wd_mul=1.0, betas=MUDD_BETAS, lr="mudd_lr")
        self.bias = declare(nn.Parameter(torch.empty(2, 2, 8, dtype=bf16)), "mudd", mudd_bias,
                            lr_mul=0.25, wd_mul=0.0, betas=MUDD_BETAS, lr="mudd_lr")

    def after_block(self, i: int, x: torch.Tensor, x00: torch.Tensor, outputs: list,
                    bigram: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional["LastBlockMix"]]:
        """After block i (x its output, outputs every block's so far): after block L-2 the stream
        penultimate() makes and the last block's mix (not with --mudd_nets=final); else x as it is."""
        if i != self.layers - 2 or self.nets == "final":
            return x, None
        return self.penultimate(x, x00, outputs[self.h_b_layer], bigram)

    def before_head(self, x: torch.Tensor, x00: torch.Tensor, outputs: list, ves: list) -> torch.Tensor:
        """After the last block: final()'s mix of x (not with --mudd_nets=penultimate)."""
        if self.nets == "penultimate":
            return x
        return self.final(x, x00, outputs[self.h_b_layer], outputs[self.layers - 2], ves[0][None],
                          outputs[MUDD_EARLY_LAYER])

    def coefficients(self, k: int, h: torch.Tensor, outputs: slice = slice(None), row=slice(None)) -> torch.Tensor:
        """Net k's D (1, T, 2, 8) from h (1, T, d), or the entries [row, outputs] of it."""
        a = F.gelu(F.linear(h, self.w1[k].type_as(h)))  # (1, T, 64)
        w2, bias = self.w2[k][:, row, outputs], self.bias[k][row, outputs]
        z = F.linear(a, w2.flatten(1).t().type_as(a)).view(*a.shape[:-1], *w2.shape[1:])
        return ((z.float() + bias.float()) * MUDD_SCALE).to(h.dtype)

    def penultimate(self, h: torch.Tensor, x00: torch.Tensor, h_b: torch.Tensor,
                    bigram: torch.Tensor) -> tuple[torch.Tensor, LastBlockMix]:
        """After block L-2 (h its output): the stream the last block starts from,
        (1 + D[1,2]) h + D[1,0] x00 + D[1,1] h_b, and its LastBlockMix: v = 1.15 (D[0,0] x00 +
        D[0,1] h_b + D[0,2] h), the value-embedding gate D[c,3] + 2 (c = 0 for the first half of the
        heads, 1 for the second), r_a, p_a, r_m, p_m = D[0,4], D[0,5], D[1,4], D[1,5], the x00 weight
        D[0,6] and the bigram weight D[0,7] (D[1,6:8] unused)."""
        D = self.coefficients(0, h)
        c = lambda row, j: D[..., row, j:j + 1]  # (1, T, 1)
        dtype = h.dtype
        v = kernels.fp32_sum(dtype, (c(0, 0), x00), (c(0, 1), h_b), (c(0, 2), h), gain=MUDD_V_GAIN)
        x = kernels.fp32_sum(dtype, (1 + c(1, 2).float(), h), (c(1, 0), x00), (c(1, 1), h_b))
        gate = (D[..., 3].float() + 2).to(dtype).repeat_interleave(self.heads // 2, dim=-1)[..., None]
        mix = LastBlockMix(v.view(*v.shape[:-1], self.heads, self.head_dim), gate, c(0, 4), c(0, 5), c(1, 4),
                           c(1, 5), c(0, 6), c(0, 7), x00, bigram)
        return x, mix

    def final(self, x: torch.Tensor, x00: torch.Tensor, h_b: torch.Tensor, h_pen: torch.Tensor, ve0: torch.Tensor,
              h_early: torch.Tensor) -> torch.Tensor:
        """After the last block (x its output): x + e0 x00 + e1 h_b + e2 h_pen + e3 ve0 + e4 h_early,
        e = net 1's D[1, 0:5] (only those columns of W2[1] and b[1] are used)."""
        e = self.coefficients(1, x, slice(0, 5), 1)  # (1, T, 5)
        sources = (x00, h_b, h_pen, ve0, h_early)
        return kernels.fp32_sum(x.dtype, (None, x), *((e[..., j:j + 1], t) for j, t in enumerate(sources)))


def check_mudd(cfg: Hyperparameters) -> None:
    """§10's config rules: what each of MUDD's nets needs, only where --mudd_nets runs it."""
    if not cfg.mudd:
        return
    penultimate_net, final_net = cfg.mudd_nets != "final", cfg.mudd_nets != "penultimate"
    require(not (final_net and cfg.backout), "mudd", "replaces the backout (its final mix starts with h_b at "
            "-0.5): add --backout=false" + (" (or --mudd_nets=penultimate)" if cfg.mudd_nets == "both" else ""))
    require(cfg.bigram_embed or not penultimate_net, "mudd", "the last block's mix adds psi x the bigram rows: add "
            "--bigram_embed" + (" (or --mudd_nets=final)" if cfg.mudd_nets == "both" else ""))
    require(cfg.num_layers > MUDD_EARLY_LAYER + 1 and cfg.backout_layer <= cfg.num_layers - 2, "mudd",
            f"reads block {MUDD_EARLY_LAYER}'s and backout_layer's outputs before the last block: needs num_layers "
            f"> {MUDD_EARLY_LAYER + 1} and backout_layer <= num_layers - 2")
    require(cfg.num_layers - 1 in cfg.attention_layers or not penultimate_net, "mudd", "its weights act on the "
            "last block's attention: that block must have one (attention_free_layers)")
    require(cfg.value_embed_tables[0] is not None or not final_net, "mudd", "its final mix adds layer 0's value "
            "embedding: value_embed_layout must give layer 0 one")
    require(cfg.num_heads % 2 == 0 or not penultimate_net, "mudd", "its value-embedding gate has one value per "
            "half of the heads: num_heads must be even")


def mudd_last_block(block: Block, x: torch.Tensor, args: BlockArgs) -> torch.Tensor:
    """--mudd's last block (Block.forward hands it over): x = r_a x + p_a Attn + chi x00 + psi b, then
    x = r_m x + p_m MLP(norm x), with the per-token weights of args.mudd (LastBlockMix) and no input
    mixing; the value mix joins v, its gate replaces the value-embedding gate. Each sum is one
    expression in fp32 rounded once to x's dtype, as the record's compiled code computes it, grouped
    as the record writes it: (r_a x + p_a Attn) + (chi x00 + psi b)."""
    mix = args.mudd
    attn_in = x if args.attn_source is None else args.attn_source
    y = block.attn(rms_norm(attn_in), args.attn._replace(v_extra=mix.v, ve_gate=mix.ve_gate))
    term = lambda w, t: w.float() * t.float()
    x = ((term(mix.resid_attn, x) + term(mix.out_attn, y))
         + (term(mix.x00_weight, mix.x00) + term(mix.bigram_weight, mix.bigram))).to(x.dtype)
    return kernels.fp32_sum(x.dtype, (mix.resid_mlp, x), (mix.out_mlp, block.mlp(rms_norm(x))))


# =============================================================================
# 11. The seed ideas (docs/ideas.md): LoRE (--lore_input, --lore_output), the value-embedding basis
#     (--ve_mode), more input embeddings (--num_extra_embeds), x00 at the output (--x00_at_output)

class LowRankEmbedding(nn.Module):
    """LoRE, input side (--lore_input): a V x r table followed by an r -> d projection."""

    def __init__(self, vocab_size: int, rank: int, dim: int, init: str, dtype: torch.dtype,
                 lr_mul: float = 1.0, wd_mul: float = 1.0):
        super().__init__()
        self.table = nn.Embedding(vocab_size, rank, dtype=dtype)
        declare(self.table.weight, "embed", normal_init(1.0), lr_mul, wd_mul, lr="embed_lr")
        # Linear(r -> d) weight, fan_in r: `original` and `corrected` both draw it N(0, 1/r)
        self.proj = declare(nn.Parameter(torch.empty(dim, rank, dtype=dtype)), "muon_lore",
                            normal_init(rank**-0.5) if init != "none" else uniform_init(rank**-0.5))

    def forward(self, ids):
        return F.linear(self.table(ids), self.proj)


class LowRankHead(nn.Module):
    """LoRE, output side (--lore_output): d -> r (`down`) then r -> V_pad (`up`), fp32 storage.
    Only `up` carries the vocabulary padding. Both factors start random (the --lore_init modes):
    two zero factors would never receive a gradient."""

    def __init__(self, dim: int, rank: int, padded_vocab: int, init: str, wd_mul: float = 1.0):
        super().__init__()
        # `original` draws down N(0, 1/r), `corrected` up; the other factor (both with `none`) is
        # PyTorch's Linear default, uniform with bound 1/sqrt(fan_in)
        factor_init = lambda name, fan_in: (normal_init(rank**-0.5) if (init, name) in {("original", "down"),
                                                                                      ("corrected", "up")}
                                            else uniform_init(fan_in**-0.5))
        self.down = declare(nn.Parameter(torch.empty(rank, dim, dtype=torch.float32)), "muon_lore",
                            factor_init("down", dim))  # Linear(d -> r) weight
        self.up = declare(nn.Parameter(torch.empty(padded_vocab, rank, dtype=torch.float32)), "head",
                          factor_init("up", rank), wd_mul=wd_mul, lr="head_lr")  # Linear(r -> V): the head's table

    def forward(self, x):
        return F.linear(F.linear(x, self.down.to(x.dtype)), self.up.to(x.dtype))


def value_coefficients(shape, gen, layout: tuple, assignment: bool) -> torch.Tensor:
    """The (L, K) value-embedding coefficients (deterministic, `gen` unused). canonical: the first
    K sites one-hot, later sites (1,...,1)/sqrt(K); assignment: one-hot of the layout's table. Rows
    of layers without a value embedding are zero (unused)."""
    L, K = shape
    A = torch.zeros(L, K)
    sites = [layer for layer, table in enumerate(layout) if table is not None]
    for s, layer in enumerate(sites):
        if assignment:
            A[layer, layout[layer]] = 1.0
        elif s < K:
            A[layer, s] = 1.0
        else:
            A[layer] = K**-0.5
    return A


class ValueEmbeddingBasis(ValueEmbeddings):
    """--ve_mode=learned / frozen: a coefficient matrix A (L x K, fp32) makes layer l's table
    V_l = sum_k A[l, k] B_k of the K tables B_k; learned trains A (Adam, --ve_coeff_lr), frozen keeps
    it fixed (a buffer: no gradient, no optimizer state). --ve_exec: `direct` gathers the K rows of
    each token and mixes them, `materialized` builds each V_l (differentiably), then looks it up."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype):
        super().__init__(config, dtype)
        coeffs = torch.empty(config.num_layers, config.num_value_embeds, dtype=torch.float32)
        if config.ve_mode == "learned":
            self.coeffs = declare(nn.Parameter(coeffs), "ve_coeff", self.coefficient_init(), lr="ve_coeff_lr")
        else:
            del self.coeffs
            self.register_buffer("coeffs", coeffs)

    def coefficient_init(self) -> functools.partial:
        return functools.partial(value_coefficients, layout=tuple(self.layout),
                                 assignment=self.config.ve_coeff_init == "assignment")

    def initial_coeffs(self) -> torch.Tensor:
        return self.coefficient_init()(self.coeffs.shape, None)

    def forward(self, ids) -> list[Optional[torch.Tensor]]:
        A, dtype = self.coeffs, self.tables[0].weight.dtype
        if self.config.ve_exec == "direct":
            rows = torch.stack([table(ids) for table in self.tables]).float()  # (K, T, d)
            mix = lambda layer: torch.einsum("k,ktd->td", A[layer], rows).to(dtype)
        else:
            weights = torch.stack([table.weight for table in self.tables]).float()  # (K, V, d)
            mix = lambda layer: F.embedding(ids, torch.einsum("k,kvd->vd", A[layer], weights).to(dtype))
        return [mix(layer) if t is not None else None for layer, t in enumerate(self.layout)]


# =============================================================================
# 12. PR #264 and #317 (docs/short-track-transfer.md section 1): learnable XSA (--xsa_layers, --xsa_lr).
#     After a listed block's attention each head's output loses tanh(alpha) of its component along
#     its value, computed in #317's algebraic form

XSA_BETAS = (0.9, 0.95)  # the short track's bigram_lambdas' betas, as #252 ported them
XSA_DENOM_FLOOR = 1e-8  # max(|v|^2, 1e-8) = max(|v|, 1e-4)^2, #264's floor of |v|


def xsa(y: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """y - tanh(alpha) (y . v) / max(|v|^2, 1e-8) v for each token and head (#317's form): y and v
    (B, T, H, D), alpha (H,) fp32, or (B, T, H, 1) per token (§18 --mudd_gate). tanh(alpha) is cast to
    y's dtype and every operation runs in it, as #317's code; a zero alpha gives y's values (and passes
    y's gradient on) exactly."""
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(XSA_DENOM_FLOOR)
    a = torch.tanh(alpha).type_as(y)
    a = a.view(1, 1, -1, 1) if a.dim() == 1 else a
    return y - a * (dot / denom) * v


class XSA(nn.Module):
    """--xsa_layers: one block's alphas, (num_heads,) fp32 from zero. Adam group `xsa`: lr --xsa_lr,
    betas 0.9/0.95, no weight decay (replicated, like every Adam parameter here)."""

    def __init__(self, config: Hyperparameters):
        super().__init__()
        self.alpha = declare(nn.Parameter(torch.empty(config.num_heads, dtype=torch.float32)), "xsa", zeros,
                             lr_mul=1.0, wd_mul=0.0, betas=XSA_BETAS, lr="xsa_lr")

    def forward(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return xsa(y, v, self.alpha)


def require_attention_blocks(cfg: Hyperparameters, flag: str) -> None:
    """The blocks listed in --flag (sections 12 and 18) exist, have attention and are listed once;
    one line each if not."""
    listed = getattr(cfg, flag) or ()
    repeated = sorted({layer for layer in listed if listed.count(layer) > 1})
    require(not repeated, flag, f"block {repeated[0] if repeated else ''} is listed twice: list each block once")
    for layer in listed:
        require(0 <= layer < cfg.num_layers, flag, f"block {layer} does not exist: list blocks in "
                f"0..{cfg.num_layers - 1}")
        require(layer in cfg.attention_layers, flag, f"block {layer} has no attention "
                "(attention_free_layers): drop it from the list")


def check_xsa(cfg: Hyperparameters) -> None:
    """§12's config rule: each listed block exists and has attention."""
    require_attention_blocks(cfg, "xsa_layers")


# =============================================================================
# 13. PR #253 (docs/short-track-transfer.md section 2): Q and K orthogonalized per head group
#     (--muon_qk_group_heads). Muon's update of the attention bank cuts Q and K into row blocks of
#     N heads, each orthogonalized and NorMuon-normalized on its own; V and O stay whole. The stored
#     parameter, its momentum, its step and its exchange between ranks do not change

def qk_group_rows(cfg: Hyperparameters) -> int:
    """Rows of one of Q's and K's blocks, N x head_dim (0: off)."""
    return cfg.muon_qk_group_heads * cfg.head_dim


def add_qk_groups(muon_groups: list[dict], cfg: Hyperparameters) -> None:
    """--muon_qk_group_heads: the muon_attn group's option qk_rows, which Muon's step reads."""
    for group in muon_groups:
        if group["name"] == "muon_attn" and cfg.muon_qk_group_heads:
            group["qk_rows"] = qk_group_rows(cfg)


def block_reduce_dim(shape) -> int:
    """NorMuon's axis from an orthogonalized block's own shape (the batch dim aside): one value per
    row when rows >= columns, else one per column (#253's (256, 768) blocks: per column)."""
    return -1 if shape[-2] >= shape[-1] else -2


def qk_group_pieces(shape, rows: int) -> list[tuple[str, tuple[int, ...]]]:
    """(statistic's state key, the batch of blocks' shape) of the attention bank's two pieces, for a
    stored (4, attn_dim, d): Q and K as (2 attn_dim / rows, rows, d), V and O as (2, attn_dim, d)."""
    attn_dim, d = shape[-2], shape[-1]
    return [("qk_row_mean_square", (2 * attn_dim // rows, rows, d)), ("row_mean_square", (2, attn_dim, d))]


def qk_group_statistic_shapes(shape, rows: int) -> dict[str, tuple[int, ...]]:
    """NorMuon's statistic of each piece: its blocks' shape with the reduced axis 1."""
    shapes = {}
    for key, piece in qk_group_pieces(shape, rows):
        stat = list(piece)
        stat[block_reduce_dim(piece)] = 1
        shapes[key] = tuple(stat)
    return shapes


def qk_group_state(muon: "Muon", group: dict, p: nn.Parameter, dtype: torch.dtype) -> dict:
    """The statistics Muon.new_state makes for a grouped bank (nothing for any other matrix, or
    without row normalization): row_mean_square (V and O's, (2, attn_dim, 1)) replaces the whole
    bank's, qk_row_mean_square holds Q and K's blocks' ((2 H / N, 1, d) for blocks wider than tall)."""
    if not group.get("qk_rows") or not muon.row_normalization:
        return {}
    return {key: torch.zeros(shape, dtype=dtype, device=p.device)
            for key, shape in qk_group_statistic_shapes(p.shape, group["qk_rows"]).items()}


def qk_grouped_update(muon: "Muon", group: dict, scalars: dict[str, torch.Tensor], p: nn.Parameter) -> None:
    """Muon.update_matrix for a grouped attention bank: the same momentum (of the whole bank) and the
    same step (cautious or decoupled, with the group's scalars, whose lr factor is the same for every
    block: 1 from each block with --muon_lr_shape=blocks, the stored matrix's with stored), but the
    orthogonalization and the row normalization run per piece, Q and K in row blocks of qk_rows with
    their own statistic, V and O whole."""
    state, as_blocks = muon.state[p], block_view(p, group)
    weight, low_bits = as_blocks(p.data), state.get("low_bits")
    g = nesterov_momentum(as_blocks(p.grad), as_blocks(state["momentum_buffer"]), scalars["momentum"],
                          scalars["one_minus_momentum"])  # (4, attn_dim, d)
    updates = []
    for (key, shape), piece in zip(qk_group_pieces(g.shape, group["qk_rows"]), (g[:2], g[2:])):
        update = muon.normalized_update(piece.reshape(shape), group, weight.dtype, state, key, block_reduce_dim(shape))
        updates.append(update.reshape(2, *g.shape[1:]))
    muon.apply_update(weight, low_bits, as_blocks, torch.cat(updates), scalars)


def check_qk_groups(cfg: Hyperparameters) -> None:
    """§13's config rule: N heads per block divide the heads."""
    N = cfg.muon_qk_group_heads
    require(N == 0 or cfg.num_heads % N == 0, "muon_qk_group_heads", f"{N} does not divide num_heads="
            f"{cfg.num_heads}: choose a divisor of it (or 0: Q and K whole)")


# =============================================================================
# 14. PR #299 (docs/short-track-transfer.md section 3): a fixed +-1 vector on each bigram row
#     (--bigram_sign_rows), and the table's rows as a float multiple of the vocabulary table's
#     (--bigram_table_multiple, #315's 7.5)

BIGRAM_SIGNS_STREAM = "bigram.signs.table"  # the sign table's random stream: its buffer's name


def bigram_table_rows(config: Hyperparameters) -> int:
    """--bigram_embed's table rows: floor(bigram_table_multiple x table_rows) (5 x 50,304 = 251,520;
    7.5 x 50,304 = 377,280, 7.5 x 512 = 3,840 at the tiny preset)."""
    return math.floor(config.bigram_table_multiple * config.table_rows)


SIGN_ROWS_PR299 = 8192  # #299's sign table


def bigram_sign_ids(ids: torch.Tensor, sign_rows: int) -> torch.Tensor:
    """The sign-table row of each position of one rank's sequence `ids` (T,), int64: 0 at position 0,
    (t_(i-1) XOR t_i) mod sign_rows for i >= 1. As the bigram hash (bigram_ids), across documents,
    from the sequence the forward receives; position 0, which has no previous token, takes row 0."""
    t = ids.long()
    return torch.cat([t.new_zeros(1), torch.remainder(t[:-1] ^ t[1:], sign_rows)])


def sign_table(seed: int, rows: int, dim: int) -> torch.Tensor:
    """(rows, dim) fp32 of +-1: the sign of a standard normal draw (+1 for a draw of 0) from the stream
    of its own name, so every rank and every resumed run of a seed has the same table."""
    draw = torch.randn((rows, dim), generator=_param_generator(seed, BIGRAM_SIGNS_STREAM))
    return torch.where(draw >= 0, 1.0, -1.0)


class BigramSigns(nn.Module):
    """--bigram_sign_rows: the bigram row b_t = table[h_t] becomes b_t * S[bigram_sign_ids(x)_t], S a
    fixed (bigram_sign_rows, model_dim) table of +-1 in the model dtype. S is a buffer: no gradient,
    no optimizer state, not counted as a parameter, not saved (init_parameters draws it from the
    seed). The product is exact, and so is its backward: the table's gradient is the signless one
    times s_t, position by position, so its rows stay as sparse as before (send_touched_rows)."""

    def __init__(self, config: Hyperparameters, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("table", torch.empty(config.bigram_sign_rows, config.model_dim, dtype=dtype),
                             persistent=False)

    @torch.no_grad()
    def fill(self, seed: int) -> None:
        self.table.copy_(sign_table(seed, *self.table.shape))

    def forward(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows (1, T, d) times the signs of ids' positions."""
        return rows * F.embedding(bigram_sign_ids(ids, self.table.shape[0]), self.table)[None]


def check_bigram_signs(cfg: Hyperparameters) -> None:
    """§14's config rules: the hash's mod M needs M = rows - 1 >= 1; the sign index (x_(t-1) XOR x_t)
    mod N reads rows below 2^b only (b: the bits of the largest token id), so more rows are never read
    (a billion of them would not even fit in memory): at most that many, or #299's 8192."""
    if cfg.bigram_embed:
        require(bigram_table_rows(cfg) >= 2, "bigram_table_multiple", f"{cfg.bigram_table_multiple:g} x "
                f"{cfg.table_rows} rows gives {bigram_table_rows(cfg)}: the hash needs 2 rows or more")
    reachable = 2 ** (cfg.vocab_size - 1).bit_length()
    require(cfg.bigram_sign_rows <= max(reachable, SIGN_ROWS_PR299), "bigram_sign_rows",
            f"{cfg.bigram_sign_rows} rows, but the XOR of two token ids below {cfg.vocab_size} is below {reachable}: "
            f"rows past it are never read; give at most {max(reachable, SIGN_ROWS_PR299)} (#299: 8192)")


# =============================================================================
# 15. PR #322 (docs/short-track-transfer.md section 6): the MLP's backward from relu(pre)^2
#     (--mlp_backward_from_post); short_track_mlp, MLP.forward wherever §15's or §17's switches act

def short_track_mlp(mlp: "MLP", x: torch.Tensor) -> torch.Tensor:
    """MLP.forward with --mlp_backward_from_post, or in training with --fp8_mlp_up/--fp8_mlp_down: the
    plain forward's casts (each weight .type_as the input) and output-weight storage
    (--mlp_proj_transposed); §17's FP8 products in training only (validation keeps the plain ones);
    with §15 one autograd function around both products (MLPFromPost), else autograd through relu and
    the square as the plain MLP. --fp8_mlp_down's scales: read before, the slice's updated after."""
    w1 = mlp.fc_w.type_as(x)
    w2 = (mlp.proj_w.T if mlp.transposed else mlp.proj_w).type_as(x)  # (d, hidden); hidden is in x's dtype
    fp8_up = mlp.fp8_up and mlp.training
    down = mlp.fp8_down.scales(w2) if mlp.fp8_down is not None and mlp.training else None
    if mlp.from_post and down is None:
        return MLPFromPost.apply(x, w1, w2, fp8_up, None)
    if mlp.from_post:
        out, post_max = MLPFromPost.apply(x, w1, w2, fp8_up, down)
    else:
        hidden = F.relu(FP8UpProduct.apply(x, w1) if fp8_up else F.linear(x, w1)).square()
        if down is None:
            return F.linear(hidden, w2)
        out, post_max = FP8DownProduct.apply(hidden, w2, *down), hidden.detach().amax()
    mlp.fp8_down.record(post_max)
    return out


class MLPFromPost(torch.autograd.Function):
    """--mlp_backward_from_post (#322): out = post W2^T with post = relu(pre)^2, pre = x W1^T (or
    §17's FP8 pre); kept for backward: x, post and the two weights, never pre or relu(pre). The
    backward rebuilds relu(pre) as sqrt(post): dpre = (g W2) * 2 sqrt(post), 0 where post = 0 (as
    relu's backward gives there). Equal to the plain backward wherever pre squares exactly in its
    dtype, else within one rounding (sqrt(post) = |pre| (1 + e), |e| <= 2^-9 in bf16).
    apply(x (..., d), W1 (hidden, d), W2 (d, hidden), both in x's dtype, fp8_up, §17's down scales or
    None) -> out (..., d); with the down scales (out, max of post)."""

    @staticmethod
    def forward(ctx, x, w1, w2, fp8_up: bool, down=None):
        pre = fp8_up_product(x, w1) if fp8_up else F.linear(x, w1)
        post = F.relu(pre).square()
        ctx.save_for_backward(x, post, w1, w2)
        if down is None:
            return F.linear(post, w2)
        post_max = post.amax()  # for --fp8_mlp_down's next activation scale (not differentiated)
        ctx.mark_non_differentiable(post_max)
        return fp8_down_product(post, w2, *down), post_max

    @staticmethod
    def backward(ctx, grad, *_):
        x, post, w1, w2 = ctx.saved_tensors
        g, h, x2 = (t.reshape(-1, t.shape[-1]) for t in (grad, post, x))  # tokens x features
        dpost = g @ w2
        dpre = torch.where(h > 0, dpost * (2 * h.sqrt()), 0)
        return (dpre @ w1).view(x.shape), dpre.t() @ x2, g.t() @ h, None, None


# =============================================================================
# 16. PR #337 (docs/short-track-transfer.md section 7): prefix token prediction (--prefix_loss_weight).
#     The training loss of each position t adds w (LSE_t - z_t[p(y_t)]), p(y) the token whose bytes are
#     the longest proper prefix of y's (none: no term), z the capped logits: one more column of the
#     multi-token loss, and one more term per row of both fused kernels. w follows the multi-token
#     phases (prefix_loss_weight_at). The table is made once, when the model is built, from the token
#     byte files beside --token_bytes_file. Validation is unchanged.

TOKEN_LENGTHS_SUFFIX, TOKEN_STRINGS_SUFFIX = "_token_bytes.npy", "_tokens.bin"


def token_strings_file(token_bytes_file: str) -> str:
    """The file of every token's bytes beside a table of their lengths (data/gpt2_token_bytes.py and
    data/synthetic.py write both): <name>_token_bytes.npy -> <name>_tokens.bin."""
    return token_bytes_file[:-len(TOKEN_LENGTHS_SUFFIX)] + TOKEN_STRINGS_SUFFIX


def token_strings(lengths: np.ndarray, blob: bytes) -> list[bytes]:
    """Each token's bytes: token i is blob[sum(lengths[:i]) : sum(lengths[:i + 1])]."""
    ends = np.cumsum(lengths.astype(np.int64)).tolist()
    return [blob[start:end] for start, end in zip([0] + ends[:-1], ends)]


def longest_prefix_table(tokens: list[bytes]) -> np.ndarray:
    """p (len(tokens),) int64: p[y] is the token whose bytes are the longest proper prefix of y's, -1 where
    no token's are (one byte, or none: end-of-text). An empty token is no one's prefix; of tokens with
    equal bytes the lowest id is the one found (GPT-2 has none). In sorted order every prefix comes
    before the strings it starts, and everything between them starts with it too, so a stack of the
    current string's prefix tokens finds each one: O(V log V), once when the model is built."""
    table = np.full(len(tokens), -1, dtype=np.int64)
    strings, ids = [], []  # the prefix tokens of the current string, shortest first
    for b, token in sorted((b, token) for token, b in enumerate(tokens) if b):
        while strings and not b.startswith(strings[-1]):
            strings.pop()
            ids.pop()
        if strings and strings[-1] == b:  # the same bytes as a lower id: the same prefix
            table[token] = table[ids[-1]]
            continue
        if ids:
            table[token] = ids[-1]
        strings.append(b)
        ids.append(token)
    return table


def prefix_table(config: Hyperparameters) -> np.ndarray:
    """p(y) for every padded id (padded_vocab_size,) int64, -1 for none (padding ids included), from
    --token_bytes_file's lengths and the token bytes beside it; ConfigError in one line naming the file
    and how to make it."""
    lengths, why_not = read_token_bytes(config)
    flag = "--prefix_loss_weight"
    if lengths is None:
        raise ConfigError(f"{flag}: its table comes from --token_bytes_file and the bytes beside it, but {why_not}; "
                          "make them with data/gpt2_token_bytes.py (or data/synthetic.py)")
    path = Path(token_strings_file(config.token_bytes_file))
    fix = ("delete data/synthetic/ so the tiny preset writes it again" if config.token_bytes_file ==
           PRESETS["tiny"]["token_bytes_file"] else "make it with data/gpt2_token_bytes.py (or data/synthetic.py)")
    if not path.is_file():
        raise ConfigError(f"{flag}: {path}, every token's bytes beside --token_bytes_file, is missing; {fix}")
    blob = path.read_bytes()
    if len(blob) != int(lengths.astype(np.int64).sum()):
        raise ConfigError(f"{flag}: {path} holds {len(blob)} bytes, --token_bytes_file's lengths sum to "
                          f"{int(lengths.astype(np.int64).sum())}: not the same vocabulary; {fix}")
    table = np.full(config.padded_vocab_size, -1, dtype=np.int64)
    table[:config.vocab_size] = longest_prefix_table(token_strings(lengths, blob))
    return table


def prefix_loss_weight_at(step: int, config: Hyperparameters) -> Optional[float]:
    """w at `step`, None where there is no prefix term: tied to the multi-token phases as #337 ties it
    (multi_token_weights, same x and edges): prefix_loss_weight while three weights are active (step/S
    < 1/12), falling linearly toward 0 while two are (as the second weight falls), then none."""
    x = step / (scheduled_steps(config) / 4)
    if x < 1 / 3:
        return config.prefix_loss_weight
    if x < 2 / 3:
        return config.prefix_loss_weight * (1 - (3 * x - 1))
    return None


class PrefixTargets(nn.Module):
    """The table p (padded_vocab_size,) int64 and this step's w (1,) fp32, both buffers outside the
    state dict (made again from the files; w from the step), and whether the term is on at this step
    (`active`, a Python bool set by the trainer each step, as embed_tied; on at w = prefix_loss_weight
    after it is built, for a model used outside the trainer)."""

    def __init__(self, config: Hyperparameters):
        super().__init__()
        self.config, self.active = config, True
        self.register_buffer("table", torch.full((config.padded_vocab_size,), -1, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("weight", torch.empty(1, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def fill_table(self) -> None:
        """The table from the byte files (prefix_table); w = prefix_loss_weight, on."""
        self.table.copy_(torch.from_numpy(prefix_table(self.config)))
        self.set_weight(self.config.prefix_loss_weight)

    def set_weight(self, w: Optional[float]) -> None:
        """w for the next forwards (a fill kernel, no host-device copy); None: no prefix term."""
        self.active = w is not None
        if self.active:
            self.weight.fill_(w)

    def set_step(self, step: int) -> None:
        self.set_weight(prefix_loss_weight_at(step, self.config))

    def terms(self, targets: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(p(y_t) (T,), w (1,)) for next-token targets y, or None while the term is off."""
        return (self.table[targets], self.weight) if self.active else None


def prefix_columns(ahead: torch.Tensor, inside: torch.Tensor, weights: torch.Tensor,
                   prefix: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """multi_token_targets' (T, K) targets and inside, and the weights (K,), with the prefix term as a
    last column: target p(y_t) (column 0 where none), inside where p(y_t) >= 0, weight w."""
    p, w = prefix
    return (torch.cat([ahead, p.clamp_min(0)[:, None]], 1), torch.cat([inside, (p >= 0)[:, None]], 1),
            torch.cat([weights, w.to(weights.dtype)]))


def check_prefix(cfg: Hyperparameters) -> None:
    """§16's config rules: the weight follows the multi-token phases; the table needs the byte files."""
    if not cfg.prefix_loss_weight:
        return
    require(cfg.multi_token_prediction, "prefix_loss_weight", "follows the multi-token phases (prefix_loss_weight_at): "
            "it needs --multi_token_prediction")
    require(cfg.token_bytes_file.endswith(TOKEN_LENGTHS_SUFFIX), "prefix_loss_weight",
            f"its table comes from --token_bytes_file (a *{TOKEN_LENGTHS_SUFFIX}) and the *{TOKEN_STRINGS_SUFFIX} "
            f"beside it; --token_bytes_file={cfg.token_bytes_file!r} is not one (data/gpt2_token_bytes.npy is)")


# =============================================================================
# 17. PRs #306 and #342 (docs/short-track-transfer.md sections 4 and 8): the MLP's products in FP8
#     e4m3, the input projection (--fp8_mlp_up) and the output projection with delayed scales
#     (--fp8_mlp_down). The FP8 codes and products: triton_kernels.py

def fp8_up_codes(x: torch.Tensor, w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """--fp8_mlp_up's codes and dequantization factor, per tensor, rounded where #306 rounds:
        s_W = max|W1| / 448           in W1's dtype (#306 quantizes the bf16 bank eagerly: a bf16 scale),
        W8 = e4m3(W1 / s_W)           the quotient in W1's dtype (bf16), then to e4m3: two roundings,
        a = max|x| (at least 1e-12),  x8 = e4m3(x (448 / a))   in fp32 (inside #306's compiled forward),
        dequant = (s_W a) / 448       fp32, each operation rounded (#306's in-place fp32 buffer),
    returned as (x8, W8, dequant), dequant a 0-d fp32 device tensor (no host sync). Both maxima map
    to 448, e4m3's largest: no code saturates. s_W is #306's "per optimizer step" scale computed here
    from the current weight: the weight changes only at the step, so every forward between two steps
    gets the same value (one small max per block and forward)."""
    top = kernels.FP8_E4M3_MAX
    a = x.abs().amax().float().clamp_min(1e-12)
    s_w = w1.abs().amax().clamp_min(1e-12) / top  # in W1's dtype, as #306's bf16 bank
    dequant = s_w.float() * a / top
    return kernels.to_fp8(x.float() * (top / a), 1.0), kernels.to_fp8(w1 / s_w, 1.0), dequant


def fp8_up_product(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """--fp8_mlp_up's forward: pre = x W1^T (..., hidden) = (x8 @ W8^T) dequant from fp8_up_codes, the
    accumulator times the one factor as #306's kernel does, accumulated in fp32 (no fast
    accumulation: #306's kernel accumulates in fp32) and rounded once to x's dtype (bf16 in the
    model). The codes are freed after the product."""
    x8, w8, dequant = fp8_up_codes(x, w1)
    pre = kernels.fp8_matmul(x8.reshape(-1, x.shape[-1]), w8.t(), dequant, 1.0, x.dtype)
    return pre.view(*x.shape[:-1], w1.shape[0])


class FP8UpProduct(torch.autograd.Function):
    """--fp8_mlp_up without §15: pre = fp8_up_product(x, W1); the backward is the plain product's,
    from x and W1 in their dtype (bf16): dx = G W1, dW1 = G^T x at the FP8 forward's activations.
    Kept for backward: x and W1, as F.linear keeps (the codes are freed after the product)."""

    @staticmethod
    def forward(ctx, x, w1):
        ctx.save_for_backward(x, w1)
        return fp8_up_product(x, w1)

    @staticmethod
    def backward(ctx, grad):
        x, w1 = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        return (g @ w1).view(x.shape), g.t() @ x.reshape(-1, x.shape[-1])


# ---- --fp8_mlp_down (#342): the output projection from e4m3 codes with delayed scales

FP8_DOWN_ACT_HEADROOM, FP8_DOWN_WEIGHT_HEADROOM = 1.80, 1.12  # the short track's, kept (a choice)
# #342 requantizes W2 before step 0 and after each step s with bootstrap_down=(s < 16): the forwards of
# steps 0..16 quantize it with its current max (W2 starts at 0 and grows fast), step 17 on with the delay
FP8_DOWN_BOOTSTRAP_STEPS = 16


class FP8DownScales(nn.Module):
    """--fp8_mlp_down's state of one block, kept in the model's state_dict (so in checkpoints and in
    the warm-up's restore, with the weights):
      act (batch_slices,) fp32: slice j's activation scale s_a = max(amax, 1e-12) 1.80 / 448 from the
        largest post of this block in slice j's previous training forward; 1.0 before the first.
        The record keeps one per GPU, each GPU one slice: per slice here, the 8-GPU codes at any
        world size and accumulation;
      weight (3,) fp32: [the delayed weight scale (1.12 x the previous step's max|W2| / 448), max|W2|
        of this step (written by each training forward), 1.0 while the current max|W2| / 448 is used
        instead (steps 0..16)], W2 as the product reads it (in the activations' dtype);
      act_next (batch_slices,) fp32 (not saved): what each training forward records for its slice, made
        act after the step (refresh_fp8_down_weights). A slice runs once a step, so it reads what its
        previous forward left, and a forward recomputed by --activation_checkpointing reads the same;
      slice () int64 (not saved): the slice the next training forward belongs to (set_fp8_down_slice).
    No parameters."""

    def __init__(self, batch_slices: int):
        super().__init__()
        self.register_buffer("act", torch.empty(batch_slices, dtype=torch.float32))
        self.register_buffer("weight", torch.empty(3, dtype=torch.float32))
        self.register_buffer("act_next", torch.empty(batch_slices, dtype=torch.float32), persistent=False)
        self.register_buffer("slice", torch.empty((), dtype=torch.int64), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The starting values (build_model makes the buffers on the meta device, then fills them here)."""
        self.act.fill_(1.0)
        self.act_next.fill_(1.0)
        self.weight.copy_(torch.tensor([1.0, 0.0, 1.0]))
        self.slice.zero_()

    def scales(self, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_a, s_w), 0-d fp32 device tensors, for this forward's slice and the weight w2 as the
        product reads it (any layout: a max); records max|w2| for the step's refresh. The bootstrap
        scale max|W2| / 448 is formed in w2's dtype, as #342 forms it eagerly on its bf16 bank (a bf16
        scale: 0.0022277832 for a maximum of 1, not fp32's 0.0022321430)."""
        s_a = self.act.index_select(0, self.slice.view(1)).view(())
        w_max = w2.detach().abs().amax()  # exact in w2's dtype: a max
        with torch.no_grad():
            self.weight[1:2].copy_(w_max.float().view(1))
        current = (w_max.clamp_min(1e-12) / kernels.FP8_E4M3_MAX).float()
        return s_a, torch.where(self.weight[2] > 0, current, self.weight[0])

    def record(self, post_max: torch.Tensor) -> None:
        """After the forward: the slice's next activation scale from this forward's largest post,
        max(amax, 1e-12) x (1.80 / 448), one fp32 product with the constant as #342's kernel forms it."""
        scale = post_max.detach().float().clamp_min(1e-12) * (FP8_DOWN_ACT_HEADROOM / kernels.FP8_E4M3_MAX)
        with torch.no_grad():
            self.act_next.index_copy_(0, self.slice.view(1), scale.view(1))


def fp8_down_modules(model: nn.Module) -> list[FP8DownScales]:
    return [m for m in model.modules() if isinstance(m, FP8DownScales)]


def reset_fp8_down_scales(model: nn.Module) -> None:
    """init_parameters' part: every block's --fp8_mlp_down scales at their starting values."""
    for m in fp8_down_modules(model):
        m.reset()


def set_fp8_down_slice(downs: list[FP8DownScales], index: int) -> None:
    """The training forward that follows is global slice `index` (rank x micro_steps + micro-batch):
    a fill of each block's device tensor (a kernel launch, no host-device copy). downs: the model's
    fp8_down_modules, found once by the Runner."""
    for m in downs:
        m.slice.fill_(index)


@torch.no_grad()
def refresh_fp8_down_weights(downs: list[FP8DownScales], step: int) -> None:
    """After step `step`'s update (#342's requantization, bootstrap_down=(step < 16)): the next step's
    weight scale is max(max|W2| of step `step`, 1e-12) x (1.12 / 448), one fp32 product as #342's
    kernel forms it (max|W2| of the weight before this update, as its forwards recorded it); after
    steps 0..15 the next step's forwards use the current max|W2| / 448 instead (so steps 0..16 do).
    The codes are made in each forward from the weight (unchanged until the next step) with that
    scale. The activation scales the step's forwards recorded (act_next) become the ones the next
    step's use. Device ops only (no host read)."""
    bootstrap = float(step < FP8_DOWN_BOOTSTRAP_STEPS)
    for down in downs:
        down.weight[0:1].copy_(down.weight[1:2].clamp_min(1e-12) * (FP8_DOWN_WEIGHT_HEADROOM / kernels.FP8_E4M3_MAX))
        down.weight[2:3].fill_(bootstrap)
        down.act.copy_(down.act_next)  # the activation scales this step's forwards recorded


@torch.no_grad()
def share_fp8_down_scales(model: nn.Module, rank: int, world_size: int) -> None:
    """Before a checkpoint: every rank takes each slice's activation scale from the rank that ran the
    slice (rank r runs slices r*m .. r*m + m - 1, m = batch_slices / world_size), so the checkpoint,
    written by rank 0, holds every slice's, and a resume at any world size reads the right one. One
    all-reduce of the (blocks, batch_slices) scales, each summed with zeros only: exact."""
    downs = fp8_down_modules(model)
    if not downs or world_size == 1:
        return
    act = torch.stack([down.act for down in downs])  # (L, batch_slices)
    m = act.shape[1] // world_size
    mine = torch.zeros_like(act, dtype=torch.bool)
    mine[:, rank * m:(rank + 1) * m] = True
    shared = torch.where(mine, act, torch.zeros_like(act))
    dist.all_reduce(shared)
    for down, row in zip(downs, shared):
        down.act.copy_(row)


def fp8_down_product(post: torch.Tensor, w2: torch.Tensor, s_a: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """out = post W2^T (..., d) from e4m3 codes (#342): post8 = e4m3(min(post (1 / s_a), 448)) (post >= 0;
    times the fp32 reciprocal, as #342's kernel writes the codes),
    W8 = e4m3(clamp(W2 / s_w, -448, 448)), (post8 @ W8^T) s_a s_w with fast accumulation (the
    record's), rounded once to post's dtype. w2 (d, hidden) as the MLP uses it (a view of the
    (hidden, d) storage with --mlp_proj_transposed). Saturates where post passes 1.80 x the last
    maximum or the weight has grown 12 % past the last step's."""
    post8 = kernels.to_fp8(post.reshape(-1, post.shape[-1]).float() * (1 / s_a), 1.0)
    w8 = kernels.to_fp8(w2, s_w)
    out = kernels.fp8_matmul(post8, w8.t(), s_a, s_w, post.dtype, fast_accum=True)
    return out.view(*post.shape[:-1], w2.shape[0])


class FP8DownProduct(torch.autograd.Function):
    """--fp8_mlp_down without §15: fp8_down_product forward, the plain product's backward in post's
    dtype from post and W2 (dpost = G W2, dW2 = G^T post). Keeps post and W2, as F.linear does."""

    @staticmethod
    def forward(ctx, post, w2, s_a, s_w):
        ctx.save_for_backward(post, w2)
        return fp8_down_product(post, w2, s_a, s_w)

    @staticmethod
    def backward(ctx, grad):
        post, w2 = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        return (g @ w2).view(post.shape), g.t() @ post.reshape(-1, post.shape[-1]), None, None


def check_fp8_mlp(cfg: Hyperparameters) -> None:
    """§17's config rule: _scaled_mm takes an FP8 product's inner and outer widths in multiples of 16."""
    hidden = cfg.mlp_ratio * cfg.model_dim
    for flag in ("fp8_mlp_up", "fp8_mlp_down"):
        require(not getattr(cfg, flag) or (cfg.model_dim % 16 == 0 and hidden % 16 == 0), flag,
                f"its FP8 product needs model_dim ({cfg.model_dim}) and mlp_ratio x model_dim ({hidden}) in "
                f"multiples of 16 (torch._scaled_mm): change the widths or drop --{flag}")


# =============================================================================
# 18. PR #315 (docs/short-track-transfer.md section 5): the MUDD gate nets and lightweight dynamically
#     composable attention. Output gates on chosen blocks only (--attn_gate_layers); two small nets
#     setting per-token coefficients in place of static ones (--mudd_gate, --mudd_gate_layer,
#     --mudd_gate_lr); DC on chosen blocks (--dc_layers, --dc_window), in a torch band form

GATE_NET_HIDDEN = 64  # each net's hidden width, as MUDD's
GATE_NET_SCALE = 0.1  # s, the learned output scale, at the start
GATE_NET_BETAS = (0.9, 0.99)
# the starting outputs of #315's biases (bias = output / s): output gates 0.25 (the plain model's
# sigmoid(0) = 0.5 is the neutral value), skips 0.5 (neutral 1, the plain 2 sigmoid(0)), the bigram
# weight bigram_lambda_init, DC's w1 1; XSA alphas, x0 weights and DC's w2 0
GATE_NET_START = dict(gate=0.25, skip=0.5, dc_w1=1.0)
GATE_NET_NEUTRAL_START = dict(GATE_NET_START, gate=0.5, skip=1.0)  # --mudd_gate_start=neutral
DC_W1_EPS = 1e-6  # w1n = w1 / sqrt(mean_h w1^2 + 1e-6)


class GateSlot(NamedTuple):
    """One entry of a gate net's output row: `role` for block `block` (a skip: its target) in
    columns start .. start + len(starts) - 1, starting at the outputs `starts`."""
    role: str  # xsa (alphas, before tanh), gate (output gates), weights (x00, x01, ..., bigram), skip, dc_w1, dc_w2
    block: int
    start: int
    starts: tuple[float, ...]


def mudd_gate_layer(cfg: Hyperparameters) -> int:
    """The block at whose input net 1 reads the stream: --mudd_gate_layer, auto round(4/11 x L)."""
    return round(4 / 11 * cfg.num_layers) if cfg.mudd_gate_layer is None else cfg.mudd_gate_layer


def gate_net_layout(cfg: Hyperparameters) -> tuple[tuple[GateSlot, ...], tuple[GateSlot, ...]]:
    """What each net's outputs are, in order of role then block: XSA alphas of the xsa_layers blocks,
    output gates of the gated blocks (--attn_gate_layers), the input weights (x00, x01, ..., the
    bigram row) of blocks 0..L-1 (0..L-2 with --mudd: its last block has its own), the gated skips
    (by target), DC's w1 then its w2 of the dc_layers blocks. A block's entries (a skip's: its
    target's) come from net 0 before mudd_gate_layer, from net 1 from there on."""
    H, L, layer = cfg.num_heads, cfg.num_layers, mudd_gate_layer(cfg)
    start = GATE_NET_NEUTRAL_START if cfg.mudd_gate_start == "neutral" else GATE_NET_START
    weights = (0.0,) * (1 + cfg.num_extra_embeds) + ((cfg.bigram_lambda_init,) if cfg.bigram_embed else ())
    entries = ([("xsa", b, (0.0,) * H) for b in sorted(set(cfg.xsa_layers))]
               + [("gate", b, (start["gate"],) * H) for b in cfg.gated_layers]
               + [("weights", b, weights) for b in range(L - 1 if cfg.mudd else L)]
               + [("skip", t, (start["skip"],)) for t, _ in cfg.skip_connections if cfg.gated_skips]
               + [("dc_w1", b, (start["dc_w1"],) * H) for b in sorted(set(cfg.dc_layers))]
               + [("dc_w2", b, (0.0,) * H) for b in sorted(set(cfg.dc_layers))])
    nets = ([], [])
    for role, block, starts in entries:
        net = nets[int(block >= layer)]
        start = net[-1].start + len(net[-1].starts) if net else 0
        net.append(GateSlot(role, block, start, starts))
    return tuple(nets[0]), tuple(nets[1])


def gate_net_kept_bytes(cfg: Hyperparameters, T: int) -> int:
    """The memory model's estimate of what §18 keeps for the backward over T tokens (see peak_parts)."""
    if not cfg.mudd_gate:
        return 0
    outputs = sum(len(slot.starts) for net in gate_net_layout(cfg) for slot in net)
    nets = 2 * 2 * T * GATE_NET_HIDDEN * 2 + T * outputs * 2
    # DCBand keeps P (T, H, W) fp32 and the padded k and v (T + W - 1, attn_dim) bf16 (q, w1n, w2: the
    # attention's and the nets' own); tests/test_mudd_gate.py counts what a compiled DC keeps
    dc = T * cfg.num_heads * cfg.dc_window * 4 + 2 * (T + cfg.dc_window - 1) * cfg.attn_dim * 2
    return nets + len(set(cfg.dc_layers)) * dc


def gate_net_bias(shape, gen, layout) -> torch.Tensor:
    """b2g (2, n): each slot's starting outputs / s (gen unused); the padding of the shorter net 0."""
    b = torch.zeros(shape)
    for k, net in enumerate(layout):
        for slot in net:
            b[k, slot.start:slot.start + len(slot.starts)] = torch.tensor(slot.starts) / GATE_NET_SCALE
    return b


class GatedAttention(NamedTuple):
    """A block's attention coefficients from the gate nets (§18 --mudd_gate), each per token or None:
    the XSA alphas (1, T, H, 1) before tanh, the output gates (1, T, H, 1) (used as they are), DC's w1
    and w2 (1, T, H) and the (T, W) window of keys each query may see (dc_window_mask)."""
    xsa_alpha: Optional[torch.Tensor]
    output_gate: Optional[torch.Tensor]
    dc_w1: Optional[torch.Tensor] = None
    dc_w2: Optional[torch.Tensor] = None
    dc_valid: Optional[torch.Tensor] = None


class GatedBlock(NamedTuple):
    """Block i's coefficients from the gate nets: the skip weight into it ((1, T, 1) or None), its
    input weights (a tuple of (1, T, 1): x00, x01, ..., the bigram row's), its GatedAttention (None
    without attention)."""
    skip: Optional[torch.Tensor]
    input_weights: tuple
    attn: Optional[GatedAttention]


class MuddGate(nn.Module):
    """--mudd_gate (#315): two nets k = 0, 1, a = GELU(W1g[k] h) (64 wide, exact GELU), out =
    (W2g[k] a + b2g[k]) s per token, net 0 from x00 before block 0, net 1 from the raw stream at the
    input of block mudd_gate_layer; gate_net_layout says what each output is. W1g (2, 64, d) uniform
    +-1/sqrt(d), W2g (2, n, 64) zero (n: the longer net's outputs), b2g (2, n) the starting outputs
    / s, all bf16 whatever the model dtype; s (1,) fp32 from 0.1, used in bf16. Adam group
    `mudd_gate`: lr --mudd_gate_lr, betas 0.9/0.99, wd x1 on W1g and W2g, none on b2g and s. Each
    net's output is the fp32 sum times s, rounded once to the stream's dtype."""

    def __init__(self, config: Hyperparameters):
        super().__init__()
        d, bf16 = config.model_dim, torch.bfloat16
        self.layout, self.layer, self.heads = gate_net_layout(config), mudd_gate_layer(config), config.num_heads
        self.slots = {(slot.role, slot.block): (k, slot) for k, net in enumerate(self.layout) for slot in net}
        self.attention_layers = set(config.attention_layers)
        self.skip_index = {target: j for j, (target, _) in enumerate(config.skip_connections)}
        self.eot, self.dc_window, self.dc_layers = config.eot_token, config.dc_window, set(config.dc_layers)
        n = max(1, *(len(net) and net[-1].start + len(net[-1].starts) for net in self.layout))
        options = dict(betas=GATE_NET_BETAS, lr="mudd_gate_lr")
        self.w1 = declare(nn.Parameter(torch.empty(2, GATE_NET_HIDDEN, d, dtype=bf16)), "mudd_gate",
                          uniform_init(d**-0.5), wd_mul=1.0, **options)
        self.w2 = declare(nn.Parameter(torch.empty(2, n, GATE_NET_HIDDEN, dtype=bf16)), "mudd_gate", zeros,
                          wd_mul=1.0, **options)
        self.bias = declare(nn.Parameter(torch.empty(2, n, dtype=bf16)), "mudd_gate",
                            functools.partial(gate_net_bias, layout=self.layout), wd_mul=0.0, **options)
        self.scale = declare(nn.Parameter(torch.empty(1, dtype=torch.float32)), "mudd_gate",
                             constant_init([GATE_NET_SCALE]), wd_mul=0.0, **options)

    def net(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Net k's outputs (1, T, n) from h (1, T, d), in h's dtype."""
        a = F.gelu(F.linear(h, self.w1[k].type_as(h)))  # (1, T, 64)
        z = F.linear(a, self.w2[k].type_as(a))  # (1, T, n)
        s = self.scale[0].to(torch.bfloat16).float()
        return ((z.float() + self.bias[k].float()) * s).to(h.dtype)

    def at_block(self, i: int, x: torch.Tensor, x00: torch.Tensor, ids: torch.Tensor, nets: Optional[tuple],
                 slots: dict) -> tuple[tuple, GatedBlock]:
        """At block i's input x (before its skip): runs net 0 (i = 0) and net 1 (i = mudd_gate_layer),
        (net outputs so far and DC's window mask, block i's GatedBlock)."""
        if i == 0:
            valid = dc_window_mask((ids == self.eot).cumsum(0), self.dc_window) if self.dc_layers else None
            nets = (self.net(0, x00), None, valid)
        if i == self.layer:
            nets = (nets[0], self.net(1, x), nets[2])
        return nets, self.block(i, nets, slots)

    def take(self, nets: tuple, role: str, block: int) -> Optional[torch.Tensor]:
        """The columns of (role, block), (1, T, width), or None where the layout has none."""
        if (role, block) not in self.slots:
            return None
        k, slot = self.slots[role, block]
        return nets[k][..., slot.start:slot.start + len(slot.starts)]

    def block(self, i: int, nets: tuple, slots: dict) -> GatedBlock:
        heads = lambda t: None if t is None else t[..., None]  # (1, T, H) -> (1, T, H, 1)
        skip = self.take(nets, "skip", i)
        if skip is not None:
            skip = torch.sigmoid(slots["skip_gain"][self.skip_index[i]]) * skip
        w = self.take(nets, "weights", i)
        weights = () if w is None else tuple(w[..., j:j + 1] for j in range(w.shape[-1]))
        dc = i in self.dc_layers
        attn = GatedAttention(heads(self.take(nets, "xsa", i)), heads(self.take(nets, "gate", i)),
                              self.take(nets, "dc_w1", i), self.take(nets, "dc_w2", i), nets[2] if dc else None
                              ) if i in self.attention_layers else None
        return GatedBlock(skip, weights, attn)


def gated_attention(y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale,
                    gated: GatedAttention) -> torch.Tensor:
    """A block's attention output y (B, T, H, D) after the kernel, with --mudd_gate: DC's addition
    (--dc_layers; y + it in fp32, rounded once), XSA with the per-token alphas, then the output gates as
    they are."""
    if gated.dc_w1 is not None:
        y = (y.float() + dc_addition(q, k, v, gated.dc_w1, gated.dc_w2, gated.dc_valid, scale)).to(y.dtype)
    if gated.xsa_alpha is not None:
        y = xsa(y, v, gated.xsa_alpha)
    if gated.output_gate is not None:
        y = y * gated.output_gate
    return y


def dc_window_mask(docs: torch.Tensor, window: int) -> torch.Tensor:
    """(T, W) bool: query t sees key t - j (j = 0 .. W-1) where t - j >= 0 and both are in one document
    (docs (T,), the masks' document ids: cumsum(ids == eot))."""
    T = docs.numel()
    j = torch.arange(window, device=docs.device)
    back = torch.arange(T, device=docs.device)[:, None] - j[None, :]  # (T, W)
    return (back >= 0) & (docs[:, None] == docs[back.clamp_min(0)])


def delayed(x: torch.Tensor, window: int):
    """x (B, T, ...) padded in front with window - 1 zero rows, once: delayed(x, W)(j) is x delayed by j
    rows (row t holds row t - j, zeros for t < j), a view of that one padded tensor. DC's band form
    reads its W offsets through such views, so what a compiled forward keeps for the backward is the
    one padded tensor, not W shifted copies (the partitioner kept 2 W copies of k and v: ~28 GiB at
    the medium size)."""
    T = x.size(1)
    padded = F.pad(x, (0, 0) * (x.dim() - 2) + (window - 1, 0))
    return lambda j: padded[:, window - 1 - j:window - 1 - j + T]


def advanced_sum(terms, like: torch.Tensor, window: int) -> torch.Tensor:
    """sum_j of terms[j] (B, T, ...) advanced by j rows (row s takes row s + j, zeros past the end):
    the adjoint of delayed, accumulated in j order into one padded buffer."""
    T = like.size(1)
    total = like.new_zeros(like.size(0), T + window - 1, *like.shape[2:])
    for j, term in enumerate(terms):
        total[:, window - 1 - j:window - 1 - j + T] += term
    return total[:, window - 1:]


class DCBand(torch.autograd.Function):
    """--dc_layers: DC's addition (B, T, H, D) fp32 from q, k, v (B, T, H, D) as the attention used
    them, w1n and w2 (B, T, H), valid (T, W) (dc_window_mask) and the softmax scale (a number or 0-d
    tensor): P_h[t, j] = softmax_j(scale q_h[t] . k_h[t-j]) over the valid keys (the product of the
    stored values, summed in fp32), A[t, j] = sum_h w1n_h[t] P_h[t, j], out_g[t] = sum_j
    (w2_g[t] A[t, j]) v_g[t-j], the weights rounded to v's dtype before the fp32 product (#315's
    kernel). A band form: loops over the W offsets, each on (B, T, H, D) tensors read as views of one
    padded k and v in their dtype (delayed; each product promotes them to fp32 exactly); keeps q, k, v, w1n, w2 and P (B, T, H, W) fp32 for its backward, which
    recomputes the rest (the rounding of the weights passes the gradient straight through)."""

    @staticmethod
    def forward(ctx, q, k, v, w1n, w2, valid, scale):
        W, f32 = valid.shape[1], torch.float32
        work = torch.float64 if q.dtype == torch.float64 else f32
        qf, kj, vj = q.to(work), delayed(k, W), delayed(v, W)  # k, v in their dtype: each product promotes
        S = torch.stack([(qf * kj(j)).sum(-1) for j in range(W)], -1) * scale
        P = torch.softmax(S.masked_fill(~valid[None, :, None, :], float("-inf")), dim=-1)  # (B, T, H, W)
        A = (w1n.to(work)[..., None] * P).sum(2)  # (B, T, W)
        M = (w2.to(work)[..., None] * A[:, :, None, :]).to(v.dtype).to(work)  # (B, T, H, W)
        out = sum(M[..., j, None] * vj(j) for j in range(W))
        ctx.save_for_backward(q, k, v, w1n, w2, P)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, w1n, w2, P = ctx.saved_tensors
        scale, W, work = ctx.scale, P.shape[-1], P.dtype
        G, qf, w1f, w2f = grad.to(work), q.to(work), w1n.to(work), w2.to(work)
        kj, vj = delayed(k, W), delayed(v, W)
        A = (w1f[..., None] * P).sum(2)
        M = w2f[..., None] * A[:, :, None, :]
        dM = torch.stack([(G * vj(j)).sum(-1) for j in range(W)], -1)  # (B, T, H, W)
        dv = advanced_sum((M[..., j, None] * G for j in range(W)), G, W)
        dw2 = (dM * A[:, :, None, :]).sum(-1)
        dA = (dM * w2f[..., None]).sum(2)  # (B, T, W)
        dw1n = (dA[:, :, None, :] * P).sum(-1)
        dP = w1f[..., None] * dA[:, :, None, :]
        dS = P * (dP - (P * dP).sum(-1, keepdim=True)) * scale
        dq = sum(dS[..., j, None] * kj(j) for j in range(W))
        dk = advanced_sum((dS[..., j, None] * qf for j in range(W)), qf, W)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw1n.to(w1n.dtype), dw2.to(w2.dtype), None, None)


def dc_addition(q, k, v, w1: torch.Tensor, w2: torch.Tensor, valid: torch.Tensor, scale) -> torch.Tensor:
    """DC's addition to a block's attention output (fp32, or float64 from float64 inputs): DCBand with
    w1n = w1 / sqrt(mean_h w1^2 + 1e-6) per token, formed in fp32 and rounded to the attention's
    dtype (bf16 in the model) as #315's gate hands it to its kernel."""
    w1 = w1.double() if w1.dtype == torch.float64 else w1.float()
    w1n = F.rms_norm(w1, (w1.shape[-1],), eps=DC_W1_EPS)  # (B, T, H)
    return DCBand.apply(q, k, v, kernels.cast(w1n, q.dtype), w2, valid, scale)


def check_mudd_gate(cfg: Hyperparameters) -> None:
    """§18's config rules: the gated blocks exist and have attention; the gate layer exists; DC's
    blocks have attention and their weights come from the gate net."""
    require(not cfg.dc_layers or cfg.mudd_gate, "dc_layers", "its weights w1, w2 come from the gate net: add "
            "--mudd_gate")
    require_attention_blocks(cfg, "dc_layers")
    require(mudd_gate_layer(cfg) < cfg.num_layers or not cfg.mudd_gate, "mudd_gate_layer",
            f"block {mudd_gate_layer(cfg)} does not exist: choose one in 0..{cfg.num_layers - 1}")
    if cfg.attn_gate_layers is not None:
        require(cfg.attn_output_gate, "attn_gate_layers", "chooses blocks of the output gates: drop it or add "
                "--attn_output_gate")
    require_attention_blocks(cfg, "attn_gate_layers")


# #############################################################################
# Part III. Machinery: what a record diff does not touch. The command line and config checks; run
# setup, called once before training (run_training: device, threads, seed, input and output checks,
# the data, the log and its console ETA, the byte table); checkpoints; accounting (also the log's
# parameter and FLOP lines); dry run (with the collectives counted); benchmark. The timed loop's own
# helpers are in section 6.
# #############################################################################

class ConfigError(InputError, ValueError):
    """A bad flag or an inconsistent configuration; the message names the flag and the fix."""


class NonFiniteLossError(RuntimeError):
    """A nan/inf loss: the run stops, and nothing is saved over the last good checkpoint."""


class WriteError(RuntimeError):
    """A checkpoint, the log or the synthetic data could not be written (disk full, permissions);
    the message names the path and the OS error; the run stops (exit 3)."""


# ---- presets and recipes: named sets of flags over the record's values (make_config applies them)

# Presets are overrides of the record. `tiny` keeps the 16-layer structure (every layer pattern
# is exercised) at toy width, on synthetic data whose entropies are known (data/synthetic.py),
# and the record's step grid at 1/25 of its length: 4700 + 40 steps become 188 + 2, the
# momentum warm-up and cool-down 12 and 2 steps; the batch ramp keeps its proportions (1/4 .. 4/4
# of batch_slices x train_seq_len) and the windows their block counts, with 16-token blocks so
# that every window is shorter than a 512-token slice. Every phase of the record happens in it.
PRESETS: dict[str, dict] = {
    "medium": {},
    "tiny": dict(
        train_files="data/synthetic/synthetic_train_*.bin",
        val_files="data/synthetic/synthetic_val_*.bin",
        synthetic_data=True,
        token_bytes_file="data/synthetic/synthetic_token_bytes.npy",
        vocab_size=500, eot_token=499,  # padded: 512
        model_dim=64, num_heads=2, head_dim=32,
        train_seq_len=512, val_seq_len=512, batch_slices=2, val_tokens=8192,
        attn_block_size=16, max_window_tokens=27 * 16,
        document_cut_tokens=256,
        lore_rank=16,
        num_iterations=190, extension_steps=2, batch_schedule=(256, 512, 768) + (1024,) * 9,
        muon_momentum_warmup_steps=12, muon_momentum_cooldown_steps=2,
        val_every=38, warmup_steps=2,
    ),
}


@dataclass(frozen=True)
class Recipe:
    """A medium-track record as the values of the fields above it changes (over the defaults, which
    are the current record), with what its record published upstream (records/track_2_medium/<folder>/
    of KellerJordan/modded-nanogpt). The records before the current one run from their frozen
    script (records/x01_lineage/)."""
    values: dict
    date: str
    folder: str
    change: str  # what it changes, one line
    mean_time_s: float  # the record's published mean training time
    runs: int
    p_value: Optional[float]  # one-sided test of mean val loss < 2.92 (None: its logs allow none)
    peak_mib: int  # "peak memory allocated" in its log (8xH100)
    time_note: str = ""
    # an unmerged upstream pull request's claim (records/published.json marks it so): its number
    claim_pr: Optional[int] = None
    # under another preset, the recipe's values for fields the preset does not set; these replace them
    at_preset: dict = field(default_factory=dict)


# `--recipe NAME`: applied after the preset, before your flags. A preset keeps its scale (where it
# and the recipe set the same field, the preset wins) and the recipe its switches; `at_preset`
# adapts constants that count steps.
# the x01 lineage's records (2025-09-11 .. 2025-11-02) run from their own frozen script
FROZEN_SCRIPT = "records/x01_lineage/train_gpt_medium.py"
FROZEN_RECIPES = ("x01", "snoo", "update_smoothing", "smoothed_snoo", "backout", "smear")
RECIPES: dict[str, Recipe] = {
    "bulk": Recipe({}, "2025-12-31", "2025-12-31_BulkSmallTrackTransfer",
                   "the short track's features at medium scale: batch ramp, token windows with YaRN, gates, "
                   "tied->untied embeddings, multi-token prediction, NorMuon with Polar Express, cautious bf16 Adam "
                   "on odd steps", 1041.28, 2, 0.0046, 57_397),
    # p and time recomputed from its 5 committed logs (its README rounds p to 0.0001)
    "fp8_yarn": Recipe(dict(fp8=True, fp8_ranges=(32.0, 2.25, 1.5), head_transposed=True, yarn_window_limit=23,
                            muon_lr=0.012), "2026-03-28", "2026-03-28_FP8YaRNTuning",
                       "bulk plus an FP8 head matmul in training, the head stored transposed, YaRN at every window "
                       "change, Muon lr 0.012", 1011.372, 5, 1.08e-4, 63_702, claim_pr=248),
    # one committed log (its README lists five runs): time and n from that log, so no t-test
    "bigram": Recipe(dict(num_iterations=4620, fused_softcap_ce=True, fp8=True, fp8_ranges=(100.0, 1.6, 0.75),
                          head_transposed=True, bigram_embed=True, gates_optimizer="adam", small_params_betas="scalar",
                          scalar_lr=0.004, adam_fp32_moments=True, muon_lr_shape="blocks",
                          muon_scalar_rounding="pr252", fp32_block_weights=False, coordinate_descent_tuning=True),
                     "2026-04-07", "2026-04-07_BigramFusedCEUnifiedOpt",
                     "bulk plus a fused FP8 softcapped cross-entropy, bigram hash embeddings at every layer, #252's "
                     "optimizer table (gates on Adam, fp32 Adam moments, attention lr by block), bf16 block weights "
                     "with their fp32 master's low half, 4580+40 steps", 950.425, 1, None, 59_288, claim_pr=252,
                     at_preset=dict(tiny=dict(num_iterations=185))),  # S = 4580 / 25 = 183, +2
}
# PR #261 is #252's recipe plus these (its logs and README are in the folder's this_pr/)
RECIPES["mudd"] = Recipe({**RECIPES["bigram"].values, **dict(
    num_iterations=4150, extension_steps=25, attn_input_from_layer=11, mudd=True, backout=False,
    fused_ce_variant="pr261", coordinate_descent_tuning=False)}, "2026-04-27", "2026-0427-MuddFormer/this_pr",
    "bigram plus MUDD connections at the last two blocks in place of the backout, blocks 12-15 attending from "
    "block 11's output, #261's cross-entropy kernel (bf16 sigmoid, gradient made in the forward), 4125+25 steps", 860.478, 6, 6.2e-5, 59_977, claim_pr=261,
    at_preset=dict(tiny=dict(num_iterations=167)))  # S = 4125 / 25 = 165, +2


@dataclass(frozen=True)
class Candidate:
    """A recipe that is not a record: the values it sets over the defaults, what it is built on, and
    where it is described. It has not run on a GPU: no claim, no published time, no logged peak."""
    values: dict
    base: str  # the recipe it starts from (its values are included in `values`)
    change: str  # what it adds, one line
    docs: str
    at_preset: dict = field(default_factory=dict)


# `--recipe NAME` of a candidate for the next record: the ideas of Part II's sections 12-18 on mudd,
# on mudd's step grid until GPUs tune it (docs/short-track-transfer.md says how)
TRANSFER_IDEAS: dict = dict(
    xsa_layers=tuple(range(12)),  # §12 #264/#317: the blocks up to the last one MUDD's attention reads (11)
    muon_qk_group_heads=2,  # §13 #253
    bigram_sign_rows=8192, bigram_table_multiple=7.5,  # §14 #299, and #315's table of 7.5 x the vocabulary
    mlp_backward_from_post=True,  # §15 #322
    prefix_loss_weight=0.25,  # §16 #337
    fp8_mlp_up=True, fp8_mlp_down=True,  # §17 #306, #342
    mudd_gate=True, attn_gate_layers=(0, 4, 11, 15), dc_layers=(15,),  # §18 #315 (the gate net at block 6, auto)
)
CANDIDATES: dict[str, Candidate] = {
    "transfer": Candidate({**RECIPES["mudd"].values, **TRANSFER_IDEAS}, "mudd",
                          "mudd plus the short track's records since MUDD that carry over (Part II, sections 12-18)",
                          "docs/short-track-transfer.md", at_preset=RECIPES["mudd"].at_preset),
}
CANDIDATE_NOTE = "a candidate, not a record: not run on a GPU, no claim, no published time"


def recipe_values(preset: str, name: str) -> dict:
    """The fields recipe `name` sets under `preset`: its values, except those the preset sets itself
    (its scale), then its values for that preset."""
    if name in FROZEN_RECIPES:
        raise ConfigError(f"--recipe: {name} is an earlier record of the x01 lineage: run it from its frozen script, "
                          f"python {FROZEN_SCRIPT} --recipe={name}")
    if name not in RECIPES and name not in CANDIDATES:
        raise ConfigError(f"--recipe: unknown recipe {name!r}; choose from {', '.join([*RECIPES, *CANDIDATES])}")
    entry = RECIPES[name] if name in RECIPES else CANDIDATES[name]
    kept = {k: v for k, v in entry.values.items() if k not in PRESETS[preset]}
    return {**kept, **entry.at_preset.get(preset, {})}


# ---- flags <-> Hyperparameters: argparse driven by the dataclass fields

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _kind(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def from_text(f: dataclasses.Field, text: Optional[str]):
    """A flag's text as the field's type (text None: a bare flag). ArgumentTypeError if it cannot be."""
    kind = _kind(f)
    if "bool" in kind:
        if text is None or text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        if kind.startswith("Optional") and text.lower() in ("auto", "none"):
            return None
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    if text is None:
        raise argparse.ArgumentTypeError(f"needs a value: --{f.name}=VALUE")
    try:
        if kind in ("Optional[int]", "Optional[float]") and text.lower() in ("none", "auto"):
            return None
        if kind in ("int", "Optional[int]"):
            return int(text)
        if kind in ("float", "Optional[float]"):
            value = float(text)
            if not math.isfinite(value):
                raise argparse.ArgumentTypeError(f"{text} is not allowed; it must be a finite number "
                                                 f"{range_text(f)}".rstrip())
            return value
        if kind == "tuple[Optional[int], ...]":  # 0,1,2,-,...
            return tuple(None if s.strip() == "-" else int(s) for s in text.split(","))
        if kind == "tuple[tuple[int, int], ...]":  # 9<6,10<4
            return tuple(tuple(int(s) for s in item.split("<", 1)) for item in filter(None, text.split(",")))
        if kind == "Optional[tuple[int, ...]]" and text.lower() in ("none", "auto"):
            return None if text.lower() == "auto" else ()  # auto: the field's own default; none: no block
        if kind in ("tuple[int, ...]", "Optional[tuple[int, ...]]"):  # 0,4,11
            return tuple(int(s) for s in text.split(",") if s.strip())
        if kind == "tuple[float, ...]":  # 1,1.52,2
            values = tuple(float(s) for s in text.split(",") if s.strip())
            if not all(math.isfinite(v) for v in values):
                raise argparse.ArgumentTypeError(f"{text}: {next(v for v in values if not math.isfinite(v))} is not "
                                                 "allowed; give comma-separated finite numbers")
            return values
    except ValueError:
        example = dict(zip(("tuple[Optional[int], ...]", "tuple[tuple[int, int], ...]", "tuple[int, ...]",
                            "tuple[float, ...]", "Optional[tuple[int, ...]]"),
                           ("integers or '-' separated by commas", "target<source pairs, e.g. 9<6,10<4",
                            "comma-separated integers", "comma-separated numbers",
                            "comma-separated block numbers, none (no block) or auto (every block)"))
                       ).get(kind, kind.removeprefix("Optional[").rstrip("]"))
        raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
    if kind == "str":
        return text
    raise TypeError(f"field {f.name}: no parser for type {kind}")  # a new field type needs a line above


def to_text(value) -> str:
    """A field value as one would type it on the command line."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return ",".join(f"{t}<{s}" for t, s in value)
    if isinstance(value, tuple):
        return ",".join("-" if v is None else str(v) for v in value)
    return repr(value) if isinstance(value, str) and not value else str(value)


def _as_field_value(f: dataclasses.Field, value):
    """Accept a field's value as typed (a str from a command line or an old checkpoint, a list from
    JSON) or as the value itself."""
    if isinstance(value, str) and _kind(f) != "str":
        try:
            return from_text(f, value)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"--{f.name}: {e}")
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def make_config(preset: str = "medium", recipe: str = "bulk", **overrides) -> Hyperparameters:
    """The preset's hyperparameters, then the recipe's (RECIPES), then keyword overrides, checked."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    by_name = {f.name: f for f in fields(Hyperparameters)}
    unknown = sorted(set(overrides) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}")
    values = {**PRESETS[preset], **recipe_values(preset, recipe), **overrides, "preset": preset, "recipe": recipe}
    return check_config(Hyperparameters(**{k: _as_field_value(by_name[k], v) for k, v in values.items()}))


def with_num_iterations(config: Hyperparameters, steps: int) -> Hyperparameters:
    """`config` as a run of `steps` training steps (a short check of a recipe): every field whose
    flag counts steps (counts_steps) scaled by steps / num_iterations and rounded, a nonzero count
    kept at least 1 so that its phase still happens; auto and 0 (off) stay as they are. The
    extension stays shorter than the run, a cool-down no longer than it."""
    ratio = steps / config.num_iterations
    scaled = {f.name: max(1, round(getattr(config, f.name) * ratio)) for f in fields(config)
              if f.metadata.get("counts_steps") and getattr(config, f.name)}
    if "extension_steps" in scaled:
        scaled["extension_steps"] = min(scaled["extension_steps"], steps - 1)
    if "untie_embed_after_step" in scaled and config.adam_odd_steps_only:
        scaled["untie_embed_after_step"] |= 1  # on an Adam step
    if "muon_momentum_cooldown_steps" in scaled:
        scaled["muon_momentum_cooldown_steps"] = min(scaled["muon_momentum_cooldown_steps"], steps)
    return check_config(dataclasses.replace(config, num_iterations=steps, **scaled))


def range_text(f: dataclasses.Field) -> str:
    m = f.metadata
    if m.get("choices"):
        return "one of " + ", ".join(m["choices"])
    parts = [f"{op} {m[key]}" for key, op in (("at_least", ">="), ("above", ">"), ("at_most", "<="), ("below", "<"))
             if m.get(key) is not None]
    return " and ".join(parts)


def require(ok: bool, flag: str, message: str) -> None:
    """A config rule: ConfigError `--flag: message` unless ok."""
    if not ok:
        raise ConfigError(f"--{flag}: {message}")


RUN_ID_CHARACTERS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_output_names(cfg: Hyperparameters) -> None:
    """The run's output names: --log_dir and --checkpoint_dir are folders (not empty: that is the
    working folder, the repository's root when run from there); --run_id is one name, used in
    <log_dir>/<run_id>_<uuid>.txt and <checkpoint_dir>/<run_id>/, so no folder part and no '..'
    (which would write outside those folders)."""
    for flag in ("log_dir", "checkpoint_dir"):
        require(getattr(cfg, flag).strip() != "", flag, "is empty (the working folder): give a folder, e.g. "
                f"--{flag}={Hyperparameters.__dataclass_fields__[flag].default}")
    require(not cfg.run_id or RUN_ID_CHARACTERS.fullmatch(cfg.run_id) is not None, "run_id",
            f"{cfg.run_id!r} is not a name: letters, digits, '.', '_' and '-', starting with a letter or digit "
            "(no '/' or '..': the logs and checkpoints stay in --log_dir and --checkpoint_dir)")


def check_config(cfg: Hyperparameters) -> Hyperparameters:
    """Raise ConfigError naming the flag, the value and what is allowed, if the configuration
    cannot work; every field's range first, then how fields fit together."""
    for f in fields(cfg):
        value, m = getattr(cfg, f.name), f.metadata
        if value is None or isinstance(value, (str, tuple)) and not m.get("choices"):
            continue
        ok = (value in m["choices"]) if m.get("choices") else all((
            m.get("at_least") is None or value >= m["at_least"], m.get("above") is None or value > m["above"],
            m.get("at_most") is None or value <= m["at_most"], m.get("below") is None or value < m["below"]))
        if not ok:
            raise ConfigError(f"--{f.name}: {to_text(value)} is not allowed; it must be {range_text(f)}")

    need = require
    check_output_names(cfg)
    need(cfg.eot_token < cfg.vocab_size, "eot_token", f"must be in [0, vocab_size={cfg.vocab_size})")
    need(cfg.head_dim % 4 == 0, "head_dim", "must be a multiple of 4 (half-truncated rotary)")
    for name in ("train_seq_len", "val_seq_len", "max_window_tokens"):
        need(getattr(cfg, name) % cfg.attn_block_size == 0, name,
             f"must be a positive multiple of attn_block_size={cfg.attn_block_size}")
    need(cfg.val_tokens % (cfg.batch_slices * cfg.val_seq_len) == 0, "val_tokens",
         f"must be a positive multiple of batch_slices*val_seq_len = {cfg.batch_slices * cfg.val_seq_len}")
    need(cfg.ve_tables == 0 or cfg.ve_mode in ("learned", "frozen"), "ve_tables",
         "only learned/frozen take a basis size; for native/grouped the layout names the tables")
    tables = cfg.value_embed_layout
    need(all(t is None or t >= 0 for t in tables), "value_embed_layout", "table indices must be >= 0")
    if cfg.ve_mode in ("learned", "frozen") and cfg.ve_coeff_init == "assignment":
        need(all(t is None or t < cfg.num_value_embeds for t in tables), "value_embed_layout",
             f"assignment init needs every table index < --ve_tables={cfg.num_value_embeds}")
    need(len(tables) == cfg.num_layers, "value_embed_layout",
         f"has {len(tables)} entries, needs one per layer ({cfg.num_layers})")
    if cfg.num_value_embeds:
        need(cfg.attn_dim == cfg.model_dim, "value_embed_layout", "value embeddings need num_heads*head_dim == model_dim")
    for pair in cfg.skip_connections:
        need(len(pair) == 2 and 0 <= pair[1] < pair[0] < cfg.num_layers, "skip_connections",
             f"{to_text((tuple(pair),))} must satisfy 0 <= source < target < num_layers")
    for flag in ("attention_free_layers", "long_window_layers"):
        need(all(0 <= layer < cfg.num_layers for layer in getattr(cfg, flag)), flag,
             f"layers must be in 0..{cfg.num_layers - 1}")
    for layer, table in enumerate(tables):
        need(table is None or layer in cfg.attention_layers, "value_embed_layout",
             f"layer {layer} has a value embedding but no attention")
    if cfg.backout:
        need(cfg.backout_layer < cfg.num_layers - 1, "backout_layer",
             f"must name a block before the last one (0..{cfg.num_layers - 2}): backout combines it with the "
             "last block's output")
    if cfg.attn_input_from_layer is not None:
        need(cfg.attn_input_from_layer < cfg.num_layers - 1, "attn_input_from_layer",
             f"must name a block before the last one (0..{cfg.num_layers - 2}): the blocks after it read it")
    check_mudd(cfg)  # §10
    check_xsa(cfg)  # §12
    check_qk_groups(cfg)  # §13
    check_bigram_signs(cfg)  # §14
    check_prefix(cfg)  # §16
    check_fp8_mlp(cfg)  # §17
    check_mudd_gate(cfg)  # §18
    need(cfg.extension_steps < cfg.num_iterations, "extension_steps",
         f"must be less than num_iterations={cfg.num_iterations}: the schedules need at least one step")
    unit, largest = cfg.batch_slices * cfg.attn_block_size, cfg.batch_slices * cfg.train_seq_len
    for tokens in cfg.batch_schedule:
        need(0 < tokens <= largest and tokens % unit == 0, "batch_schedule",
             f"{tokens} must be a positive multiple of batch_slices*attn_block_size = {unit} and at most "
             f"batch_slices*train_seq_len = {largest} (train_seq_len is the longest slice)")
    need(cfg.window_schedule and all(w >= 1 for w in cfg.window_schedule), "window_schedule",
         "needs at least one window, each at least 1 block")
    need(cfg.lr_peaks and all(m >= 0 for m in cfg.lr_peaks), "lr_peaks", "needs at least one multiplier, each >= 0")
    need(cfg.muon_momentum_cooldown_steps <= cfg.num_iterations, "muon_momentum_cooldown_steps",
         f"must be at most num_iterations={cfg.num_iterations}")
    if cfg.attention_layers:
        need(cfg.attn_dim == cfg.model_dim, "head_dim",
             "needs num_heads*head_dim == model_dim (the output weight is stored as the record stores it)")
    for flag in ("attn_output_gate", "value_embed_gate", "smear_embed", "gated_skips"):
        need(not getattr(cfg, flag) or cfg.model_dim >= GATE_INPUTS, flag,
             f"its gates read the first {GATE_INPUTS} features: model_dim must be at least {GATE_INPUTS}")
    if untie_step(cfg):
        need(not (cfg.lore_input or cfg.lore_output), "lore_input" if cfg.lore_input else "lore_output",
             f"the record's head doubles as the input table until step {untie_step(cfg)}, and a low-rank table "
             "cannot be both: add --untie_embed_after_step=0 (separate tables from the start) to use LoRE")
        need(cfg.pad_vocab_tables, "untie_embed_after_step",
             "the input table becomes a copy of the head: pass --pad_vocab_tables so both have the head's rows")
    check_fp8_head(cfg)  # §8
    check_fused_loss(cfg)  # §9
    need(not (cfg.adam_odd_steps_only and cfg.untie_embed_after_step) or cfg.untie_embed_after_step % 2 == 1,
         "untie_embed_after_step", f"{cfg.untie_embed_after_step} is even; with --adam_odd_steps_only the split copies the "
         "head's Adam state right after an Adam step, which falls on odd steps: choose an odd step (or auto)")
    need(not cfg.adam_odd_steps_only or cfg.save_every % 2 == 0, "save_every",
         f"{cfg.save_every} is odd; with --adam_odd_steps_only checkpoints must fall after odd steps, when no "
         "gradients wait for Adam: choose an even number")
    return cfg


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print its usage and exit; main prints one line instead
        raise ConfigError(re.sub(r"^argument (--\w+): ", r"\1: ", message))


class _LastWins(argparse.Action):
    """A flag given twice: the last value wins (wrappers append overrides), with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest in vars(namespace):
            print(f"warning: {option_string} given twice ({to_text(getattr(namespace, self.dest))} and "
                  f"{to_text(values)}); using the last", file=sys.stderr)
        setattr(namespace, self.dest, values)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's wrapping, but a word longer than the line (a default list such as batch_schedule's)
    moves to a line of its own whole instead of being cut mid-number ("52428" / "8")."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """One flag per Hyperparameters field, in the field's group, with its type, default and range."""
    parser = _ArgumentParser(
        prog="train_gpt_medium.py", usage="%(prog)s [--flag=value ...]", add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS,
        formatter_class=functools.partial(_HelpFormatter, width=HELP_WIDTH, max_help_position=32),
        description=textwrap.fill("GPT-2 Medium speedrun trainer. Defaults are the record recipe (--preset medium, "
                                  "--recipe bulk). Flags take --flag=value or --flag value; booleans may be bare "
                                  "(--flag means true).", HELP_WIDTH),
        epilog=help_epilog())
    section, current = None, None
    for f in fields(Hyperparameters):
        if f.metadata["group"] != current:  # a group's heading again where its fields resume (as in the README)
            current = f.metadata["group"]
            section = parser.add_argument_group(current)
        kind = _kind(f)
        allowed = range_text(f)
        help_line = f"{f.metadata['meaning']} [default {to_text(f.default)}{'; ' + allowed if allowed else ''}]"
        kwargs = dict(dest=f.name, action=_LastWins, type=lambda text, f=f: from_text(f, text),
                      help=help_line.replace("%", "%%"), metavar=kind.upper().replace("OPTIONAL[", "").rstrip("]"))
        if f.metadata.get("choices"):
            kwargs.update(metavar="|".join(f.metadata["choices"]))
        if "bool" in kind:
            kwargs.update(nargs="?", const=True, metavar="true|false")
        elif kind.startswith(("tuple", "Optional[tuple")):  # a list (auto where Optional)
            kwargs.update(metavar="LIST")
        section.add_argument(f"--{f.name}", **kwargs)
    return parser


HELP_WIDTH = 100


def help_text() -> str:
    return build_parser().format_help()


def recipe_flags(name: str, preset: str = "medium") -> str:
    values = recipe_values(preset, name)
    return " ".join(f"--{k}={to_text(v)}" for k, v in values.items()) or "nothing (the defaults)"


def recipe_facts(name: str) -> str:
    """What recipe `name`'s record published: mean time, runs, p-value (and where it was timed)."""
    r = RECIPES[name]
    where = f", {r.time_note}" if r.time_note else ""
    claim = f", unmerged claim PR #{r.claim_pr}" if r.claim_pr else ""
    p = "no t-test" if r.p_value is None else f"p={r.p_value:g}"
    return f"{r.mean_time_s:.2f} s mean over {r.runs} run{'s' if r.runs != 1 else ''}{where}, {p}{claim}"


def recipe_summary(config: Hyperparameters) -> str:
    """One short line naming the run's recipe: its record and published result. Its values are the
    config lines (the log's config block, the dry run's list); --help says what each recipe sets."""
    if config.recipe in CANDIDATES:
        c = CANDIDATES[config.recipe]
        return f"recipe {config.recipe}: {CANDIDATE_NOTE}; {c.base} plus the ideas of {c.docs}"
    r = RECIPES[config.recipe]
    return f"recipe {config.recipe}: record {r.folder}, published {recipe_facts(config.recipe)}"


def help_epilog() -> str:
    """The presets' and recipes' values, after the flags."""
    tiny = textwrap.fill("--preset tiny overrides: " + " ".join(f"--{k}={to_text(v)}" for k, v in PRESETS["tiny"].items()),
                         HELP_WIDTH, break_on_hyphens=False)
    lines = [tiny, ""] + textwrap.wrap(
        "recipes (--recipe NAME: the record's values after --preset, before your flags; its published mean "
        "training time on 8xH100, runs, p-value of mean val loss < 2.92):", HELP_WIDTH)
    for name, r in RECIPES.items():
        lines += textwrap.wrap(f"{name} ({r.date}, {r.folder}): {r.change}", HELP_WIDTH, initial_indent="  ",
                               subsequent_indent=" " * 6)
        body = f"published {recipe_facts(name)}; sets {recipe_flags(name)}"
        lines += textwrap.wrap(body, HELP_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False)
    for name, c in CANDIDATES.items():
        lines += textwrap.wrap(f"{name} (CANDIDATE, {c.docs}): {c.change}", HELP_WIDTH, initial_indent="  ",
                               subsequent_indent=" " * 6)
        body = f"{CANDIDATE_NOTE}; sets {recipe_flags(name)}"
        lines += textwrap.wrap(body, HELP_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False)
    lines += [""] + textwrap.wrap(
        "With --preset tiny a recipe keeps its switches and the preset its scale. The earlier records "
        f"({', '.join(FROZEN_RECIPES)}) run from their frozen script, {FROZEN_SCRIPT}.", HELP_WIDTH)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> Hyperparameters:
    """`--field=value` / `--field value` / bare booleans, on top of `--preset NAME` and then
    `--recipe NAME` (wherever they stand on the line), checked."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        arg = unknown[0]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --field=value (--help lists them)")
        name = arg[2:].split("=", 1)[0]
        close = close_field_names(name)
        hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ""
        raise ConfigError(f"unknown flag --{name}{hint} (--help lists every flag)")
    overrides = vars(namespace)
    return make_config(overrides.pop("preset", "medium"), overrides.pop("recipe", "bulk"), **overrides)


def close_field_names(name: str) -> list[str]:
    """The (at most two) fields a mistyped field name most likely meant, closest first; [] for none."""
    return difflib.get_close_matches(name, [f.name for f in fields(Hyperparameters)], n=2, cutoff=0.75)

# ---- run setup

def run_training(config: Hyperparameters, rank: int) -> int:
    """Everything between the parsed flags and the exit code: device, process group, data,
    checkpoint checks, the log, the run."""
    if config.dry_run:
        return dry_run(config)
    world_size, local_rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    check_world_size(config, world_size)
    device = resolve_device(config, local_rank)  # asks whether CUDA is there, without starting it
    check_run_request(config, device)
    notes = recipe_notes(config)
    if device.type == "cuda":
        use_expandable_segments()  # read when CUDA starts: before the first CUDA call
        torch.cuda.set_device(device)
        config = check_gpu(config, device, world_size, notes)  # the GPU guard: before anything compiles
        if config.attention == "fa3":
            check_fa3_device(device)
        import torch._inductor.config as inductor_config
        inductor_config.coordinate_descent_tuning = config.coordinate_descent_tuning
    else:
        notes.append(set_cpu_threads(config))
    distributed = "RANK" in os.environ
    if distributed:
        # on GPUs NCCL, and gloo for host tensors (the bigram exchange's row counts: no device sync)
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    try:
        if config.bench_steps:
            return bench(config, device, rank, world_size)
        if config.synthetic_data and rank == 0:
            ensure_synthetic_data(config)
        if distributed:
            dist.barrier()
        data = load_data(config)
        resume, checkpoint_notes = prepare_checkpoints(config, weight_dtype(config, device), rank, world_size)
        config = with_run_seed(config, world_size, resume)
        on_rank0_for_all(lambda: check_output_folders(config), rank, world_size)
        after = after_run_hooks(config, rank, world_size)  # None unless asked (and on ranks > 0)
        log = open_run_log(config, device, world_size, notes + checkpoint_notes, rank)
        try:
            with warnings.catch_warnings():  # Python's warnings during the run: on the console and in the log
                warnings.showwarning = log.python_warning(warnings.showwarning)
                if after:
                    after.attach(log, device, world_size)
                result = train(config, device, rank, world_size, log, data, resume)
                if after:  # untimed: train() has returned, its clock is stopped for good
                    after.evaluate(result, device, log)
            log.record_end(None)
        except BaseException as e:
            ended = STOPS.as_stop(e)  # an error after a stop was asked (a collective the others left) is that stop
            if isinstance(ended, (InputError, NonFiniteLossError, WriteError)):
                log.record_error(ended)
            log.record_end(ended)
            if ended is not e:
                raise ended from e
            raise
        finally:
            if after:
                after.close()
        if rank == 0:
            print(run_summary(config, result, log))
        return 0
    finally:
        if distributed:
            dist.destroy_process_group()


def check_world_size(config: Hyperparameters, world_size: int) -> None:
    """Every step must consume the same batch_slices slices whatever the world size, so W | batch_slices."""
    if config.batch_slices % world_size:
        valid = [str(w) for w in range(1, config.batch_slices + 1) if config.batch_slices % w == 0]
        valid = " or ".join([", ".join(valid[:-1]), valid[-1]] if len(valid) > 1 else valid)
        raise ConfigError(f"world size {world_size} does not divide --batch_slices={config.batch_slices}: "
                          f"run {valid} processes in all (nodes x processes per node)")


def resolve_device(config: Hyperparameters, local_rank: int) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device=cuda but no CUDA GPU is visible; use --device=cpu with --preset tiny")
        return torch.device("cuda", local_rank)
    if config.device == "auto" and config.preset == "medium":
        raise ConfigError("no CUDA GPU found: the record recipe needs GPUs. For a CPU run use "
                          "`./run.sh --preset tiny` (or force --device=cpu)")
    return torch.device("cpu")


def check_run_request(config: Hyperparameters, device: torch.device) -> None:
    """What this device cannot run, and bench flags that make no sense: ConfigError (exit 2)
    before anything is built or written."""
    if device.type != "cuda" and attention_backend(config, device.type) == "flex":
        raise ConfigError(f"--attention: flex cannot train on the {device.type.upper()}: FlexAttention has no backward "
                          "pass there (and uncompiled it would ignore the attention window); drop --attention=flex "
                          "(auto picks sdpa off CUDA) or pass --attention=sdpa")
    if config.attention == "fa3":
        check_fa3_request(config, device)
    if config.bench_at_step is not None and config.bench_at_step >= config.num_iterations:
        raise ConfigError(f"--bench_at_step: {config.bench_at_step} is not a step of the run; it must be below "
                          f"--num_iterations={config.num_iterations}")


def check_fa3_request(config: Hyperparameters, device: torch.device) -> None:
    """--attention=fa3 needs a CUDA device and the `kernels` package; the GPU must be a Hopper
    (checked once CUDA is up: check_fa3_device)."""
    if device.type != "cuda":
        raise ConfigError(f"--attention: fa3 runs on Hopper GPUs only, not on the {device.type.upper()}; use "
                          "--attention=flex on a GPU, or sdpa on the CPU")
    if not importable("kernels"):
        raise ConfigError("--attention: fa3 needs the `kernels` package (pip install kernels), which fetches the "
                          f"{kernels.FA3_KERNEL} kernel at run time; or use --attention=flex, which computes the same mask")


def check_fa3_device(device: torch.device) -> None:
    """FA3's kernels are built for Hopper (compute capability 9.x: fa3_capability_problem, the rule the
    GPU guard applies too), and the kernel is fetched and loaded here, once CUDA is up and before
    anything is built: a machine without network (or a kernel that does not load) is refused in one
    line, not by a traceback from the hub."""
    gpu = gpu_properties(device)
    lacks = fa3_capability_problem(gpu)
    if lacks:
        raise ConfigError(f"--attention: fa3 {lacks}; this GPU ({gpu.name}) is {gpu.capability_text}: use "
                          "--attention=flex")
    problem = fa3_kernel_problem()
    if problem:
        raise ConfigError(f"--attention: {problem}")


def attention_backends_here() -> dict[str, Optional[str]]:
    """Each attention backend on this machine's first device: None where it can train, else why not
    (tools/gpu_check.sh prints it). Starts CUDA and, for fa3, fetches its kernel."""
    if not torch.cuda.is_available():
        return dict(flex="no backward pass on the CPU", sdpa=None, fa3="runs on Hopper GPUs only, not on the CPU")
    gpu = gpu_properties(torch.device("cuda", 0))
    found = {name: importable(name) for name in ("triton", "kernels")}
    flex = None if found["triton"] else "needs triton (torch's CUDA builds bring it)"
    if gpu.capability < FLEX_CAPABILITY:
        flex = f"compute capability {gpu.capability_text}: FlexAttention's kernels need 8.0 or more"
    fa3 = ("needs the `kernels` package (pip install kernels)" if not found["kernels"]
           else f"compute capability {gpu.capability_text}: its kernels are built for Hopper (9.x)"
           if fa3_capability_problem(gpu) else fa3_kernel_problem())
    return dict(flex=flex, sdpa=None, fa3=fa3)


def importable(module: str) -> bool:
    """Whether `module` can be imported here (already imported counts), without importing it."""
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec (a stand-in module)
        return module in sys.modules


def fa3_kernel_problem() -> Optional[str]:
    """Why FA3's kernel cannot be had (fetched from the hub, or loaded), or None once it is loaded."""
    try:
        kernels.flash_attention_3()
    except Exception as e:  # the hub's errors (offline, not found), an import or a load error
        what = (str(e).strip().splitlines() or [""])[0][:200]
        return (f"fa3's kernel {kernels.FA3_KERNEL} could not be fetched or loaded ({type(e).__name__}: {what}); "
                "use --attention=flex, which computes the same mask (or fetch it once with network access)")
    return None


# ---- the GPU guard: what this GPU lacks, refused before anything compiles (docs/scale.md)
#
# A feature the GPU lacks fails deep inside a kernel, minutes into a run, after the compile. The guard
# reads the GPU once (gpu_properties, the one place; the tests fake it there), resolves the switches
# whose `auto` depends on it, and refuses each feature the GPU lacks in one line naming the flag, what
# is missing and the nearest flags that run; a run whose predicted peak memory (predicted_peak_mib at
# this world size) exceeds the GPU's memory is refused the same way, naming a micro-batch that fits.

class GpuProperties(NamedTuple):
    name: str
    capability: tuple[int, int]  # (major, minor): 8.0 A100, 8.9 Ada (L4, 4090), 9.0 H100/H200
    total_memory: int  # bytes

    @property
    def capability_text(self) -> str:
        return "{}.{}".format(*self.capability)

    @property
    def label(self) -> str:
        return f"{self.name}, compute capability {self.capability_text}, {self.total_memory // 2**20:,} MiB"


def gpu_properties(device: torch.device) -> GpuProperties:
    """The GPU's name, compute capability and memory: the one place the trainer reads them (the guard,
    the FA3 check, the backends tools/gpu_check.sh lists, the benchmark's report)."""
    p = torch.cuda.get_device_properties(device)
    return GpuProperties(p.name, (p.major, p.minor), p.total_memory)


# What each feature needs. bf16 matrix units, and Triton's bf16 kernels (every compiled kernel of a bf16
# run, FlexAttention's in any dtype: below 8.0 torch has no Triton lowering for it, and run eagerly it
# would ignore the window), arrived with Ampere; FP8 products (torch._scaled_mm) with Ada and Hopper.
BF16_CAPABILITY = FLEX_CAPABILITY = (8, 0)
FP8_CAPABILITY = (8, 9)
FA3_MAJOR = 9  # FlashAttention-3's kernels are built for Hopper only (9.x)
# --attention=sdpa builds dense (T, T) masks: two kept bools, and while it builds one the int64
# distance q - k of every pair (token_window_masks): at least 10 bytes per pair, training and evaluation
DENSE_MASK_BYTES_PER_PAIR = 10


def fa3_capability_problem(gpu: GpuProperties) -> Optional[str]:
    """Why FA3 cannot run on this GPU's architecture, or None on a Hopper."""
    return None if gpu.capability[0] == FA3_MAJOR else "runs on Hopper GPUs (compute capability 9.x)"


def auto_choices(config: Hyperparameters, gpu: GpuProperties) -> tuple[Hyperparameters, Optional[str]]:
    """--dtype=auto and --attention=auto on this GPU: bf16 and flex where it has them (the config
    unchanged, as on every GPU before), float32 and sdpa below 8.0 (set in the config, so the log's
    config says what ran); and the log's line saying what auto picked, None if neither is auto."""
    picks, changes = [], {}
    if config.dtype == "auto":
        if gpu.capability >= BF16_CAPABILITY:
            picks.append("--dtype=auto -> bfloat16")
        else:
            changes["dtype"] = "float32"
            picks.append("--dtype=auto -> float32 (bf16 needs compute capability 8.0 or more)")
    if config.attention == "auto":
        if gpu.capability >= FLEX_CAPABILITY:
            picks.append("--attention=auto -> flex")
        else:
            changes["attention"] = "sdpa"
            picks.append("--attention=auto -> sdpa (FlexAttention needs compute capability 8.0 or more)")
    line = f"auto on this GPU ({gpu.label}): " + ", ".join(picks) if picks else None
    return (dataclasses.replace(config, **changes) if changes else config), line


def gpu_feature_problems(config: Hyperparameters, gpu: GpuProperties) -> list[tuple[str, str, dict]]:
    """Each feature of config (its auto switches resolved) that this GPU lacks: (the flag, what the GPU
    lacks, the field values that do without it)."""
    problems, cap = [], gpu.capability
    below_flex = cap < FLEX_CAPABILITY
    if config.fp8 and cap < FP8_CAPABILITY:
        fused = ", the head's and, with --fused_softcap_ce, the fused loss's" if config.fused_softcap_ce else ""
        problems.append(("--fp8", f"FP8 matrix products{fused} (torch._scaled_mm: compute capability "
                         "8.9 or more, Ada or Hopper)", dict(fp8=False)))
    if config.attention == "fa3" and fa3_capability_problem(gpu):
        problems.append(("--attention=fa3", "FlashAttention-3's kernels, built for Hopper only (compute capability "
                         "9.x)", dict(attention="sdpa" if below_flex else "flex")))
    if config.dtype == "bfloat16" and cap < BF16_CAPABILITY:
        problems.append(("--dtype=bfloat16", "bf16 matrix units and Triton's bf16 kernels (compute capability "
                         "8.0 or more)", dict(dtype="float32")))
    if config.attention == "flex" and below_flex:
        problems.append(("--attention=flex", "FlexAttention's Triton kernels (compute capability 8.0 or more; run "
                         "eagerly it would ignore the window)", dict(attention="sdpa")))
    return problems


def dense_mask_bytes(config: Hyperparameters) -> int:
    """--attention=sdpa: the least its dense masks take, for the longest slice it attends over
    (training's or validation's)."""
    longest = max(largest_slice(config), config.val_seq_len)
    return DENSE_MASK_BYTES_PER_PAIR * longest * longest


def nearest_fit(config: Hyperparameters, world_size: int, memory: int) -> Optional[tuple[dict, int]]:
    """The first micro-batch setting (micro_batch_settings' order: the same training first) whose
    predicted peak fits in `memory` bytes per GPU: (its field values, its predicted peak MiB)."""
    for changes in micro_batch_settings(config):
        predicted = predicted_peak_mib(dataclasses.replace(config, **changes), world_size)
        if predicted is not None and predicted * 2**20 <= memory:
            return changes, predicted
    return None


def flag_text(changes: dict, config: Hyperparameters) -> str:
    """The flags that set `changes` over config (those that differ), as one would type them."""
    return " ".join(f"--{name}" if value is True else f"--{name}={to_text(value)}"
                    for name, value in changes.items() if getattr(config, name) != value)


def recipe_flag(config: Hyperparameters) -> str:
    """`--recipe NAME ` for a fix's command line (nothing for the record, the default)."""
    return "" if config.recipe == "bulk" else f"--recipe {config.recipe} "


def micro_batch_text(config: Hyperparameters) -> str:
    return (f"--batch_slices={config.batch_slices} --train_seq_len={config.train_seq_len} "
            f"--val_seq_len={config.val_seq_len}" + " --activation_checkpointing" * config.activation_checkpointing)


def gpu_verdict(config: Hyperparameters, gpu: GpuProperties, world_size: int,
                memory: Optional[int] = None) -> tuple[Hyperparameters, Optional[str], list[str]]:
    """What this GPU makes of config on `world_size` GPUs like it: (config with its auto switches
    resolved, the log's line saying what auto picked or None, a refusal line per feature the GPU lacks
    and for memory; none: it runs). memory: bytes per GPU to hold the predicted peak against (default:
    the GPU's own). Each line names the flag, what the GPU lacks and the nearest flags that run (all
    of the lines' fixes together)."""
    memory = gpu.total_memory if memory is None else memory
    where = (f"this GPU's {memory // 2**20:,} MiB" if memory == gpu.total_memory
             else f"the {memory // 2**20:,} MiB of --gpu_memory_gib")
    asked = config
    config, auto_line = auto_choices(config, gpu)
    problems = gpu_feature_problems(config, gpu)
    fixes = {k: v for _, _, fix in problems for k, v in fix.items()}
    fixed = dataclasses.replace(config, **fixes)
    memory_line, nearest, cannot = None, None, None
    if attention_backend(fixed, "cuda") == "sdpa" and dense_mask_bytes(fixed) > memory:
        masks = (f"the memory for sdpa's dense (T, T) masks (at least {dense_mask_bytes(fixed) // 2**20:,} MiB for "
                 f"slices of {max(largest_slice(fixed), fixed.val_seq_len):,} tokens, more than {where})")
        if gpu.capability >= FLEX_CAPABILITY:  # flex builds no dense mask
            problems.append(("--attention=sdpa", masks, dict(attention="flex")))
            fixes["attention"] = "flex"
            fixed = dataclasses.replace(fixed, attention="flex")
        else:
            longest = math.isqrt(memory // DENSE_MASK_BYTES_PER_PAIR)  # tokens whose masks would fit
            cannot = (f"sdpa's dense masks of slices this long do not fit, and FlexAttention, which builds none, "
                      f"needs compute capability 8.0 or more; slices of at most {longest:,} tokens, training's and "
                      "validation's, would have masks that fit (e.g. --preset tiny; the rest of a float32 run's "
                      "memory is not predicted)")
            if not problems:
                chosen = " (auto's choice below 8.0)" if asked.attention == "auto" else ""
                memory_line = f"--attention=sdpa{chosen}: this GPU ({gpu.label}) lacks {masks}"
    predicted = None if cannot else predicted_peak_mib(fixed, world_size)
    if predicted is not None and predicted * 2**20 > memory:
        memory_line = (f"memory ({micro_batch_text(fixed)}): the predicted peak {predicted:,} MiB per GPU on "
                       f"{world_size} GPU{'s' * (world_size > 1)} is more than {where} ({gpu.name})")
        found = nearest_fit(fixed, world_size, memory)
        if found is None:
            cannot = ("no micro-batch setting of this configuration is predicted to fit; smaller configurations "
                      "do, e.g. --preset tiny")
        else:
            changes, peak = found
            fixes.update(changes)
            change = ("" if changes["batch_slices"] == fixed.batch_slices
                      else "; shorter slices: this changes training")
            nearest = (f"nearest that fits: {recipe_flag(config)}{flag_text(fixes, config)} (predicted {peak:,} MiB "
                       f"per GPU{change}); the prediction is an estimate (docs/scale.md): to run as asked anyway, "
                       "pass --gpu_memory_gib=<the GiB you expect it to need>")
    if cannot:
        tail = f"nothing of this size runs on this GPU: {cannot}"
    else:
        tail = nearest or f"nearest that runs here: {recipe_flag(config)}{flag_text(fixes, config)}"
    lines = [f"{flag}: this GPU ({gpu.label}) lacks {lacks}; {tail}" for flag, lacks, _ in problems]
    if memory_line is not None:
        lines.append(f"{memory_line}; {tail}")
    return config, auto_line, lines


def check_gpu(config: Hyperparameters, device: torch.device, world_size: int, notes: list[str]) -> Hyperparameters:
    """run_training's guard, once CUDA is up and before anything is built or compiled: ConfigError
    with a line per feature this GPU lacks (and for memory, held against --gpu_memory_gib where given);
    else config with its auto switches resolved, and the line saying what auto picked added to notes."""
    gpu = gpu_properties(device)
    memory = None if config.gpu_memory_gib is None else int(config.gpu_memory_gib * 2**30)
    config, auto_line, refusals = gpu_verdict(config, gpu, world_size, memory)
    if refusals:
        raise ConfigError("\n".join(refusals))
    if auto_line:
        notes.append(auto_line)
    return config


def recipes_on_gpu(gpu: GpuProperties, world_size: int, preset: str = "medium") -> dict[str, list[str]]:
    """Each recipe of RECIPES on `world_size` GPUs like this one: its refusal lines (none: it runs)."""
    return {name: gpu_verdict(make_config(preset, name), gpu, world_size)[2] for name in RECIPES}


# On CUDA, inductor's FlexAttention kernels walk a BlockMask in tiles of 16 to 128 tokens (chosen by
# the GPU, head dim and dtype; the backward's differ from the forward's) and refuse a mask whose block
# is not a multiple of the tile. There the mask's blocks are grouped into blocks of a multiple of 128
# tokens: the record's 128 stays as it is, the tiny preset's 16 become 128. The token rule (mask_mod)
# is the whole mask, so grouping changes which tiles are skipped, not what is attended.
FLEX_TILE_MULTIPLE = 128


def flex_mask_block(config: Hyperparameters, device_type: str) -> int:
    """The block size of the FlexAttention BlockMask on `device_type`: attn_block_size, or on CUDA the
    least multiple of it that is a multiple of FLEX_TILE_MULTIPLE."""
    bs = config.attn_block_size
    return bs * FLEX_TILE_MULTIPLE // math.gcd(bs, FLEX_TILE_MULTIPLE) if device_type == "cuda" else bs


def grouped_blocks(full: torch.Tensor, partial: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial) block lists over blocks of `group` x `group` blocks: a group is full if all
    its blocks are, partial if some are selected, dropped otherwise. A last group that reaches past
    the sequence is partial (flex bounds the mask_mod's indices there). (nb, nb) -> (ng, ng) bools."""
    nb = full.size(-1)
    ng = -(-nb // group)

    def by_group(blocks):  # (nb, nb) -> (ng, group, ng, group), unselected past the end
        padded = blocks.new_zeros(ng * group, ng * group)
        padded[:nb, :nb] = blocks
        return padded.view(ng, group, ng, group)

    all_full = by_group(full).all(3).all(1)
    selected = by_group(full | partial).any(3).any(1)
    return all_full, selected & ~all_full


# The caching allocator's settings: torch >= 2.8 reads PYTORCH_ALLOC_CONF, and the older
# PYTORCH_CUDA_ALLOC_CONF as an alias of lower priority; a user's value under either name wins.
# (2.9 ignored expandable_segments under the new name, fixed by 2.11: pytorch/pytorch#183387.)
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(environ=os.environ) -> str:
    """Expandable segments for the CUDA caching allocator (segments grow in place instead of
    fragmenting into fixed blocks: less reserved memory for the same peak), unless the user set
    the allocator's configuration. Effective only before CUDA starts. Returns the setting in force."""
    for name in ALLOC_CONF_VARIABLES:
        if environ.get(name):
            return f"{name}={environ[name]}"
    environ[ALLOC_CONF_VARIABLES[0]] = EXPANDABLE_SEGMENTS
    return f"{ALLOC_CONF_VARIABLES[0]}={EXPANDABLE_SEGMENTS}"


def set_cpu_threads(config: Hyperparameters) -> str:
    """A CPU run's threads: --threads, else OMP_NUM_THREADS, else 1. One thread is the default
    because a single process with one thread per core collapses when another program takes a
    core (README, "CPU threads"); returns the log's description."""
    if config.threads:
        threads, why = config.threads, "--threads"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads, why = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        threads, why = 1, "the CPU default; --threads=N to change"
    torch.set_num_threads(threads)
    return f"CPU threads: {threads} ({why})"


def with_run_seed(config: Hyperparameters, world_size: int, resume: Optional[tuple] = None) -> Hyperparameters:
    """Independent runs: without --seed every run draws a fresh seed (the same on every rank),
    written to the log's config so that --seed=<it> repeats the run exactly. A resumed run is the
    checkpoint's run: without --seed it takes the seed the checkpoint's run had (its own state comes
    from the checkpoint), so the log names the seed that repeats the whole run."""
    if config.seed is not None:
        return config
    saved = resume[1]["config"].get("seed") if resume is not None else None
    if saved is not None:
        return dataclasses.replace(config, seed=int(saved))
    box = [int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return dataclasses.replace(config, seed=box[0])


def on_rank0_for_all(check, rank: int, world_size: int):
    """Run `check()` on rank 0 alone and give every rank its result, or raise its InputError on every
    rank: a check that failed on rank 0 only would leave the others waiting in the next collective."""
    verdict = {}
    if rank == 0:
        try:
            verdict = dict(value=check())
        except InputError as e:
            verdict = dict(error=e)
    if world_size > 1:
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if "error" in verdict:
        raise verdict["error"]
    return verdict["value"]


def folder_problem(folder: Path) -> Optional[str]:
    """Why files cannot be created in `folder` (made with its parents if missing), or None. Creates
    nothing: the probe is a nameless temporary file in the nearest folder that exists."""
    existing = folder
    try:
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return f"{existing} is a file, not a folder"
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"cannot create files in {existing} ({e.strerror or e})"
    return None


def check_output_folders(config: Hyperparameters) -> None:
    """ConfigError, before training, if the log (or, with --save_every, the checkpoints) could not
    be written: found at the first write, the run would have trained for nothing."""
    outputs = [("log_dir", Path(config.log_dir))]
    if config.save_every:
        outputs.append(("checkpoint_dir", checkpoint_run_dir(config)))
    for flag, folder in outputs:
        problem = folder_problem(folder)
        if problem:
            raise ConfigError(f"--{flag}: {problem}; choose a folder this process can write")


# the tiny preset's own data: the only place --synthetic_data writes to
SYNTHETIC_PATHS = {name: PRESETS["tiny"][name] for name in ("train_files", "val_files", "token_bytes_file")}


def ensure_synthetic_data(config: Hyperparameters) -> None:
    """Generate the tiny preset's data (data/synthetic.py next to this script) into its own folder,
    data/synthetic/, if the run reads that folder and something there is missing. Shard patterns the
    user typed are never generated into: a mistyped folder must be an error, not a new dataset."""
    if (config.train_files, config.val_files) != (SYNTHETIC_PATHS["train_files"], SYNTHETIC_PATHS["val_files"]):
        return
    if (glob.glob(config.train_files) and glob.glob(config.val_files)
            and Path(SYNTHETIC_PATHS["token_bytes_file"]).exists()
            and (not config.prefix_loss_weight  # §16 --prefix_loss_weight: and the tokens' bytes
                 or Path(token_strings_file(SYNTHETIC_PATHS["token_bytes_file"])).exists())):
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
    import synthetic
    folder = Path(config.train_files).parent
    try:
        synthetic.write_dataset(folder, vocab_size=config.vocab_size, eot_token=config.eot_token,
                                write_shard=write_shard)  # this module's writer: no second copy of it
    except OSError as e:
        raise WriteError(f"--synthetic_data: cannot write the synthetic data into {folder} ({e.strerror or e}); "
                         "run from a writable folder, or pass --train_files and --val_files")
    except ValueError as e:  # parameters the generator refuses (e.g. a vocabulary too large for it)
        raise ConfigError(f"--synthetic_data: {e}")


def inert_setting_notes(config: Hyperparameters) -> list[str]:
    """A note for each value set away from its preset's (by a flag or the recipe) whose switch is
    off (its field's `needs`), so that it has no effect: `--mudd_nets=final` without `--mudd`."""
    notes, preset = [], make_config(config.preset)
    for f in fields(config):
        needs, value = f.metadata.get("needs"), getattr(config, f.name)
        if needs and value != getattr(preset, f.name) and not any(getattr(config, n) for n in needs):
            switches = " or ".join(f"--{n}" for n in needs)
            notes.append(f"note: --{f.name}={to_text(value)} has no effect without {switches}")
    return notes


def recipe_notes(config: Hyperparameters) -> list[str]:
    """Log lines for choices that change training where a memory switch would not, for a
    recipe phase the run is too short to reach, and for values whose switch is off."""
    notes, split = inert_setting_notes(config), untie_step(config)
    if split and split >= config.num_iterations - 1:
        notes.append(f"note: the embedding split after step {split} (--untie_embed_after_step="
                     f"{to_text(config.untie_embed_after_step)}) comes after the run's last training step "
                     f"{config.num_iterations - 1}: the input embedding stays the head matrix throughout")
    preset_len = make_config(config.preset).train_seq_len
    if config.train_seq_len == preset_len:
        return notes
    return notes + [f"note: --train_seq_len={config.train_seq_len} differs from the {config.preset} preset's {preset_len}: "
            f"a step trains on {config.batch_slices * config.train_seq_len:,} tokens instead of "
            f"{config.batch_slices * preset_len:,}, with shorter contexts. This changes training (results are not "
            f"comparable with the preset's); --activation_checkpointing saves memory without changing it"]


def silence_stdout() -> None:
    """Send what is still buffered or printed to stdout to /dev/null: the pipe's reader has gone
    (`| head`), and the interpreter's final flush would otherwise raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class RunLog:
    """Rank 0's log file and console; other ranks stay silent. A line that cannot be written
    (disk full, the folder gone) is a WriteError: the run stops rather than lose its record."""

    def __init__(self, path: Optional[Path], echo: bool = True):
        self.path, self.echo = path, echo
        self.listeners = []  # called with each line after it is written (--metrics_jsonl, --tracker)
        self.steps = None  # "s/N" of the last step line written: where the run was when it ended
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise WriteError(f"cannot create the log folder {path.parent} {write_failure(e, '--log_dir')}")

    def write_lines(self, lines: list[str], console: bool = True) -> None:
        for line in lines:
            self.write(line, console)

    def write(self, text: str, console: bool = True, console_suffix: str = "") -> None:
        if self.path is None:
            return
        if console and self.echo:
            try:
                print(text + console_suffix, flush=True)
            except BrokenPipeError:  # the console's reader left (`| head`): the log file keeps everything
                self.echo = False
                silence_stdout()
        try:
            with open(self.path, "a") as f:
                f.write(text + "\n")
        except OSError as e:
            raise WriteError(f"cannot write the log {self.path} {write_failure(e, '--log_dir')}")
        if text.startswith("step:"):
            self.steps = text[5:].split(" ", 1)[0]
        for listener in self.listeners:
            listener(text)

    def warn(self, text: str) -> None:
        """A warning during the run: on stderr (every rank's own), and in rank 0's log."""
        say(text)
        self.write(text, console=False)

    def python_warning(self, show):
        """warnings.showwarning that also writes the warning to the log, in one line; `show` (the one it
        replaces) still shows it."""
        def show_and_log(message, category, filename, lineno, file=None, line=None):
            show(message, category, filename, lineno, file, line)
            self.write(f"warning: {category.__name__}: {message} ({filename}:{lineno})", console=False)
        return show_and_log

    def record_error(self, error: Exception) -> None:
        """The error that stops the run, as a line of the log if the log can still take it (the
        message reaches stderr either way, so a log that fails here is let be)."""
        try:
            self.write(f"error: {error}", console=False)
        except WriteError:
            pass

    def record_end(self, error: Optional[BaseException]) -> None:
        """The log's last line: how the run ended (run_ending), if the log can still take it."""
        try:
            self.write(f"run ended: {run_ending(error, self.steps)}", console=False)
        except WriteError:
            pass


def log_step0_loss(loss: torch.Tensor, world_size: int, log: RunLog) -> None:
    """The step-0 training loss, needed to compare inits; one sync, outside the steady state."""
    if world_size > 1:  # every rank's mean over its micro-steps -> the mean over all slices
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss /= world_size
    log.write(f"step0_train_loss:{loss.item():.6f}", console=False)


def log_run_end(runner: Runner, final: dict, device: torch.device, log: RunLog) -> None:
    """The closing lines: final loss, perplexity, BPB and package time; learned lambdas; peak memory."""
    bpb = f" val_bpb:{final['val_bpb']:.6f}" if final["val_bpb"] is not None else ""
    log.write(f"final val_loss:{final['val_loss']:.6f} perplexity:{math.exp(final['val_loss']):.4f}{bpb} "
              f"package_time:{final['package_ms']:.0f}ms (training + final evaluation)")
    log.write_lines(learned_scalars_lines(runner.model), console=False)
    allocated, reserved = peak_memory_mib(device)
    log.write(f"peak memory allocated: {allocated} MiB reserved: {reserved} MiB")


# ---- how a run ends: stops asked from outside, errors every rank meets, full disks, the log's last line

class Interrupted(KeyboardInterrupt):
    """A stop asked from outside the terminal: SIGTERM, or a worker's launcher gone (StopRequests). A
    KeyboardInterrupt, so that whatever handles Ctrl-C handles it alike."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def interruption_cause(error: KeyboardInterrupt) -> str:
    return error.cause if isinstance(error, Interrupted) else "SIGINT"


LAUNCHER_POLL_S = 1.0  # how often a worker looks for its launcher
LAUNCHER_GRACE_S = 10.0  # how long it then has to stop by the interruption's path before it exits at once


class StopRequests:
    """While main runs (`with STOPS.armed(launcher)`): SIGTERM raises Interrupted in the main thread, as
    SIGINT raises KeyboardInterrupt, so a stop takes Ctrl-C's path (the log's last line, a save under
    way removed, exit 143). Once a stop is under way a SIGTERM is ignored: torchrun answers Ctrl-C by
    sending its workers SIGTERM, which would cut short the stop they are making (a second Ctrl-C still
    interrupts, as Python's does). A worker (RANK set: torchrun's) also stops when its launcher's process is
    gone, killed by any signal: a thread compares os.getppid() with the launcher's pid once a second
    (an orphan is re-parented, so its parent's pid changes), then sends the main thread SIGTERM, and ends
    it with os._exit after LAUNCHER_GRACE_S (a collective that waits for ranks already gone may never
    return). Not prctl(PR_SET_PDEATHSIG): it is Linux-only, fires when the *thread* that started the
    worker ends, not its process, and needs the same getppid check for a launcher that died before it
    was set. The poll is a syscall a second in a thread that holds the GIL for microseconds."""

    def __init__(self):
        self.launcher, self.cause, self.done, self.previous = None, None, threading.Event(), {}

    def armed(self, launcher: Optional[int]) -> "StopRequests":
        """For one main(): `launcher`, the pid of the process that started this one (None: not a worker)."""
        self.launcher, self.cause, self.done = launcher, None, threading.Event()
        return self

    def __enter__(self) -> "StopRequests":
        self.previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        if self.launcher is not None:
            threading.Thread(target=self.watch, args=(self.done,), name="launcher watch", daemon=True).start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.done.set()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        stop = self.as_stop(error) if error is not None else None
        if stop is not None and stop is not error:
            raise stop from error

    def on_signal(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.cause = self.cause or signal.Signals(signum).name
        raise self.stop()

    def stop(self) -> KeyboardInterrupt:
        return KeyboardInterrupt() if self.cause == "SIGINT" else Interrupted(self.cause)

    def launcher_gone(self) -> bool:
        return self.launcher is not None and os.getppid() != self.launcher

    def watch(self, done: threading.Event) -> None:
        while not done.wait(LAUNCHER_POLL_S):
            if self.launcher_gone():
                self.cause = self.cause or f"its launcher's exit (pid {self.launcher})"
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # wakes it from a blocking call
                if not done.wait(LAUNCHER_GRACE_S):
                    say(f"interrupted by {self.cause}: not stopped after {LAUNCHER_GRACE_S:g} s; ended")
                    os._exit(exit_code(Interrupted(self.cause)))
                return

    def as_stop(self, error: BaseException) -> BaseException:
        """`error`, or the stop asked before it (SIGTERM, the launcher gone), of which it is a consequence:
        a collective fails when the other ranks have already stopped."""
        if not isinstance(error, Exception):
            return error
        if self.cause is None and self.launcher_gone():
            self.cause = f"its launcher's exit (pid {self.launcher})"
        return self.stop() if self.cause else error


STOPS = StopRequests()  # main arms it; signal handlers are process-wide, so is it


def exit_code(error: Optional[BaseException]) -> int:
    """main's exit code for a run that ended with `error` (None: it finished)."""
    if error is None:
        return 0
    if isinstance(error, KeyboardInterrupt):
        return 128 + (signal.SIGTERM if isinstance(error, Interrupted) else signal.SIGINT)
    for kind, code in ((InputError, 2), (NonFiniteLossError, 1), (WriteError, 3)):
        if isinstance(error, kind):
            return code
    return 1  # an uncaught exception: Python's exit code for it


def run_ending(error: Optional[BaseException], steps: Optional[str]) -> str:
    """What the log's last line says after `run ended: ` (records/runlogs.py reads it): finished;
    interrupted by SIGINT, SIGTERM or its launcher's exit at step s/N; stopped by a non-finite loss or
    an error at step s/N (a crash: its type and message, which no other line of the log holds); each
    with its exit code. s/N: the last step line written (`steps`)."""
    where = f"at step {steps}" if steps else "before its first step"
    if error is None:
        how = "finished"
    elif isinstance(error, KeyboardInterrupt):
        how = f"interrupted by {interruption_cause(error)} {where}"
    elif isinstance(error, NonFiniteLossError):
        how = f"stopped by a non-finite loss {where}"
    elif isinstance(error, (InputError, WriteError)):  # its message is the line above
        how = f"stopped by an error {where}"
    else:
        message = str(error).strip().splitlines()
        how = f"stopped by an error {where}: {type(error).__name__}" + (f": {message[0][:200]}" if message else "")
    return f"{how} (exit {exit_code(error)})"


def say(line: str) -> None:
    """A line on stderr; a console that is gone (a killed launcher's pipe) is let be."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


SAID_WAIT_S = 5.0  # how long a rank waits for another to say the line it did not say itself


def launch_folder() -> Optional[Path]:
    """The folder torchrun makes for this launch's workers on this machine (<log dir>/<run>_*/attempt_<k>/,
    worker r's TORCHELASTIC_ERROR_FILE in its <r>/), or None outside torchrun or in another layout."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return None
    own = Path(error_file).parent
    if own.name != os.environ.get("LOCAL_RANK") or not own.parent.name.startswith("attempt_"):
        return None
    return own.parent


def say_once(line: str, rank: int) -> None:
    """An error every rank meets (bad input, a non-finite loss), said once however the ranks race. Under
    torchrun the first rank to get here says it: when one worker exits, torchrun ends the others, so rank
    0 alone was often ended before it spoke. The workers of a machine agree through a file named after
    the line in torchrun's folder for the launch (created once: O_EXCL); the others wait until it is said
    (at most SAID_WAIT_S) before they exit. Elsewhere (no torchrun, another layout of its folder): rank 0."""
    folder = launch_folder()
    if folder is None:
        if rank == 0:
            say(line)
        return
    mark = folder / f"said-{hashlib.sha256(line.encode()).hexdigest()[:16]}"
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        deadline = time.monotonic() + SAID_WAIT_S
        while time.monotonic() < deadline and not (mark.exists() and mark.stat().st_size):
            time.sleep(0.05)
        return
    except OSError:  # no mark can be made: each rank says it rather than none
        say(line)
        return
    say(line)
    os.write(fd, b"said\n")
    os.close(fd)


NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}


def write_failure(e: OSError, flag: str) -> str:
    """A failed write as the run's lines tell it: `(the OS's reason)`, and for a full disk what to do,
    `(No space left on device): the disk is full; free space there or give another --log_dir`."""
    text = f"({e.strerror or e})"
    if e.errno in NO_ROOM:
        text += f": {NO_ROOM[e.errno]}; free space there or give another {flag}"
    return text


def torch_save_no_room(path: Path, obj) -> Optional[OSError]:
    """torch.save's writer reports a failed write as a RuntimeError without the OS's error (`unexpected
    pos A vs B`). The folder's free space tells a full disk: less than the bytes of the tensors being
    saved. Then an OSError(ENOSPC) with both sizes; else None (torch's error stands)."""
    need = sum(t.nbytes for t in torch.utils._pytree.tree_leaves(obj) if torch.is_tensor(t))
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return None
    if free >= need:
        return None
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free / 2**20:,.1f} MiB free, the file needs "
                                 f"about {need / 2**20:,.1f} MiB")


# the console's time left after train()'s step lines (RunLog.write's console_suffix; the log file has none)
ETA_FIRST_STEPS = 10  # steps timed before the console gives a time left


class Eta:
    """Wall-clock time left, validation included, from this process's pace so far per unit of the
    schedule's work: a step's work is its tokens x its FLOPs per token at its windows (step_work), so
    the batch ramp's small early steps and short windows do not make the estimate too low. Unknown
    for the first ETA_FIRST_STEPS steps (console only: the log's step lines keep the speedrun's format)."""

    def __init__(self, first_step: int, work: list[float]):
        self.first_step, self.num_steps, self.t0 = first_step, len(work), time.perf_counter()
        self.done_before = [0.0]  # work of the steps before step s
        for w in work:
            self.done_before.append(self.done_before[-1] + w)

    def text(self, steps_done: int) -> str:
        if steps_done >= self.num_steps or steps_done <= self.first_step:
            return ""
        if steps_done - self.first_step < ETA_FIRST_STEPS:
            return " eta:unknown"
        done = self.done_before[steps_done] - self.done_before[self.first_step]
        left = (time.perf_counter() - self.t0) / done * (self.done_before[-1] - self.done_before[steps_done])
        return f" eta:{int(left) // 60}m{int(left) % 60:02d}s"


def step_work(config: Hyperparameters, weights_flops: float) -> list[float]:
    """Each training step's model FLOPs: its batch's tokens x (the weights' FLOPs per token + its
    windows' attention FLOPs per token): what a step costs, relative to the others."""
    return [batch_tokens(s, config) * (weights_flops + attention_flops_per_token(config, *attention_windows(s, config)))
            for s in range(config.num_iterations)]


def hardware_description(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            return f"nvidia-smi failed: {e}"
    return f"CPU run: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


# What every log embeds at its top: this file, then the kernels file under a header of its own, the
# way upstream's short-track logs embed their triton_kernels.py (records/runlogs.py splits them)
KERNELS_HEADER = "\n\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\n"


def logged_source() -> str:
    """The source a run embeds in its log: this script as it is on disk, then the triton_kernels.py it
    imported (so a log holds every line of what computed its numbers)."""
    return Path(__file__).read_text() + KERNELS_HEADER + Path(kernels.__file__).read_text()


def open_run_log(config: Hyperparameters, device: torch.device, world_size: int, notes: list[str],
                 rank: int) -> RunLog:
    """Rank 0's log (docs/speedrun.md, Training loop, timing and logs): the script's source, versions and hardware, the resolved config
    (seed included), then the run's notes; the other ranks get a silent log."""
    if rank != 0:
        return RunLog(None)
    log = RunLog(Path(config.log_dir) / f"{config.run_id or config.preset}_{uuid.uuid4()}.txt")
    log.write(logged_source(), console=False)
    log.write("=" * 100, console=False)
    log.write(f"Running Python {sys.version}\nRunning PyTorch {torch.__version__}\n{hardware_description(device)}",
              console=False)
    log.write("=" * 100, console=False)
    log.write("\n".join(config_lines(config)), console=False)
    log.write(f"world_size {world_size}, micro-steps per rank {config.batch_slices // world_size}, device {device}")
    log.write(f"seed {config.seed} (repeat this run with --seed={config.seed})")
    log.write(recipe_summary(config))
    for note in notes:
        log.write(note)
    return log


def config_lines(config: Hyperparameters) -> list[str]:
    """What the log says of the configuration (records/runlogs.py reads it back): a line per field,
    then two JSON lines: each field's group, and the groups whose fields make two runs the same
    experiment. records/ derives "the same experiment" from them, so a field's group is said once,
    here, and never listed again by hand."""
    groups = {f.name: f.metadata["group"] for f in fields(Hyperparameters)}
    return [f"config {f.name} = {getattr(config, f.name)!r}" for f in fields(config)] + [
        f"config_groups = {json.dumps(groups)}", f"experiment_groups = {json.dumps(list(EXPERIMENT_GROUPS))}"]


def run_summary(config: Hyperparameters, result: dict, log: RunLog) -> str:
    summary = f"final val_loss {result['final_val_loss']:.4f}"
    meta = Path(config.val_files).parent / "synthetic_meta.json"
    if config.synthetic_data and meta.exists():
        m = json.loads(meta.read_text())
        summary += (f" nats/token (synthetic data: true conditional entropy {m['conditional_entropy']:.4f}, "
                    f"unigram entropy {m['unigram_entropy']:.4f})")
    return f"{summary}\nlog: {log.path}"


# what a run reads before anything is built: its shards (checked against the steps the run needs), the
# validation tokens and the byte table

class ShardNotFoundError(ShardError, FileNotFoundError):
    """No file matches a shard pattern."""


def shard_files(pattern: str, flag: str) -> list[str]:
    """The files a shard pattern matches, sorted; ShardError naming the flag if there are none, or if
    one is a folder or cannot be opened (found here, before anything is built, not mid-run)."""
    files = sorted(glob.glob(pattern))
    if not files:
        hint = ("; download them with `python data/cached_fineweb10B.py 30`" if "fineweb" in pattern else
                "; make them with `python data/synthetic.py --out FOLDER` (--synthetic_data writes only "
                "the tiny preset's own folder)" if "synthetic" in pattern else "")
        raise ShardNotFoundError(f"--{flag}: no files match {pattern!r}{hint}")
    for path in files:
        if os.path.isdir(path):
            raise ShardError(f"--{flag}: {path} is a folder, not a shard; make the pattern match shard files "
                             "only (e.g. end it in *.bin)")
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ShardError(f"--{flag}: {path} cannot be read ({e.strerror or e}); fix its permissions or "
                             "leave it out of the pattern")
    return files


def steps_available(files: list[str], step_tokens: int) -> int:
    """How many training steps the shards can feed (headers only)."""
    return sum(max(shard_token_count(f) - 1, 0) // step_tokens for f in files)  # an empty shard feeds 0, not -1


def steps_fed(files: list[str], config: Hyperparameters) -> int:
    """How many of the run's steps the shards feed, each step with its own size, from the headers
    only. Contiguous slices: exact (a step needs its tokens + 1 inside one shard). Whole documents:
    an upper bound (each slice needs its tokens + 1; the cut and skipped parts of documents are
    known only once a shard is read, and the loader stops with an error if they run out)."""
    sizes = [shard_token_count(f) for f in files]
    aligned = config.document_aligned_batches
    shard, position = 0, 0
    for step in range(config.num_iterations):
        tokens = batch_tokens(step, config)
        needed = tokens + (config.batch_slices if aligned else 1)
        while shard < len(sizes) and position + needed > sizes[shard]:
            shard, position = shard + 1, 0
        if shard == len(sizes):
            return step
        position += needed if aligned else tokens
    return config.num_iterations


@dataclass
class RunData:
    """What a run reads before anything is built: the train shards, the validation tokens, and the
    bytes per token id for val_bpb (None, with the reason, when the run reports no val_bpb)."""
    train_files: list[str]
    val_tokens: torch.Tensor
    token_bytes: Optional[np.ndarray]
    no_token_bytes_reason: str = ""


def load_data(config: Hyperparameters) -> RunData:
    """The train shard list, the validation tokens and the byte table, checked against what the run
    needs before anything is built or written (a bad table stops the run here, not after its log
    was opened)."""
    cfg = config
    train_files, val_files = shard_files(cfg.train_files, "train_files"), shard_files(cfg.val_files, "val_files")
    if cfg.batch_schedule or cfg.document_aligned_batches:
        available = steps_fed(train_files, cfg)
        if available < cfg.num_iterations:
            bound = " at most" if cfg.document_aligned_batches else ""
            raise ShardError(f"--train_files: {len(train_files)} shard(s) feed{bound} {available} of the run's "
                             f"{cfg.num_iterations} steps; add shards or lower --num_iterations")
    else:
        available = steps_available(train_files, cfg.batch_slices * cfg.train_seq_len)
        if available < cfg.num_iterations:
            raise ShardError(f"--train_files: {len(train_files)} shard(s) feed {available} steps of "
                             f"{cfg.batch_slices * cfg.train_seq_len} tokens, the run needs {cfg.num_iterations}; "
                             "add shards or lower --num_iterations")
    val_tokens = torch.cat([read_shard(f) for f in val_files])
    if val_tokens.numel() < cfg.val_tokens + 1:
        raise ShardError(f"--val_files: {val_tokens.numel()} validation tokens, --val_tokens needs {cfg.val_tokens + 1}")
    token_bytes, why_not = read_token_bytes(cfg)
    if cfg.prefix_loss_weight:  # §16 --prefix_loss_weight: its byte files checked before the log opens
        prefix_table(cfg)
    return RunData(train_files, val_tokens[:cfg.val_tokens + 1], token_bytes, why_not)


def read_token_bytes(config: Hyperparameters) -> tuple[Optional[np.ndarray], str]:
    """(bytes per token id, "") or (None, why val_bpb is not reported): with --token_bytes_file='', or
    when the preset's own table is missing. A path given on the command line is not optional: missing,
    a folder, not a .npy file, or not one byte count per token id is a ConfigError."""
    name = config.token_bytes_file
    if not name:
        return None, "--token_bytes_file=''"
    path, flag = Path(name), f"--token_bytes_file: {name}"
    if not path.exists():
        if name == make_config(config.preset).token_bytes_file:
            return None, f"the {config.preset} preset's table {name} is missing"
        raise ConfigError(f"{flag} does not exist; give the path of the byte table (a .npy file), or "
                          "--token_bytes_file='' to run without val_bpb")
    if path.is_dir():
        raise ConfigError(f"{flag} is a folder; give the path of the byte table (a .npy file)")
    try:
        table = np.load(path, allow_pickle=False)
    except OSError as e:
        raise ConfigError(f"{flag} cannot be read ({e.strerror or e})")
    except (ValueError, EOFError):
        raise ConfigError(f"{flag} is not a .npy array file; make the table with data/gpt2_token_bytes.py "
                          "(or data/synthetic.py), or pass --token_bytes_file='' to run without val_bpb")
    if not isinstance(table, np.ndarray):  # an .npz archive
        table.close()
        raise ConfigError(f"{flag} is an .npz archive; the byte table is a single .npy array")
    if table.dtype.kind not in "ui":
        raise ConfigError(f"{flag} holds {table.dtype} values; byte counts are integers (uint8)")
    if table.shape != (config.vocab_size,):
        raise ConfigError(f"{flag} has shape {table.shape} ({table.size} entries, the vocabulary has "
                          f"{config.vocab_size}); it needs one byte count per token id, shape ({config.vocab_size},)")
    if table.size and table.min() < 0:
        raise ConfigError(f"{flag} holds negative byte counts")
    return table, ""


def token_bytes_on_device(data: RunData, config: Hyperparameters, device, log: RunLog) -> Optional[torch.Tensor]:
    """Bytes per token id (int64, padded ids 0) for val_bpb, or None (said in the log) without a table."""
    if data.token_bytes is None:
        log.write(f"val_bpb: not reported ({data.no_token_bytes_reason})")
        return None
    out = torch.zeros(config.padded_vocab_size, dtype=torch.int64)
    out[:config.vocab_size] = torch.from_numpy(data.token_bytes.astype(np.int64))
    return out.to(device)


def allocator_settings(environ=os.environ) -> tuple[str, str]:
    """(the CUDA caching allocator's settings, where they were read): what the allocator parsed,
    where torch tells (2.13); else (torch 2.11) the variable it read them from when CUDA started,
    which use_expandable_segments set unless the user had; "" for its defaults."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter(), "the allocator"
    for name in ALLOC_CONF_VARIABLES:
        if environ.get(name):
            return environ[name], f"${name} (this torch does not report what its allocator parsed)"
    return "", "no variable set (this torch does not report what its allocator parsed)"


def reset_peak_memory(device: torch.device) -> None:
    """Restart the CUDA allocator's peaks from what is allocated now (the CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> tuple[int, int]:
    """CUDA: allocator peaks. CPU: the process's peak resident set size for both numbers."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() // 2**20, torch.cuda.max_memory_reserved() // 2**20
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return rss, rss

# ---- checkpoints: written atomically, validated on load, resumable on any world size

class CheckpointError(InputError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong."""


# 2: Adam's sharded moments in the rank files, by rows (meta.json's adam_shards); 1 held Adam whole in
# main.pt, which format 2's loader still reads
CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, 2)


def checkpoint_run_dir(config: Hyperparameters) -> Path:
    return Path(config.checkpoint_dir) / (config.run_id or config.preset)


def config_record(config: Hyperparameters, dtype: torch.dtype) -> dict:
    """The config as saved with a checkpoint, with `dtype` resolved (auto means different things on CPU and GPU)."""
    return {**dataclasses.asdict(config), "dtype": str(dtype).removeprefix("torch.")}


def config_differences(saved: dict, now: dict) -> dict[str, tuple]:
    """{field: (checkpoint value, current value)} over the fields that change training (the recipe
    and seed-idea groups). A field the checkpoint predates counts as its default."""
    diffs = {}
    for f in fields(Hyperparameters):
        if f.metadata["group"] in TRAINING_GROUPS and f.name in now:
            old = _as_field_value(f, saved.get(f.name, f.default))
            if old != _as_field_value(f, now[f.name]):
                diffs[f.name] = (old, now[f.name])
    return diffs


def parameter_layout(config_values: dict) -> dict[str, tuple]:
    """{state name: (shape, dtype)} of the model a saved or current config builds (meta device)."""
    by_name = {f.name: f for f in fields(Hyperparameters)}
    values = {k: _as_field_value(by_name[k], v) for k, v in config_values.items() if k in by_name}
    config = Hyperparameters(**values)
    with torch.device("meta"):
        model = GPT(config, getattr(torch, config_values["dtype"]))
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def rng_states(device: torch.device) -> dict:
    states = dict(torch=torch.get_rng_state(), python=random.getstate())
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states["numpy"] = dict(keys=torch.from_numpy(keys.astype(np.int64)), pos=pos, has_gauss=has_gauss, gauss=gauss)
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    n = states["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_durably(path: Path, obj) -> dict:
    """torch.save (or JSON for a dict named *.json), flushed to disk; returns its size and hash."""
    with open(path, "wb") as f:
        if path.suffix == ".json":
            f.write(json.dumps(obj, indent=1).encode())
        else:
            try:
                torch.save(obj, f)
            except RuntimeError as e:
                no_room = torch_save_no_room(path, obj)
                if no_room is None:
                    raise
                raise no_room from e
        f.flush()
        os.fsync(f.fileno())
    return dict(bytes=path.stat().st_size, sha256=file_sha256(path))


class _CheckpointWrite:
    """The steps of one save, each followed by a vote of all ranks: if a step failed on any rank
    (disk full, permissions), every rank learns it at the same point and raises WriteError, and
    rank 0 removes the partial folder, so no rank waits forever for one that gave up."""

    def __init__(self, runner: Runner, partial: Path):
        self.runner, self.partial, self.failure = runner, partial, None

    def attempt(self, path: Path, write) -> Optional[dict]:
        """write() on this rank unless a step already failed here; the failure is kept, naming `path`:
        an OSError, or the RuntimeError torch.save raises when its writer fails (a full disk)."""
        if self.failure is None:
            try:
                return write()
            except OSError as e:  # a full disk: said so, with the fix (torch.save's own form: _write_durably)
                self.failure = f"cannot write {path} {write_failure(e, '--checkpoint_dir')}"
            except RuntimeError as e:  # torch.save: "PytorchStreamWriter failed writing file ...: file write failed"
                lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # torch's reason: the last
                self.failure = f"cannot write {path} ({lines[-1][-200:] if lines else type(e).__name__})"
        return None

    def all_ranks_ok(self) -> None:
        """The vote: WriteError on every rank if any rank failed (one all-reduce of a flag)."""
        failed = self.failure is not None
        if self.runner.world_size > 1:
            flag = torch.tensor(int(failed), device=self.runner.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if not failed:
            return
        if self.runner.rank == 0:
            shutil.rmtree(self.partial, ignore_errors=True)
        where = self.failure or "another rank could not write its files (its own message says why)"
        raise WriteError(f"checkpoint {self.partial.name} not saved: {where}; its partial folder is removed, "
                         f"the checkpoints already in {self.partial.parent} are untouched")


def adam_checkpoint_state(adam: CautiousAdam, names: dict) -> tuple[dict, dict]:
    """Adam's state as a checkpoint splits it: (the tensors stepped whole, the same on every rank:
    rank 0 saves them in main.pt; this rank's rows of the sharded ones, {name: dict(rows=(start, stop),
    state=...)}: in its own file), on the CPU."""
    whole, rows = {}, {}
    for p, state in adam.state.items():
        copied = {k: _copy(v, "cpu") for k, v in state.items()}
        if adam.rows[p] is None:
            whole[names[p]] = copied
        else:
            rows[names[p]] = dict(rows=adam.rows[p], state=copied)
    return whole, rows


def loader_state(loader: DataLoader) -> dict:
    """Where a training loader's next step starts (DataLoader's and DocumentAlignedLoader's alike: the
    shard, its token count and a token position), the shard named (not numbered) so that added shards
    don't move it."""
    path = loader.files[loader.file_index]
    return dict(file=Path(path).name, file_tokens=shard_token_count(path), position=loader.position)


def load_loader_state(loader: DataLoader, state: dict) -> None:
    """The loader goes on from loader_state's record: its shard found by name and checked by size."""
    names = [Path(f).name for f in loader.files]
    if state["file"] not in names:
        raise ShardError(f"the checkpoint's data position is in shard {state['file']}, which is not among "
                         f"--train_files ({len(names)} shards)")
    index = names.index(state["file"])
    if shard_token_count(loader.files[index]) != state["file_tokens"]:
        raise ShardError(f"{loader.files[index]}: {shard_token_count(loader.files[index])} tokens, but the "
                         f"checkpoint's shard of that name had {state['file_tokens']}; not the same data")
    loader.file_index, loader.position, loader.tokens = index, state["position"], None  # read again from there


def save_checkpoint(runner: Runner, loader: DataLoader, step: int, train_time_ms: float) -> Path:
    """<checkpoint_dir>/<run>/step_<N>/: rank r writes rank_<r>.pt (the Muon momentum and low bits
    of the matrices it owns, its rows of Adam's sharded moments, its RNG states), rank 0 also main.pt
    (model, the Adam state stepped whole, step, train time, data position, config) and, once every
    file is complete, meta.json (sizes and hashes of the files, which file holds which matrix and
    which rows). All of it is written under step_<N>.partial and renamed
    at the end, so an interrupted save is never taken for a checkpoint. A write that fails on any
    rank stops every rank with WriteError and leaves no partial folder behind; so does a stop during
    the save (Ctrl-C, SIGTERM, the launcher's exit: rank 0 removes the folder). One left by a kill is
    never read, and the next save of its step clears it."""
    partial = checkpoint_run_dir(runner.config) / f"step_{step:06d}.partial"
    try:
        return _write_checkpoint(runner, loader, step, train_time_ms, partial)
    except KeyboardInterrupt:
        if runner.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_checkpoint(runner: Runner, loader: DataLoader, step: int, train_time_ms: float, partial: Path) -> Path:
    cfg, rank, W = runner.config, runner.rank, runner.world_size
    final = partial.with_suffix("")
    save = _CheckpointWrite(runner, partial)
    if rank == 0:
        save.attempt(partial, lambda: _empty_folder(partial))
    save.all_ranks_ok()
    names = {p: n for n, p in runner.model.named_parameters()}
    adam, muon_opt = runner.optimizers
    muon = optimizer_state(muon_opt, names, "cpu")["state"]
    adam_whole, adam_rows_here = adam_checkpoint_state(adam, names)
    own_file = f"rank_{rank:03d}.pt"
    records = {own_file: save.attempt(partial / own_file, lambda: _write_durably(
        partial / own_file, dict(muon=muon, adam=adam_rows_here, rng=rng_states(runner.device))))}
    share_fp8_down_scales(runner.model, rank, W)  # §17 --fp8_mlp_down: its per-slice scales are not replicated
    if rank == 0:  # the model and the Adam state stepped whole are the same on every rank
        model_state = {k: _copy(v, "cpu") for k, v in runner.model.state_dict().items()}
        records["main.pt"] = save.attempt(partial / "main.pt", lambda: _write_durably(partial / "main.pt", dict(
            format=CHECKPOINT_FORMAT, step=step, train_time_ms=train_time_ms, loader=loader_state(loader),
            model=model_state, optimizers=[adam_whole], config=config_record(cfg, runner.model.dtype))))
    save.all_ranks_ok()
    shards = {name: [own_file, *piece["rows"]] for name, piece in adam_rows_here.items()}
    mine = (records, {name: own_file for name in muon}, shards)
    gathered = [mine]
    if W > 1:
        gathered = [None] * W
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        adam_shards: dict[str, list] = {}
        for _, _, pieces in gathered:
            for name, piece in pieces.items():
                adam_shards.setdefault(name, []).append(piece)
        meta = dict(format=CHECKPOINT_FORMAT, step=step, num_iterations=cfg.num_iterations, world_size=W,
                    train_time_ms=train_time_ms, config=config_record(cfg, runner.model.dtype),
                    files={k: v for recs, _, _ in gathered for k, v in recs.items()},
                    muon_state={k: v for _, owners, _ in gathered for k, v in owners.items()},
                    adam_shards=adam_shards, torch_version=torch.__version__)
        # written last: its presence marks the files complete
        save.attempt(partial / "meta.json", lambda: _write_durably(partial / "meta.json", meta))
        save.attempt(final, lambda: _publish(partial, final))
    save.all_ranks_ok()
    return final


def _empty_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # what an interrupted save left
    path.mkdir(parents=True)


def _publish(partial: Path, final: Path) -> None:
    """Rename a complete step_N.partial to step_N (replacing the same step of an earlier run under
    this name), durably."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old)
    else:
        os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def prune_checkpoints(run_dir: Path, keep: int) -> list[str]:
    """--keep_checkpoints: delete this run folder's complete checkpoints (step_N) but the newest `keep`,
    the one just written among them; a partial folder is not touched (a save still in progress). A
    deletion that fails is a note, not a stop (bookkeeping never ends a run)."""
    steps = sorted((int(m[1]), d) for d in run_dir.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", d.name)))
    notes = []
    for _, old in steps[:-keep]:
        try:
            shutil.rmtree(old)
            notes.append(f"checkpoint deleted (--keep_checkpoints={keep}): {old}")
        except OSError as e:
            notes.append(f"note: --keep_checkpoints={keep}: cannot delete {old} ({e.strerror or e}); it stays")
    return notes


def checkpoint_folder_problem(path: Path) -> Optional[str]:
    """Why `path` is not even a folder (missing, or a file: one of a checkpoint's own files names the
    folder meant), or None; validate_checkpoint checks the rest. Reads no file (the tools ask first)."""
    path = Path(path)
    if path.is_dir():
        return None
    if not path.exists():
        return f"{path}: no such checkpoint folder"
    if (path.parent / "meta.json").is_file():
        return f"{path}: a file of the checkpoint {path.parent}; give the folder itself: {path.parent}"
    return f"{path}: a file, not a checkpoint folder; give a step_<N> folder of --checkpoint_dir"


def validate_checkpoint(path: Path) -> dict:
    """meta.json of a complete, unmodified checkpoint; CheckpointError naming the file otherwise."""
    path = Path(path)
    meta_path = path / "meta.json"
    if problem := checkpoint_folder_problem(path):
        raise CheckpointError(problem)
    if not meta_path.exists():
        if (path / "main.pt").exists() or any(path.glob("rank_*.pt")):
            raise CheckpointError(f"{meta_path}: missing, so {path} is not a complete checkpoint (an interrupted save?)")
        raise CheckpointError(f"{path}: not a checkpoint folder (no meta.json); give a step_<N> folder of "
                              "--checkpoint_dir")
    try:
        text = meta_path.read_text()
    except OSError as e:
        raise CheckpointError(f"{meta_path}: {e.strerror or e}")
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})")
    try:
        records = {name: (int(r["bytes"]), str(r["sha256"])) for name, r in meta["files"].items()}
        saved_format = meta.get("format")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: not a checkpoint's meta.json ({type(e).__name__}: {e})")
    if saved_format not in READABLE_FORMATS:
        raise CheckpointError(f"{meta_path}: checkpoint format {saved_format}, this script reads formats "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    for name, (nbytes, sha256) in records.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing (recorded in {meta_path})")
        try:
            size, digest = f.stat().st_size, file_sha256(f)
        except OSError as e:
            raise CheckpointError(f"{f}: {e.strerror or e}")
        if size != nbytes:
            raise CheckpointError(f"{f}: {size} bytes, but {nbytes} were written (truncated or modified)")
        if digest != sha256:
            raise CheckpointError(f"{f}: its SHA-256 differs from the one recorded when it was written (corrupted)")
    return meta


def find_checkpoint(config: Hyperparameters) -> tuple[Path, dict, list[str]]:
    """The checkpoint --resume names (for `latest`, the newest valid one of this run name), validated,
    and notes for the log about the newer ones it had to skip."""
    if config.resume != "latest":
        return Path(config.resume), validate_checkpoint(Path(config.resume)), []
    run_dir = checkpoint_run_dir(config)
    steps = sorted(((int(m[1]), d) for d in run_dir.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", d.name))),
                   reverse=True)
    skipped = []
    for _, path in steps:
        try:
            return path, validate_checkpoint(path), skipped
        except CheckpointError as e:
            skipped.append(f"--resume latest: skipping {path}: {e}")
    raise CheckpointError(f"--resume latest: no valid checkpoint in {run_dir}" + "".join(f"\n  {s}" for s in skipped))


def check_resume_config(meta: dict, config: Hyperparameters, dtype: torch.dtype) -> list[str]:
    """Refuse a resume whose config changes training (unless --force_resume; never when the model's
    parameters differ in shape or dtype); returns the differences that were forced, for the log."""
    now = config_record(config, dtype)
    diffs = config_differences(meta["config"], now)
    saved_start = {k: meta["config"].get(k, f.default) for k, f in
                   ((f.name, f) for f in fields(Hyperparameters)) if k in ("preset", "recipe")}
    start = {"preset": config.preset, "recipe": config.recipe}
    if diffs and saved_start != start and not config.force_resume:  # another recipe: every field it sets differs
        want = " ".join(f"--{k}={v}" for k, v in saved_start.items())
        # an x01-lineage checkpoint resumes only in its frozen script, which this one's --recipe refuses
        how = f"python {FROZEN_SCRIPT} {want}" if saved_start["recipe"] in FROZEN_RECIPES else want
        raise CheckpointError(f"refusing to resume: the checkpoint was made with {want}, this run asks for "
                              f"{' '.join(f'--{k}={v}' for k, v in start.items())} ({len(diffs)} fields that change "
                              f"training differ); resume it with {how} and the checkpoint's other flags")
    listing = "".join(f"\n  --{name}: checkpoint {to_text(old)}, now {to_text(new)}"
                      for name, (old, new) in diffs.items())
    if diffs:
        saved_layout, layout = parameter_layout(meta["config"]), parameter_layout(now)
        changed = sorted(n for n in set(saved_layout) | set(layout) if saved_layout.get(n) != layout.get(n))
        if changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            raise CheckpointError(f"cannot resume: the model's parameters differ in shape or dtype from the "
                                  f"checkpoint's ({shown}), even with --force_resume:{listing}")
    if diffs and not config.force_resume:
        raise CheckpointError(f"refusing to resume: the config differs from the checkpoint's in fields that change "
                              f"training:{listing}\nresume with the checkpoint's values, or pass --force_resume")
    return [f"--force_resume: resuming with a different config:{listing}"] if diffs else []


def _load(path: Path) -> dict:
    try:  # memory-mapped: a rank reads only the tensors it takes
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {e})")


def load_checkpoint(runner: Runner, loader: DataLoader, path: Path, meta: dict) -> tuple[int, float]:
    """Restore a validated checkpoint into a built runner and loader; returns (step, train_time_ms).
    Each rank takes the Muon state of the matrices it owns under the *current* world size, from
    whichever rank file holds it, so a run saved on 8 processes resumes on 4 (or 1)."""
    path = Path(path)
    main_file = _load(path / "main.pt")
    current = runner.model.state_dict()
    for name in sorted(set(current) | set(main_file["model"])):
        got, want = main_file["model"].get(name), current.get(name)
        if got is None or want is None or got.shape != want.shape or got.dtype != want.dtype:
            describe = lambda t: "absent" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise CheckpointError(f"{path / 'main.pt'}: parameter {name} is {describe(got)} in the checkpoint, "
                                  f"{describe(want)} in this model")
    names = {p: n for n, p in runner.model.named_parameters()}
    owned = {opt: [names[p] for group in opt.param_groups for p in opt.owned(group)]
             for opt in runner.optimizers if isinstance(opt, Muon)}
    by_file: dict[str, list[str]] = {}
    for name in (n for names_of_opt in owned.values() for n in names_of_opt):
        if name not in meta["muon_state"]:
            raise CheckpointError(f"{path / 'meta.json'}: no Muon state recorded for {name}")
        by_file.setdefault(meta["muon_state"][name], []).append(name)
    muon_state = {}
    for file_name, wanted in by_file.items():
        saved = _load(path / file_name)["muon"]
        muon_state.update({name: saved[name] for name in wanted})
    adam = runner.optimizers[0]
    adam_state = adam_state_from_checkpoint(path, meta, main_file["optimizers"][0],
                                            {names[p]: adam.rows[p] for p in adam.state})
    states = [dict(state={n: muon_state[n] for n in owned[opt]}) if opt in owned else dict(state=adam_state)
              for opt in runner.optimizers]
    restore_state(runner.model, runner.optimizers, dict(model=main_file["model"], optimizers=states))
    load_loader_state(loader, main_file["loader"])
    rng_file = f"rank_{runner.rank:03d}.pt" if f"rank_{runner.rank:03d}.pt" in meta["files"] else "rank_000.pt"
    set_rng_states(_load(path / rng_file)["rng"], runner.device)
    return main_file["step"], main_file["train_time_ms"]


def adam_state_from_checkpoint(path: Path, meta: dict, whole: dict, wanted: dict[str, Optional[tuple[int, int]]]
                               ) -> dict[str, dict]:
    """This rank's Adam state from a checkpoint of any world size (resharded on load): for each name,
    the rows `wanted` gives (None: all of it), cut from the whole state main.pt holds, or put together
    from the rank files' rows (meta.json's adam_shards: [file, start, stop] pieces)."""
    pieces_of = meta.get("adam_shards", {})
    files: dict[str, dict] = {}
    out = {}
    for name, rows in wanted.items():
        if name in whole:
            state = whole[name]
            out[name] = {k: v if not torch.is_tensor(v) or rows is None else v[rows[0]:rows[1]]
                         for k, v in state.items()}
            continue
        if name not in pieces_of:
            raise CheckpointError(f"{path / 'meta.json'}: no Adam state recorded for {name}")
        start, stop = rows if rows is not None else (0, max(p[2] for p in pieces_of[name]))
        parts, step = {}, None
        for file_name, a, b in sorted(pieces_of[name], key=lambda piece: piece[1]):
            if b <= start or a >= stop:
                continue
            if file_name not in files:
                files[file_name] = _load(path / file_name)["adam"]
            piece = files[file_name][name]["state"]
            for k, v in piece.items():
                if torch.is_tensor(v):
                    parts.setdefault(k, []).append(v[max(start, a) - a:min(stop, b) - a])
                else:
                    step = v
        out[name] = {k: torch.cat(v) for k, v in parts.items()} | {"step": step}
        if any(t.shape[0] != stop - start for t in out[name].values() if torch.is_tensor(t)):
            raise CheckpointError(f"{path / 'meta.json'}: the saved rows of {name}'s Adam state do not cover "
                                  f"rows {start}..{stop - 1}")
    return out


def resume_from(resume: Optional[tuple], runner: Runner, loader: DataLoader, log: RunLog
                ) -> tuple[int, float, Optional[Path]]:
    """(first step, train time so far, last checkpoint): from a validated checkpoint, restored
    after the warm-up (which must not touch what the checkpoint restores), or a fresh start."""
    if resume is None:
        return 0, 0.0, None
    path, meta = resume
    start, train_time_ms = load_checkpoint(runner, loader, path, meta)
    log.write(f"resumed from {path} at step {start}/{runner.config.num_iterations}, train_time {train_time_ms:.0f}ms "
              f"(saved by {meta['world_size']} process(es), now {runner.world_size})")
    return start, train_time_ms, path


def prepare_checkpoints(config: Hyperparameters, dtype: torch.dtype, rank: int,
                        world_size: int) -> tuple[Optional[tuple], list[str]]:
    """Before anything is built, rank 0 finds and validates the checkpoint to resume and checks the
    config against it; a fresh run that would save into a run folder holding checkpoints already is
    refused (`--resume latest` could later pick up the other run's). Every rank gets the verdict:
    ((folder, meta) or None, notes for the log), or the CheckpointError."""

    def check() -> tuple[Optional[tuple], list[str]]:
        if config.resume:
            path, meta, notes = find_checkpoint(config)
            return (path, meta), notes + check_resume_config(meta, config, dtype)
        run_dir = checkpoint_run_dir(config)
        if config.save_every and any(re.fullmatch(r"step_\d+", d.name) for d in run_dir.glob("step_*")):
            raise CheckpointError(f"{run_dir} holds checkpoints of an earlier run: continue it with --resume "
                                  "latest, or choose another --run_id or --checkpoint_dir")
        return None, []
    return on_rank0_for_all(check, rank, world_size)

# ---- accounting: parameters, optimizer state, FLOPs, learned scalars; the dry run

def parameter_counts(model: GPT) -> dict[str, int]:
    """Parameters per optimizer group and in total; with --untie_embed_after_step also how many
    are in use before the split (the input table is not read until then)."""
    counts = {name: sum(p.numel() for p in ps) for name, ps in parameter_groups(model).items()}
    counts["total"] = sum(counts.values())
    if untie_step(model.config):
        counts["in_use_before_split"] = counts["total"] - model.embeds[0].weight.numel()
    return counts


def keys_per_query(window: int, block_size: int) -> float:
    """Keys a query attends under a token window of `window` blocks, away from the sequence start
    (documents ignored): itself and the window x block_size keys before it."""
    return window * block_size + 1


def attention_flops_per_token(config: Hyperparameters, long_window: int, short_window: int) -> float:
    """Attention scores and values, 12 x attn_dim x keys per query, summed over the attention layers."""
    per_layer = [keys_per_query(long_window if i in config.long_layers else short_window, config.attn_block_size)
                 for i in config.attention_layers]
    return 12 * config.attn_dim * sum(per_layer)


def schedule_windows(config: Hyperparameters) -> list[tuple[int, int]]:
    """(long, short) window of every training step, in blocks."""
    return [attention_windows(s, config) for s in range(config.num_iterations)]


def flops_per_token(config: Hyperparameters, model: GPT) -> dict[str, float]:
    """Model FLOPs per training token (docs/speedrun.md, Model FLOPs): 6 x matmul weights + attention scores and values
    (12 x attn_dim x keys per query) averaged over the run's window schedule: over its steps, or
    with a batch ramp (--batch_schedule) over its tokens (a step's weight is its batch)."""
    groups = parameter_groups(model)
    matmul_weights = sum(p.numel() for name, ps in groups.items() if name == "head" or name.startswith("muon")
                         for p in ps)
    weight = collections.Counter()
    for step, window in enumerate(schedule_windows(config)):
        weight[window] += batch_tokens(step, config) if config.batch_schedule else 1
    attention = 0.0
    for (long_window, short_window), n in sorted(weight.items()):
        attention += n * attention_flops_per_token(config, long_window, short_window)
    attention /= sum(weight.values())
    return dict(weights=6.0 * matmul_weights, attention=attention, total=6.0 * matmul_weights + attention)


def flops_by_window(config: Hyperparameters, model: GPT) -> dict[str, float]:
    """Model FLOPs per token at each (long, short) window of the schedule, in the schedule's order
    ("long/short": FLOPs)."""
    weights = flops_per_token(config, model)["weights"]
    return {f"{lw}/{sw}": weights + attention_flops_per_token(config, lw, sw)
            for lw, sw in dict.fromkeys(schedule_windows(config))}


def optimizer_state_parts(group: str, p: nn.Parameter, config: Optional[Hyperparameters] = None) -> dict[str, int]:
    """Bytes of one parameter's optimizer state by kind. Adam: two moments in the parameter's dtype
    (fp32 with adam_fp32_moments).
    Muon: an fp32 momentum, plus the 16 low bits of the fp32 master for bf16 weights; the gates keep
    momentum and statistic in their own dtype and have no low bits; with row normalization one
    statistic per row. Each counted once: Muon's is held by the rank that owns the matrix, Adam's is
    the same on every rank."""
    cfg = config or Hyperparameters()
    dtype_name = lambda dt: str(dt).removeprefix("torch.")
    if not group.startswith("muon"):
        moments = torch.float32 if cfg.adam_fp32_moments else p.dtype
        return {f"adam moments {dtype_name(moments)}": 2 * p.numel() * torch.finfo(moments).bits // 8}
    options = MUON_GROUP_OPTIONS.get(group, {})
    own_dtype = options.get("gate", False)
    state = p.dtype if own_dtype else torch.float32
    size = torch.finfo(state).bits // 8
    parts = {f"muon momentum {dtype_name(state)}": p.numel() * size}
    if p.dtype == torch.bfloat16 and not own_dtype:
        parts["muon low bits int16"] = p.numel() * 2
    if cfg.muon_row_normalization:
        shape = orthogonalized_shape(p, options)
        parts[f"normuon row statistics {dtype_name(state)}"] = p.numel() // shape[normuon_reduce_dim(p, options)] * size
        if group == "muon_attn" and cfg.muon_qk_group_heads:  # §13: Q and K's blocks' statistics and V and O's
            stats = qk_group_statistic_shapes(p.shape, qk_group_rows(cfg)).values()
            parts[f"normuon row statistics {dtype_name(state)}"] = sum(math.prod(s) for s in stats) * size
    return parts


def optimizer_state_bytes(group: str, p: nn.Parameter, config: Optional[Hyperparameters] = None) -> int:
    return sum(optimizer_state_parts(group, p, config).values())


def muon_owned_bytes(model: GPT, config: Hyperparameters, world_size: int) -> list[int]:
    """Per rank, the Muon state of the matrices it owns: Muon's dealing (each group split by shape,
    largest first, round-robin over the ranks)."""
    per_rank = [0] * world_size
    for name, params in parameter_groups(model).items():
        if not name.startswith("muon"):
            continue
        params = sorted(params, key=lambda p: p.numel(), reverse=True)
        for shape in dict.fromkeys(p.shape for p in params):
            for i, p in enumerate(q for q in params if q.shape == shape):
                per_rank[i % world_size] += optimizer_state_bytes(name, p, config)
    return per_rank


def adam_bytes_per_rank(model: GPT, config: Hyperparameters, world_size: int) -> int:
    """Adam's moments one rank holds on world_size ranks: its 1/W of each tensor adam_rows shards (the
    rows it steps), the rest whole."""
    return sum(optimizer_state_bytes(n, p, config) // (1 if adam_rows(p, 0, world_size) is None else world_size)
               for n, ps in parameter_groups(model).items() if not n.startswith("muon") for p in ps)


def state_bytes_per_gpu(model: GPT, config: Hyperparameters, world_size: int) -> dict[str, int]:
    """What one process holds besides activations: parameters, their gradients, its share of Adam's
    moments (adam_bytes_per_rank), the Muon state of the busiest rank (and §14's sign table, where
    built)."""
    groups = parameter_groups(model)
    params = sum(p.numel() * p.element_size() for ps in groups.values() for p in ps)
    adam = adam_bytes_per_rank(model, config, world_size)
    held = dict(parameters=params, gradients=params, adam=adam, muon=max(muon_owned_bytes(model, config, world_size)))
    if model.bigram is not None and model.bigram.signs is not None:  # §14 --bigram_sign_rows: a buffer
        held["sign table"] = model.bigram.signs.table.numel() * model.bigram.signs.table.element_size()
    return held


# The peak memory the record logged on 8xH100 (57,397 MiB allocated) is the base of the predicted
# peak of other configurations of the same shapes: it moves by what they hold more per GPU
# (state_bytes_per_gpu) and by the activation the backout keeps for the backward pass, a (T, d)
# bf16 tensor of a rank's sequence (the difference it normalizes).
BACKOUT_KEPT_ACTIVATIONS = 1
# --mudd keeps the outputs of its three mixes for backward (block L-2's residual update, block L-1's
# value mix, the mix after the last block), each (T, d) bf16: an estimate, not measured. With one net
# (--mudd_nets) simply its own share: 2 for the penultimate net, 1 for the final one (kept simple: the
# per-token weights, (T, 1) each, are left out)
MUDD_KEPT_ACTIVATIONS = {"both": 3, "penultimate": 2, "final": 1}
# --fp8 keeps the head's e4m3 codes for backward, one byte each: the rank's input (T, d) and the
# weight (d, V). Transients of the loss's backward (the gradient's e5m2 codes) are not modelled.
# §14 --bigram_sign_rows holds its sign table (state_bytes_per_gpu) and is taken to keep the gathered
# signs for the product's backward, one (T, d) tensor in the model dtype (recomputing them from the
# indices would keep T int64s instead: an estimate, not measured).
# §12 --xsa_layers is taken to keep XSA_KEPT_PER_HEAD (T, H) tensors in the model dtype per listed block
# (y.v, |v|^2 and their quotient; what torch 2.13's CPU Inductor keeps for a toy XSA: not measured on CUDA).
XSA_KEPT_PER_HEAD = 3
# §18 --mudd_gate is taken to keep each net's hidden layer before and after its GELU and its outputs,
# (T, 64) and (T, n) in the model dtype; --dc_layers its band form's P, (T, H, W) fp32, and padded k and v
# per block (what DCBand saves, compiled or not: tests/test_mudd_gate.py). --attn_gate_layers' fewer gates are not counted.
# §15 --mlp_backward_from_post is taken to keep one (T, hidden) tensor per block, as the record's compiled
# MLP is taken to (its pre, relu(pre)^2 recomputed): no change predicted. If CUDA's Inductor keeps two, as
# the CPU's does, the switch frees one per block, which this does not count. §17's FP8 codes are made and
# freed inside the forward's product (nothing new is kept for the backward); its scales are bytes.
# A configuration that differs from the record only in peak_neutral fields (their metadata) gets a
# prediction. Among them, #252's held tensors (the bigram table, fp32 Adam moments, bf16 blocks and
# their low bits) are in state_bytes_per_gpu, and its fused loss is taken to keep what the record's
# compiled loss keeps, the (T, V) bf16 logits; #261's loss variant keeps the gradient's codes instead
# of the logits, taken as the same (assumptions: neither was measured here).
PEAK_WORLD_SIZE = 8

# What fits where (docs/scale.md). A rank runs batch_slices / W micro-steps of one slice each (train_seq_len
# tokens at the full batch, fewer along the batch ramp): the slice is the micro-batch, so a rank's
# activations are one slice's at any world size W, and W moves only the state a rank holds (Muon's share
# of the matrices, 1/W of Adam's sharded moments). The prediction at other W and slices is derived from
# the same anchor: the record's activations, its logged peak less the state it held, scale with the
# slice's tokens (every tensor kept for backward is per token; the windowed attention's too). Estimates,
# none measured on a GPU here:
# - --activation_checkpointing: the blocks keep per_token_kept (T, d) tensors in the model dtype; one
#   block at a time is recomputed, its share of the record's activations once its loss's are taken out;
#   the loss runs in LOSS_CHUNK_TOKENS chunks (the fused loss, --fused_softcap_ce, over the whole slice);
# - the record's loss is taken to keep LOGIT_BYTES per logit for backward (the (T, V) bf16 logits),
#   twice that while its backward runs (kept and gradient);
# - validation (no backward) holds per_token_kept tensors of a val_seq_len slice, one of its
#   EVAL_LOSS_CHUNKS loss chunks' logits in the model dtype and in fp32, and one MLP hidden layer.
# A run's peak is its state plus the larger of training's and validation's.
PEAK_SCALED_FIELDS = ("batch_slices", "train_seq_len", "val_seq_len", "batch_schedule")  # the micro-batch
LOGIT_BYTES = 2
EVAL_LOSS_CHUNKS = 4  # GPT.forward evaluates its loss in 4 chunks
SLICE_SPLITS = (1, 2, 4, 8)  # micro_batch_settings: the step's slices split into k times as many


def largest_slice(config: Hyperparameters) -> int:
    """Tokens of the step grid's longest slice: the micro-batch at the full batch."""
    return max(config.batch_schedule or (config.batch_slices * config.train_seq_len,)) // config.batch_slices


def per_token_kept(config: Hyperparameters) -> int:
    """(T, d) tensors that outlive a block in the forward (what checkpointed blocks keep, and what
    validation holds): each block's output, each skip's sum, the input embeddings and their norms, the
    value embeddings, the bigram rows."""
    return (config.num_layers + len(config.skip_connections) + 2 * (1 + config.num_extra_embeds)
            + config.num_value_embeds + config.bigram_embed)


def _meta_model(config: Hyperparameters) -> GPT:
    with torch.device("meta"):
        return GPT(config, torch.bfloat16)


def kept_per_configuration(fn):
    """fn(config, *args), computed once per process for each configuration (the value of every field)
    and args: the dry run's table of what fits builds a meta model for each recipe's micro-batch
    settings (~40, half its time), and a process that dry-runs again asks for the same ones."""
    kept = {}

    @functools.wraps(fn)
    def kept_fn(config: Hyperparameters, *args):
        key = (tuple(getattr(config, f.name) for f in fields(config)), *args)
        if key not in kept:
            kept[key] = fn(config, *args)
        return kept[key]
    return kept_fn


@kept_per_configuration
def state_per_gpu(config: Hyperparameters, world_size: int) -> int:
    """The bytes one process holds besides activations (state_bytes_per_gpu of config's meta model)."""
    return sum(state_bytes_per_gpu(_meta_model(config), config, world_size).values())


@functools.lru_cache(maxsize=1)
def record_anchor() -> tuple[int, int]:
    """(what the record held per GPU on its 8 GPUs, its activations: the logged peak less that), bytes.
    This trainer holds what the record held (Adam's moments sharded over the GPUs, Muon's by matrix)."""
    base = make_config(recipe="bulk")
    state = state_per_gpu(base, PEAK_WORLD_SIZE)
    return state, RECIPES["bulk"].peak_mib * 2**20 - state


def peak_parts(config: Hyperparameters, world_size: int = PEAK_WORLD_SIZE) -> Optional[dict[str, int]]:
    """The predicted peak's parts in bytes per GPU of a run on `world_size` GPUs: state (what a rank
    holds, state_bytes_per_gpu), training (one micro-step's activations), evaluation (a validation
    slice's); None for a configuration whose shapes or execution differ from the record's in more than
    its micro-batch (PEAK_SCALED_FIELDS, --activation_checkpointing) and peak_neutral fields, or a world
    size that does not divide its slices."""
    base = make_config(recipe="bulk")
    differs = [f.name for f in fields(config) if f.metadata["group"] in TRAINING_GROUPS
               and not f.metadata["peak_neutral"] and f.name not in PEAK_SCALED_FIELDS
               and getattr(config, f.name) != getattr(base, f.name)]
    if (differs or config.compile is False or config.attention == "sdpa" or config.dtype == "float32"
            or config.batch_slices % world_size):
        return None
    _, record_activations = record_anchor()
    T, T_record = largest_slice(config), largest_slice(base)
    d, V = config.model_dim, config.padded_vocab_size
    mudd_kept = lambda cfg: cfg.mudd * MUDD_KEPT_ACTIVATIONS[cfg.mudd_nets]
    kept = (config.backout - base.backout) * BACKOUT_KEPT_ACTIVATIONS + mudd_kept(config) - mudd_kept(base)
    kept += bool(config.bigram_embed and config.bigram_sign_rows)  # §14 --bigram_sign_rows: the gathered signs
    extra = kept * T * d * 2 + (config.fp8 - base.fp8) * (T + V) * d  # the fp8 codes: input and weight
    extra += len(config.xsa_layers) * XSA_KEPT_PER_HEAD * T * config.num_heads * 2  # §12 --xsa_layers
    extra += gate_net_kept_bytes(config, T)  # §18 --mudd_gate, --dc_layers
    if config.activation_checkpointing:
        record_loss = T_record * V * LOGIT_BYTES
        one_block = (record_activations - record_loss) / config.num_layers * T / T_record
        loss_tokens = T if config.fused_softcap_ce else min(T, LOSS_CHUNK_TOKENS)  # the fused loss is not chunked
        training = per_token_kept(config) * T * d * 2 + one_block + 2 * LOGIT_BYTES * loss_tokens * V + extra
    else:
        training = record_activations * T / T_record + extra
    T_val = config.val_seq_len
    evaluation = (per_token_kept(config) * T_val * d * 2 + T_val // EVAL_LOSS_CHUNKS * V * (2 + 4)
                  + T_val * config.mlp_ratio * d * 2)
    return dict(state=state_per_gpu(config, world_size), training=round(training),
                evaluation=evaluation)


def predicted_peak_mib(config: Hyperparameters, world_size: int = PEAK_WORLD_SIZE) -> Optional[int]:
    """Peak allocated MiB per GPU of a run of this trainer on `world_size` GPUs, from the record's logged
    8-GPU peak (peak_parts), or None where peak_parts gives none. At the record's micro-batch on 8 GPUs
    it moves the logged peak by what this configuration holds more per GPU (state_bytes_per_gpu, Adam's
    moments sharded as the record's), by the activations the backout and MUDD keep and by --fp8's codes."""
    parts = peak_parts(config, world_size)
    if parts is None:
        return None
    logged = RECIPES["bulk"].peak_mib
    peak = parts["state"] + max(parts["training"], parts["evaluation"])
    return logged + round((peak - logged * 2**20) / 2**20)


def micro_batch_settings(config: Hyperparameters) -> list[dict]:
    """config's micro-batch settings, nearest first: its slices as they are, then split into k = 2, 4, 8
    times as many of 1/k the tokens (the same tokens per step; validation's slices shortened alike, so
    that val_tokens still divides), each without, then with activation checkpointing; those the config
    check accepts. Checkpointing trains as config does; shorter slices change training (their documents
    are cut and batched otherwise, and each slice's loss weighs 1/k as much)."""
    settings = []
    for k in SLICE_SPLITS:
        if config.train_seq_len % k or config.val_seq_len % k:
            continue
        slices = dict(batch_slices=config.batch_slices * k, train_seq_len=config.train_seq_len // k,
                      val_seq_len=config.val_seq_len // k)
        try:
            check_config(dataclasses.replace(config, **slices))
        except ConfigError:
            continue
        settings += [dict(slices, activation_checkpointing=False), dict(slices, activation_checkpointing=True)]
    return settings


RECORD_GPU_MEMORY_GIB = 80  # the dry run's default: the record's H100 80 GB


def dry_run_world_size(config: Hyperparameters, environ=os.environ) -> int:
    """The dry run's GPU count: --gpu_count, else WORLD_SIZE where torchrun started it, else the record's 8."""
    return config.gpu_count or int(environ.get("WORLD_SIZE", PEAK_WORLD_SIZE))


class Collective(NamedTuple):
    """One collective call as a rank sees it: its kind, the parameter group it moves, the bytes of the
    whole tensor it is about (the payload) and the bytes this rank sends for it."""
    kind: str
    group: str
    payload: int
    sent: int


class _Done:
    """What a counted collective returns in place of torch.distributed's work handle."""

    def wait(self):
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedCollectives(Collectives):
    """The run's Collectives, counted: while `ledger` is a list, each call is appended to it
    (Collective) before it runs (the bench); with `counting`, no process group and nothing moves
    (the dry run's one rank of many, on meta tensors), and an all-to-all's out receives what this
    rank sends, as if every rank sent as many as it (its counts are read on the host). Bytes sent
    per rank are the ring algorithm's: an all-reduce of N bytes sends 2 (W-1)/W N, a reduce-scatter
    or an all-gather (W-1)/W N, an all-to-all what it sends to the other ranks."""

    def __init__(self, world_size: int, rank: int = 0, counting: bool = False):
        super().__init__(world_size, rank)
        self.counting, self.ledger = counting, None

    def _record(self, kind: str, group: str, payload: int, sent: float) -> None:
        if self.ledger is not None:
            self.ledger.append(Collective(kind, group, payload, round(sent)))

    def all_reduce(self, t: torch.Tensor, group: str):
        W = self.world_size
        self._record("all_reduce", group, _nbytes(t), 2 * (W - 1) / W * _nbytes(t))
        return _Done() if self.counting else super().all_reduce(t, group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: str):
        W = self.world_size
        self._record("reduce_scatter", group, _nbytes(inp), (W - 1) / W * _nbytes(inp))
        return _Done() if self.counting else super().reduce_scatter(out, inp, group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str):
        W = self.world_size
        self._record("all_gather", group, _nbytes(out), (W - 1) / W * _nbytes(out))
        return _Done() if self.counting else super().all_gather(out, inp, group)

    def all_gather_list(self, outs: list[torch.Tensor], inp: torch.Tensor, group: str):
        W = self.world_size
        self._record("all_gather", group, W * _nbytes(inp), (W - 1) * _nbytes(inp))
        return _Done() if self.counting else super().all_gather_list(outs, inp, group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: str):
        row = _nbytes(inp[0]) if inp.numel() else inp.element_size() * math.prod(inp.shape[1:])
        self._record("all_to_all", group, row * sum(in_splits), row * (sum(in_splits) - in_splits[self.rank]))
        if not self.counting:
            return super().all_to_all(out, inp, out_splits, in_splits, group)
        out.copy_(inp)  # as many come back as go
        return _Done()


def step_collectives(config: Hyperparameters, world_size: int, odd: bool, rank: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> list[Collective]:
    """One rank's collectives of one training step of `config` on world_size ranks (after the split,
    at the full batch), run by the trainer's own exchange and optimizer code on meta tensors with a
    counting Collectives (nothing moves, no process group): every parameter's gradient handed to the
    exchange as the backward would hand it (the last parameters first), the bigram rows of uniformly
    random tokens (real text touches fewer rows), then the optimizers' steps. odd: an odd step (with
    --adam_odd_steps_only the one where Adam steps). dtype: the weights' (the run's device's)."""
    with torch.device("meta"):
        model = GPT(config, dtype)
        counted = CountedCollectives(world_size, rank, counting=True)
        adam, muon = build_optimizers(model, config, rank, world_size, collectives=counted)
        sparse = model.bigram.table if bigram_exchange_is_sparse(config, world_size) else None
        exchange = GradientExchange(adam.param_groups, muon.param_groups, rank, world_size, counted, sparse, hooks=False)
        adam.exchange = muon.exchange = exchange
        adam_steps = odd or not config.adam_odd_steps_only
        if not adam_steps:
            exchange.held = frozenset(p for g in adam.param_groups for p in g["params"])
        gen = torch.Generator().manual_seed(0)
        for _ in range((1 if adam_steps and not config.adam_odd_steps_only else 2) * (config.batch_slices // world_size)):
            exchange.touch(torch.randint(0, config.vocab_size, (config.train_seq_len,), generator=gen, device="cpu"))
        counted.ledger, exchange.armed = [], True
        for p in reversed(list(model.parameters())):
            p.grad = torch.empty_like(p)
            exchange.arrive(p)
        exchange.wait()
        muon.step()
        if adam_steps:
            adam.step()
    return counted.ledger


def ledger_summary(ledger: list[Collective]) -> dict:
    """A step's collectives in numbers (the bench's JSON): calls, payload and bytes sent per rank, in
    all and per parameter group (with its calls by kind)."""
    def totals(calls):
        return dict(calls=len(calls), payload_bytes=sum(c.payload for c in calls), sent_bytes=sum(c.sent for c in calls))
    groups = {g: dict(kinds=dict(collections.Counter(c.kind for c in ledger if c.group == g)),
                      **totals([c for c in ledger if c.group == g])) for g in dict.fromkeys(c.group for c in ledger)}
    return dict(**totals(ledger), groups=groups)


def collective_lines(summary: dict, what: str) -> list[str]:
    """ledger_summary as lines: the totals, then per parameter group its calls by kind, payload and
    bytes sent (the ring algorithm's)."""
    size = lambda b: f"{b / 2**20:,.1f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB" if b >= 2**10 else f"{b} B"
    lines = [f"{what}: {summary['calls']} calls, payload {size(summary['payload_bytes'])}, sent "
             f"{size(summary['sent_bytes'])} per rank"]
    for group, g in summary["groups"].items():
        lines.append(f"  {group}: " + ", ".join(f"{k} x{n}" for k, n in g["kinds"].items())
                     + f"; payload {size(g['payload_bytes'])}, sent {size(g['sent_bytes'])}")
    return lines


@kept_per_configuration
def dry_run_collective_lines(config: Hyperparameters, world_size: int, dtype: torch.dtype) -> tuple[str, ...]:
    """The collectives of an even and an odd step on world_size ranks (step_collectives), or why none."""
    if world_size == 1:
        return ("collectives: none on one process (--gpu_count=1)",)
    if config.batch_slices % world_size:
        return (f"collectives: none ({world_size} ranks do not divide the {config.batch_slices} slices)",)
    head = f"collectives per rank on {world_size} ranks (from the exchange's own code on meta tensors), "
    sparse = " (the bigram rows: uniformly random tokens)" if bigram_exchange_is_sparse(config, world_size) else ""
    even = "even step" + (" (Adam holds its gradients)" if config.adam_odd_steps_only else "")
    count = lambda odd: ledger_summary(step_collectives(config, world_size, odd, dtype=dtype))
    return (*collective_lines(count(False), head + even + sparse),
            *collective_lines(count(True), head + "odd step (Adam steps)" + sparse))


def fit_lines(config: Hyperparameters, world_size: int, memory_gib: float) -> list[str]:
    """The dry run's table of what fits: this configuration's predicted peak per GPU against memory_gib,
    then (at the medium preset) for every recipe each micro-batch setting's, with "fits" or "does not fit"."""
    memory = int(memory_gib * 2**30)
    word = lambda mib: "fits" if mib * 2**20 <= memory else "does not fit"
    gpus = f"{world_size} GPU{'s' * (world_size > 1)}"
    lines = [f"what fits on {gpus} of {memory_gib:g} GiB ({memory // 2**20:,} MiB) each (--gpu_count, "
             f"--gpu_memory_gib; auto: the record's {PEAK_WORLD_SIZE} GPUs of {RECORD_GPU_MEMORY_GIB} GiB): the "
             "predicted peak allocated per GPU, an estimate from the record's logged peak (docs/scale.md)"]
    own = predicted_peak_mib(config, world_size)
    if own is None:
        why = (f"{world_size} does not divide --batch_slices={config.batch_slices}"
               if config.batch_slices % world_size else "only the record's shapes and execution are predicted")
        lines.append(f"  this configuration: no prediction ({why})")
    else:
        lines.append(f"  this configuration: {own:,} MiB, {word(own)}")
        found = nearest_fit(config, world_size, memory) if own * 2**20 > memory else None
        if found:
            lines.append(f"  this configuration's nearest that fits: {flag_text(found[0], config)} ({found[1]:,} MiB)")
    if config.preset != "medium":
        return lines
    for name in [*RECIPES, *CANDIDATES]:
        recipe_config = make_config(recipe=name)
        if recipe_config.batch_slices % world_size:
            lines.append(f"  {name:<9} {gpus} do not divide its {recipe_config.batch_slices} slices")
            continue
        for changes in micro_batch_settings(recipe_config):
            peak = predicted_peak_mib(dataclasses.replace(recipe_config, **changes), world_size)
            setting = flag_text(changes, recipe_config) or (
                f"its own micro-batch ({recipe_config.batch_slices} slices of {recipe_config.train_seq_len:,} tokens)")
            if changes["batch_slices"] != recipe_config.batch_slices:
                setting += " (changes training)"
            lines.append(f"  {name:<9} {'-' if peak is None else f'{peak:,}':>7} MiB  "
                         f"{'-' if peak is None else word(peak):<12}  {setting}")
    return lines


def memory_lines(model: GPT, config: Hyperparameters, world_size: int = PEAK_WORLD_SIZE) -> list[str]:
    """Per GPU of a run on world_size GPUs (the dry run's --gpu_count): what each process holds, and the
    predicted peak, next to the logged peak of the recipe's record (its 8 GPUs) where the
    configuration is the record's shapes."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    W = world_size
    held = state_bytes_per_gpu(model, config, W)
    lines = [f"per GPU of {W}: " + ", ".join(f"{k} {mib(v)}" for k, v in held.items())
             + " (muon: the rank owning the most; adam: a rank's rows of the sharded tensors, the small ones whole)"]
    predicted, where = predicted_peak_mib(config, W), f"per GPU on {W} GPU{'s' * (W > 1)}"
    if config.recipe in CANDIDATES:  # nothing logged to compare with
        lines.append(f"predicted peak memory allocated: {'none' if predicted is None else f'{predicted:,} MiB'} {where} "
                     f"(recipe {config.recipe} is {CANDIDATE_NOTE}; the prediction starts from bulk's "
                     f"{RECIPES['bulk'].peak_mib:,} MiB)")
        return lines
    logged = RECIPES[config.recipe].peak_mib
    if predicted is None:
        lines.append("predicted peak memory: none (only configurations with the record's shapes and execution are "
                     f"predicted; recipe {config.recipe}'s record logged {logged:,} MiB on 8 GPUs)")
    else:
        # the prediction always starts from bulk's log; another recipe's own logged peak is for comparison
        start = "" if config.recipe == "bulk" else f"; the prediction starts from bulk's {RECIPES['bulk'].peak_mib:,} MiB"
        lines.append(f"predicted peak memory allocated: {predicted:,} MiB {where}; the {RECIPES[config.recipe].folder} "
                     f"record logged {logged:,} MiB on 8 GPUs{start} (plus the state and kept activations this "
                     "configuration adds; Adam's moments sharded over the GPUs as the record's)")
    return lines


def accounting_lines(model: GPT, config: Hyperparameters) -> list[str]:
    """Parameters, their MiB in storage dtype, and optimizer-state MiB, per group and in total,
    and the optimizer state by kind."""
    counts, flops = parameter_counts(model), flops_per_token(config, model)
    mib = lambda b: b / 2**20
    lines, total_param_b, total_state_b, kinds = [], 0, 0, {}
    for name, params in parameter_groups(model).items():
        param_b = sum(p.numel() * p.element_size() for p in params)
        state_b = 0
        for p in params:
            for kind, nbytes in optimizer_state_parts(name, p, config).items():
                kinds[kind] = kinds.get(kind, 0) + nbytes
                state_b += nbytes
        total_param_b, total_state_b = total_param_b + param_b, total_state_b + state_b
        dtypes = ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        lines.append(f"params {name}: {counts[name]:,} ({dtypes}) {mib(param_b):.1f} MiB, optimizer state {mib(state_b):.1f} MiB")
    lines.append(f"params total: {counts['total']:,} {mib(total_param_b):.1f} MiB, optimizer state {mib(total_state_b):.1f} MiB")
    if "in_use_before_split" in counts:
        lines.append(f"params in use before the split (step {untie_step(config)}; the input table is "
                     f"unread until then): {counts['in_use_before_split']:,}")
    if model.config.scalar_pad_multiple > 1:
        pads = dict(model.scalar_layout).get("pad", [])
        lines.append(f"scalars: {model.scalars.numel()} ({len(pads)} of them padding to a multiple of "
                     f"{model.config.scalar_pad_multiple}, unused)")
    lines.append("optimizer state by kind: " + ", ".join(f"{k} {mib(b):.1f} MiB" for k, b in kinds.items()))
    lines.append(f"flops_per_token: {flops['total']:.4e} (weights {flops['weights']:.4e}, attention {flops['attention']:.4e})")
    lines.append("flops_per_token by window (long/short blocks): "
                 + ", ".join(f"{w} {f:.4e}" for w, f in flops_by_window(config, model).items()))
    return lines


def optimizer_table_lines(model: GPT, config: Hyperparameters) -> list[str]:
    """The resolved optimizer table, one line per group, from what each parameter declared (to hold
    against a PR's table): optimizer, lr (its field's value), each (lr_mul, wd_mul) with its parameter
    count, betas (a parameter's own where it declared them), weight decay."""
    adam, muon = optimizer_groups(model, config)
    lines = ["optimizer groups (each tensor's lr is the group's x its lr_mul, its decay the group's x its wd_mul):"]
    for optimizer, groups in (("adam", adam), ("muon", muon)):
        for g in groups:
            ps = g["params"]
            muls = collections.Counter((p.lr_mul, p.wd_mul) for p in ps)
            mul_text = "; ".join(f"{n} tensor{'s' * (n > 1)} at lr_mul {lr:g}, wd_mul {wd:g}"
                                 for (lr, wd), n in muls.items())
            if optimizer == "adam":
                own = sorted({tuple(getattr(p, "betas", g["betas"])) for p in ps})
                betas = "; ".join(f"{a:g}/{b:g}" for a, b in own)
                head = (f"lr {adam_lr_field(g['name'], ps)}={g['lr']:g}, betas {betas}, eps {config.adam_eps:g}, "
                        f"cautious decay {config.adam_weight_decay:g} x lr^2")
            else:
                options = "".join(f", {k}={v}" for k, v in g.items() if k not in ("params", "name"))
                head = (f"lr muon_lr={config.muon_lr:g}, momentum {config.muon_momentum:g}, decay "
                        f"{config.muon_weight_decay:g}{options}")
            lines.append(f"  {g['name']}: {optimizer}, {head}; {sum(p.numel() for p in ps):,} params: {mul_text}")
    return lines


def learned_scalars_lines(model: GPT) -> list[str]:
    """The learned mixing weights per layer (which layers use which embedding), the attention
    lambdas and the skip weights (--gated_skips: the gain into each target; off: per source layer)."""
    L, cfg = model.config.num_layers, model.config
    slots = {name: t.detach().float().cpu() for name, t in model.scalar_slots().items()}
    resid, x0_weights = model.mixing_weights()
    resid = resid.detach().float().cpu()
    x0_weights = torch.zeros(L, 0) if x0_weights is None else x0_weights.detach().float().cpu()  # §18: per token
    attn_lambdas = slots["attn_lambdas"].view(L, 2)
    names = ["x"] + [f"x0{e}" for e in range(x0_weights.size(1))]
    attn_names = ("attn_qkv", "attn_out")
    gains = {target: slots["skip_gain"][j].item() for target, j in model.skip_index.items()} if cfg.gated_skips else {}
    lines = []
    for i in range(L):
        mix = " ".join(f"{n}:{v:.4f}" for n, v in zip(names, [resid[i].item()] + x0_weights[i].tolist()))
        a0, a1 = attn_lambdas[i].tolist()
        skip = (f" skip_gain:{gains[i]:.4f}" if i in gains else "") if cfg.gated_skips else \
            f" skip_w:{slots['skip_w'][i].item():.4f}"
        lines.append(f"lambdas layer {i}: {mix} {attn_names[0]}:{a0:.4f} {attn_names[1]}:{a1:.4f}{skip}")
    if "smear" in slots:
        lines.append(f"lambdas smear: {slots['smear'][0].item():.4f}")
    if model.output_mix is not None:
        lines.append("lambdas output: x:{:.4f} x00:{:.4f}".format(*model.output_mix.detach().float().tolist()))
    if model.backout is not None:
        lines.append(f"backout from layer {model.backout.layer}: lambda:{model.backout.weight.item():.4f}")
    if model.bigram is not None and model.bigram.lambdas is not None:  # --bigram_embed: gamma of layers 0, 1, ...
        lines.append("lambdas bigram: " + " ".join(f"{v:.4f}" for v in model.bigram.lambdas.detach().float().tolist()))
    return lines


def planned_device(config: Hyperparameters) -> tuple[str, str]:
    """The device type a run of `config` would use on this machine, and why. Asks only
    torch.cuda.is_available() (no CUDA state); the medium preset is planned for CUDA even without a
    GPU here, since a real run refuses to start on the CPU."""
    if config.device != "auto":
        return config.device, f"--device={config.device}"
    if torch.cuda.is_available():
        return "cuda", "--device=auto and a CUDA GPU is visible"
    if config.preset == "medium":
        return "cuda", "the medium preset runs on CUDA GPUs; none is visible here, so a run would not start"
    return "cpu", "--device=auto and no CUDA GPU is visible"


# what a run writes or does besides training, none of which a dry run does
DRY_RUN_IGNORES = ("metrics_jsonl", "tracker", "eval_hellaswag", "hellaswag_file", "save_every", "keep_checkpoints",
                   "resume", "force_resume", "run_id", "log_dir", "checkpoint_dir")


def dry_run_notes(config: Hyperparameters) -> list[str]:
    """A note for each flag of DRY_RUN_IGNORES set away from its default: a dry run writes no log,
    metrics, checkpoint or evaluation, so the flag does nothing here."""
    defaults = Hyperparameters()
    set_here = [f"--{name}={to_text(getattr(config, name))}" for name in DRY_RUN_IGNORES
                if hasattr(config, name) and getattr(config, name) != getattr(defaults, name)]
    return [f"note: {flag} is ignored: a dry run writes no log, metrics or checkpoint and evaluates nothing"
            for flag in set_here]


def dry_run(config: Hyperparameters) -> int:
    """Config, parameter counts, bytes and FLOPs from a meta-device model: no data, no GPU. Bytes
    are those of the device the run would use (bf16 on CUDA, fp32 on the CPU with --dtype=auto),
    with the other device's totals on one line when its storage differs."""
    device, why = planned_device(config)
    other = "cpu" if device == "cuda" else "cuda"

    def meta_model(device_type: str) -> GPT:
        with torch.device("meta"):
            return GPT(config, weight_dtype(config, device_type))

    model = meta_model(device)
    print("\n".join(f"{f.name} = {getattr(config, f.name)!r}" for f in fields(config)))
    print(recipe_summary(config))
    print(f"dry run on {device} ({why}): {str(model.dtype).removeprefix('torch.')} weights")
    try:  # what the real run checks before it builds anything (fa3: CUDA, token windows, `kernels`)
        check_run_request(config, torch.device(device))
    except ConfigError as e:
        print(f"note: a real run on {device} would stop before training: {e}")
    for note in recipe_notes(config) + dry_run_notes(config):
        print(note)
    print("\n".join(accounting_lines(model, config)))
    print("\n".join(optimizer_table_lines(model, config)))
    print("\n".join(memory_lines(model, config, dry_run_world_size(config))))
    print("\n".join(fit_lines(config, dry_run_world_size(config), config.gpu_memory_gib or RECORD_GPU_MEMORY_GIB)))
    print("\n".join(dry_run_collective_lines(config, dry_run_world_size(config), model.dtype)))
    if weight_dtype(config, other) != model.dtype:
        other_model = meta_model(other)
        total = next(line for line in accounting_lines(other_model, config) if line.startswith("params total:"))
        print(f"on {other} instead ({str(other_model.dtype).removeprefix('torch.')} weights): {total}")
    counts, flops = parameter_counts(model), flops_per_token(config, model)
    extra = {}
    if untie_step(config):
        extra["params_in_use_before_split"] = counts.pop("in_use_before_split")
    extra["flops_per_token_by_window"] = flops_by_window(config, model)
    print(json.dumps(dict(total_params=counts["total"], params_by_group={k: v for k, v in counts.items() if k != "total"},
                          flops_per_token=flops["total"], flops_per_token_weights=flops["weights"],
                          flops_per_token_attention=flops["attention"], **extra)))
    return 0

# ---- benchmark (--bench_steps): training steps timed on random tokens; no data, no log

# Dense (not "with sparsity") bf16 tensor-core peak of one GPU in TFLOP/s, by a substring of
# the GPU's name (gpu_properties); the first match wins. Source: NVIDIA's datasheets: H100 SXM
# 989.4 and H100 PCIe 756 (H100 Tensor Core GPU datasheet), H200 989.4 (H200 datasheet, SXM),
# A100 312 (A100 datasheet). NVL boards run at other clocks and have no entry here.
PEAK_BF16_TFLOPS = (
    ("NVL", None),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # the SXM board reports itself as "NVIDIA H100 80GB HBM3"
    ("H200", 989.4),
    ("A100", 312.0),
)


def peak_bf16_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name, or None for one not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def compile_counts() -> dict[str, Optional[int]]:
    """Graphs torch.compile made so far in this process, and how many compilations were
    recompiles (a function compiled again because a guard failed: a new shape, grad mode, ...)."""
    from torch._dynamo import utils as dynamo_utils
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]  # a Counter: 0 before any compile
    metrics = getattr(dynamo_utils, "get_compilation_metrics", None)  # the last 64 compilations
    recompiles = sum(1 for m in metrics() if getattr(m, "recompile_reason", None)) if metrics else None
    return dict(graphs=graphs, recompiles=recompiles)


def compiled_since(before: dict, suffix: str = "") -> dict[str, Optional[int]]:
    """Graphs and recompiles since `before` (an earlier compile_counts()), keys ending in `suffix`."""
    now = compile_counts()
    return {k + suffix: None if now[k] is None or before[k] is None else now[k] - before[k] for k in now}


def grid_phase(step: int, config: Hyperparameters) -> tuple:
    """What the compiled training graph of `step` depends on: its slice length, its windows, its
    number of multi-token weights and whether the embedding is still tied. Two steps of one phase
    run the same graphs."""
    split = untie_step(config)
    return (slice_tokens(step, config), attention_windows(step, config),
            len(multi_token_weights(step, config)) if config.multi_token_prediction else 0, 0 < split and step <= split)


def point_steps(step: int, config: Hyperparameters) -> list[int]:
    """The steps a benchmark point runs: `step` and a neighbour of the other parity in its phase
    (step + 1, else step - 1), so that both kinds of step a run alternates are timed (with
    --adam_odd_steps_only an even step holds Adam's gradients and an odd one steps Adam). [step]
    alone where no neighbour shares its phase."""
    phase = grid_phase(step, config)
    for other in (step + 1, step - 1):
        if 0 <= other < config.num_iterations and grid_phase(other, config) == phase:
            return [step, other]
    return [step]


def time_steps(runner: Runner, step: int, gen: torch.Generator, clock: Stopwatch,
               ledgers: dict[str, list]) -> tuple[list[int], list[float], list]:
    """One untimed step at each of the point's steps (point_steps: their windows and lr), then
    bench_steps timed ones alternating between them, each between device synchronizations (and
    barriers). Returns the timed steps' numbers and milliseconds, and every step's loss (unsynced
    device tensors, the untimed ones first). ledgers: each step's collectives (the runner's
    CountedCollectives, on more than one rank), kept by parity."""
    steps = point_steps(step, runner.config)
    sequence = [steps[i % len(steps)] for i in range(len(steps) + runner.config.bench_steps)]
    timed, times, losses = [], [], []
    for i, s in enumerate(sequence):
        batches, host_inputs = runner.random_step(gen, slice_tokens(s, runner.config))
        if runner.collectives is not None:  # this step's collectives, kept by parity
            runner.collectives.ledger = ledgers["odd" if s % 2 else "even"] = []
        clock.start()
        losses.append(runner.train_step(s, batches, host_inputs=host_inputs))
        elapsed = clock.stop()
        if i >= len(steps):
            timed.append(s)
            times.append(elapsed)
    if runner.collectives is not None:
        runner.collectives.ledger = None
    return timed, times, losses


def bench_points(config: Hyperparameters) -> list[int]:
    """The steps --bench_steps times: --bench_at_step, or the first and the last step of the
    schedule and, with a batch_schedule, the first step of each batch size (every phase's shape)."""
    if config.bench_at_step is not None:
        return [config.bench_at_step]
    N = config.num_iterations
    points = {0, N - 1}
    if config.batch_schedule:
        points |= {s for s in range(1, N) if batch_tokens(s, config) != batch_tokens(s - 1, config)}
    return sorted(points)


def bench(config: Hyperparameters, device: torch.device, rank: int = 0, world_size: int = 1) -> int:
    """--bench_steps=N: build and compile exactly as a run, warm up, then time N training steps on
    random tokens at each of bench_points (the first and the last step of the schedule, each batch
    size's first step with a batch ramp, or --bench_at_step), and run
    one evaluation step so that the compiled graphs and the peak memory cover what a run needs.
    Rank 0 prints a line per point and ends with one JSON line; a step's time is the slowest rank's.
    No data files are read and nothing is written."""
    cfg = dataclasses.replace(config, val_tokens=config.batch_slices * config.val_seq_len)  # one evaluation step
    start = compile_counts()  # the process may have compiled before (tests call main in-process)
    counted = CountedCollectives(world_size, rank) if world_size > 1 else None
    runner, ledgers = Runner(cfg, device, rank, world_size, collectives=counted), {}
    points = bench_points(cfg)
    # --bench_at_step: the warm-up compiles that point's phase only (its steps), not the whole grid
    warmup_steps = runner.warmup(point_steps(points[0], cfg) if cfg.bench_at_step is not None else None)
    warmup = dict(steps=len(warmup_steps), **compiled_since(start))
    gen, clock = torch.Generator().manual_seed(cfg.init_seed), Stopwatch(device, world_size)
    results = []
    for step in points:
        before = compile_counts()
        timed, times, losses = time_steps(runner, step, gen, clock, ledgers)
        results.append(dict(step=step, window_blocks=attention_windows(step, cfg)[0],
                            tokens_per_step=batch_tokens(step, cfg), timed_steps=timed, times_ms=times,
                            losses=losses, **compiled_since(before, "_added")))
    before = compile_counts()
    runner.evaluate(points[-1], torch.randint(0, cfg.vocab_size, (cfg.val_tokens + 1,), generator=gen))
    evaluation = dict(tokens=cfg.val_tokens, **compiled_since(before, "_added"))
    # every rank's numbers -> the slowest step times, the mean losses, the largest memory peaks
    times = torch.tensor([r["times_ms"] for r in results], dtype=torch.float64, device=device)
    # the losses are summed over ranks in their own dtype (fp32), as one process sums its micro-batches'
    # halves: on 2 ranks (l0 + l1) / 2 rounds exactly as l0/2 + l1/2 does, so the report is the same
    losses = torch.stack([torch.stack(r["losses"]) for r in results])
    memory = torch.tensor(peak_memory_mib(device), dtype=torch.float64, device=device)
    if world_size > 1:
        for tensor, op in ((times, dist.ReduceOp.MAX), (losses, dist.ReduceOp.SUM), (memory, dist.ReduceOp.MAX)):
            dist.all_reduce(tensor, op=op)
        losses /= world_size
    losses = losses.double()
    for result, step_times, step_losses in zip(results, times.tolist(), losses.tolist()):
        result.update(times_ms=step_times, losses=step_losses)
    if rank == 0:
        report = bench_report(runner, results, memory.tolist(), dict(warmup=warmup, evaluation=evaluation,
                                                                      **compiled_since(start)), ledgers)
        print("\n".join(bench_lines(report)), flush=True)
        print(json.dumps(report), flush=True)
    if world_size > 1:
        dist.barrier()  # leave together: a rank tearing gloo down while another still runs can abort
    bad = [(r["step"], loss) for r in results for loss in r["losses"] if not math.isfinite(loss)]
    if bad:
        raise NonFiniteLossError(f"--bench_steps: non-finite training loss ({bad[0][1]}) at step {bad[0][0]}")
    return 0


def bench_report(runner: Runner, results: list[dict], memory_mib: list[float], compiled_counts: dict,
                 ledgers: dict[str, list]) -> dict:
    """The benchmark's numbers: per point the step times and losses of every rank reduced, and what
    follows from them (tokens/s, TFLOP/s, MFU); the device, memory peaks and compiled graphs; this
    rank's collectives of its last timed step of each parity (ledgers)."""
    cfg, device, world_size = runner.config, runner.device, runner.world_size
    gpu = gpu_properties(device) if device.type == "cuda" else None
    name = gpu.name if gpu else platform.processor() or platform.machine()
    peak = peak_bf16_tflops(name) if device.type == "cuda" else None
    flops, step_tokens = flops_per_token(cfg, runner.model)["total"], cfg.batch_slices * cfg.train_seq_len
    for result in results:
        # the typical step of a run: the mean over the point's steps (both parities) of each one's median
        by_step = {s: statistics.median(t for t, ts in zip(result["times_ms"], result["timed_steps"]) if ts == s)
                   for s in dict.fromkeys(result["timed_steps"])}
        median = statistics.fmean(by_step.values())
        result.update(median_ms_by_step={str(s): ms for s, ms in by_step.items()})
        per_process = result["tokens_per_step"] / world_size / (median / 1000)
        tflops = flops * per_process / 1e12
        result.update(median_ms=median, min_ms=min(result["times_ms"]), tokens_per_s_per_process=per_process,
                      tokens_per_s=per_process * world_size, tflops_per_process=tflops, tflops=tflops * world_size,
                      mfu=tflops / peak if peak else None)
    return dict(
        collectives={parity: ledger_summary(ledger) for parity, ledger in sorted(ledgers.items())},
        bench_steps=cfg.bench_steps, world_size=world_size, device=device.type, device_name=name,
        compile=compile_enabled(cfg, device), attention=attention_backend(cfg, device.type),
        dtype=str(runner.model.dtype).removeprefix("torch."), tokens_per_step=step_tokens, flops_per_token=flops,
        peak_tflops_per_device=peak, points=results, **compiled_counts,
        peak_memory_allocated_mib=int(memory_mib[0]), peak_memory_reserved_mib=int(memory_mib[1]),
        device_memory_mib=gpu.total_memory // 2**20 if gpu else None,
        **dict(zip(("allocator_settings", "allocator_settings_source"),
                   allocator_settings() if device.type == "cuda" else (None, "no CUDA allocator on the CPU"))))


def bench_lines(report: dict) -> list[str]:
    """The human-readable part of the benchmark's output."""
    r = report
    lines = [f"bench: {r['world_size']} process(es) on {r['device']} ({r['device_name']}), compile "
             f"{'on' if r['compile'] else 'off'}, attention {r['attention']}, {r['dtype']} weights; "
             f"{r['tokens_per_step']:,} tokens per step; {r['flops_per_token'] / 1e9:.4g} GFLOP per token "
             f"(--dry_run's flops_per_token)"]
    for p in r["points"]:
        mfu = f", MFU {100 * p['mfu']:.1f}% of {r['peak_tflops_per_device']} TFLOP/s" if p["mfu"] is not None else ""
        steps = " and ".join(dict.fromkeys(map(str, p["timed_steps"])))
        lines.append(f"step {p['step']} (long window {p['window_blocks']} blocks, {p['tokens_per_step']:,} tokens): "
                     f"{len(p['times_ms'])} timed steps (steps {steps}"
                     f"{', alternating' if ' and ' in steps else ''}), "
                     f"median {p['median_ms']:.2f} ms, min {p['min_ms']:.2f} ms; tokens/s {p['tokens_per_s_per_process']:,.0f} "
                     f"per process, {p['tokens_per_s']:,.0f} in all; {p['tflops_per_process']:.4g} TFLOP/s per process{mfu}; "
                     f"compiled graphs added {p['graphs_added']}, recompiles {p['recompiles_added']}")
    e = r["evaluation"]
    lines.append(f"evaluation step ({e['tokens']:,} tokens): compiled graphs added {e['graphs_added']}, "
                 f"recompiles {e['recompiles_added']}")
    of_device = f" of {r['device_memory_mib']:,} MiB" if r["device_memory_mib"] else " (CPU: peak resident set size)"
    lines.append(f"peak memory: allocated {r['peak_memory_allocated_mib']:,} MiB, reserved "
                 f"{r['peak_memory_reserved_mib']:,} MiB{of_device}")
    w = r["warmup"]
    lines.append(f"compiled graphs: {r['graphs']} in all ({w['graphs']} after the {w['steps']} warm-up steps), "
                 f"recompiles {r['recompiles']} ({w['recompiles']} in the warm-up)")
    if not r["collectives"]:
        lines.append("collectives: none (one process)")
    for parity, summary in r["collectives"].items():
        lines += collective_lines(summary, f"collectives of rank 0, the last timed {parity} step")
    return lines

# ---- writing shards (the data tools and the tests)

def write_shard(path, tokens) -> None:
    """Write tokens (values < 65536) as a shard, atomically (temporary name, then rename)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: tokens must be in [0, 65536) to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)

# ---- after the run: the hooks of --metrics_jsonl, --tracker and --eval_hellaswag (their code: tools/)

def after_run_hooks(config: Hyperparameters, rank: int, world_size: int):
    """None if none of them is asked, and on ranks > 0; else rank 0's tools.after_run.AfterRun,
    prepared before anything is built, so that a HellaSwag set that cannot be had or a metrics file
    that cannot be written is an InputError before training, not after it."""
    if not (config.metrics_jsonl or config.tracker != "none" or config.eval_hellaswag):
        return None
    sys.modules.setdefault("train_gpt_medium", sys.modules[__name__])  # run as a script: the tools get this module
    from tools.after_run import AfterRun
    made = {}

    def prepare() -> None:
        made["hooks"] = AfterRun(config)
    on_rank0_for_all(prepare, rank, world_size)
    return made.get("hooks")


if __name__ == "__main__":
    exit_code = main()
    if "RANK" in os.environ:
        # torchrun's processes leave without interpreter teardown: there, torch 2.13's gloo worker
        # threads can still be releasing a finished collective's tensors and abort the process
        # (SIGABRT after a complete run; see tests/test_distributed.py). The process group is gone
        # and every file is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)
