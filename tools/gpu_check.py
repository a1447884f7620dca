"""The first GPU hour's verdict in one command: does the trainer run here, how fast, in how much memory.

    tools/gpu_check.sh --quick            # a verdict in minutes on one GPU (the first thing to run)
    tools/gpu_check.sh --quick --recipe mudd
    tools/gpu_check.sh                    # the full check: the record's shapes on this machine's GPUs (1 to 8)
    tools/gpu_check.sh --preset tiny      # the same checks at toy size; on the CPU where there is no GPU
    tools/gpu_check.sh --compile=false    # any trainer flag is passed on to every run
    tools/gpu_check.sh --time_limit=900   # seconds each trainer process may take (quick: 480, full: 600)
    tools/gpu_check.sh --offline --arch 9.0 [--recipe all]   # no GPU: compile for one (tools/offline_compile.py)

--quick runs two processes on one GPU, each compiling one phase of the step grid only: a benchmark at
the first full-batch step (its two parities, warm-up limited to that phase, one evaluation step), then
a short training run held at that phase (full batch, that step's windows; validated once, at the end):
losses finite, the validation loss below the step-0 training loss. The compiler's
coordinate-descent tuning is off. It proves the compiled path runs, its speed and memory at the
record's full batch, and that the model learns; not the other phases, activation checkpointing or
several GPUs (the full check's).

Both start with two rows from one probe of the machine: the attention backends it has, and its GPU
class (name, compute capability, memory) with the recipes that run on it, the GPU guard's verdicts
(train_gpt_medium.py's gpu_verdict: FP8 needs 8.9, FA3 9.x, bf16 and FlexAttention 8.0, and the
predicted peak must fit; a refused recipe's lines, with the nearest flags that run, are printed
above the table). The row fails when the guard refuses the runs' own flags.

The full check: each check is a run of train_gpt_medium.py in its own process (torchrun for several GPUs):

  1. --bench_steps at the first and the last step of the schedule, on one GPU: ms/step, tokens/s,
     MFU; compiled graphs after the warm-up, across the window change and into evaluation;
     peak memory against the device's; the allocator's settings;
  2. --activation_checkpointing under the same compile: it runs, and its first losses equal
     those of check 1 (the same seed and random tokens) within a tolerance;
  3. 20 real training steps, validating every 10, on the downloaded shards when present
     (--train_files / --val_files), else on generated learnable tokens: losses finite and falling;
  4. with several GPUs, checks 1 and 3 again on all of them (NCCL), the benchmark's first
     losses against the one-GPU run's.
Prints a table, then one JSON line (the summary). Exit code 0 when every check passed, 1 when one
failed (the reasons on stderr), 2 for bad flags. Its files (generated shards, the training runs'
logs) go to a temporary folder, deleted at the end; nothing is written into the repository.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "train_gpt_medium.py"
sys.path.insert(0, str(ROOT))
import train_gpt_medium as tg  # noqa: E402

BENCH_STEPS, CHECKPOINTED_BENCH_STEPS = 5, 2  # timed steps per point (each point adds one untimed step)
WARMUP_STEPS = 1  # enough to compile the training graphs; every timed point starts with an untimed step
TRAIN_STEPS, VAL_EVERY = 20, 10
RUN_TIMEOUT_S = 600
# --quick: 4 timed steps (2 of each parity), a 10-step training run, each process at most 480 s
# (twice mudd's benchmark process with cold caches on one H200 with 16 CPU cores: 240 s)
QUICK_BENCH_STEPS, QUICK_TRAIN_STEPS, QUICK_TIMEOUT_S = 4, 10, 480
MEMORY_LIMIT = 0.95  # of the device's memory: above it a longer run or another evaluation can run out
# First losses of two runs that compute the same thing differently (recomputed blocks and a chunked
# loss; another world size), compared relative to the reference's loss: the record's training loss
# is a sum over a rank's tokens (about 1,400 nats in the tiny preset, 10^5 and more at the record's
# size), so an absolute bound would mean nothing. fp32: reduction order only (the tiny preset on
# the CPU: 0 with checkpointing, 4.4e-8 for 2 processes vs 1 at the first step); bf16: compiled
# graphs round differently, guessed, not yet measured on a GPU.
LOSS_TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-3}
COMPARED_LOSSES = 3
# Each record's and claim's ms per step on 8xH100 at each batch size of its ramp (131,072 to 524,288
# tokens): the mean over that phase's steps in its logs, validation excluded (bulk: 2 logs, fp8_yarn
# 5, bigram 1, mudd 6). Their peak memory is in tg.RECIPES.
RECORD_MS_PER_STEP_BY_BATCH = {
    "bulk": {131_072: 72, 262_144: 129, 393_216: 189, 524_288: 249},
    "fp8_yarn": {131_072: 71, 262_144: 126, 393_216: 184, 524_288: 242},
    "bigram": {131_072: 67, 262_144: 120, 393_216: 178, 524_288: 233},
    "mudd": {131_072: 67, 262_144: 121, 393_216: 179, 524_288: 235},
}
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---- running the trainer


class Run:
    """One finished trainer process: exit code, output, seconds, and why it failed (or None).
    time_limit: the seconds it was allowed, given when it ran out of them."""

    def __init__(self, name: str, returncode: int, output: str, seconds: float, time_limit: float | None = None):
        self.name, self.returncode, self.output, self.seconds = name, returncode, output, seconds
        self.failure = None
        if time_limit is not None:
            self.failure = (f"{name}: stopped at its time limit of {time_limit:.0f} s before it finished "
                            f"(more time: --time_limit=SECONDS)")
        elif returncode != 0:
            errors = [line for line in output.splitlines() if line.startswith("error")]
            last = errors[-1] if errors else (output.strip().splitlines() or ["no output"])[-1]
            self.failure = f"{name}: exit code {returncode}: {last}"

    def json(self) -> dict | None:
        """The last JSON line the run printed (the benchmark's report), or None."""
        lines = [line for line in self.output.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None


def run_trainer(name: str, flags: list[str], processes: int, time_limit: float = RUN_TIMEOUT_S,
                script: Path = TRAINER, environment: dict | None = None) -> Run:
    """`script` (train_gpt_medium.py) with `flags`, as one process or through torchrun, from the repository
    root, with `environment`'s variables added, stopped (with every process it started: its own session)
    after time_limit seconds."""
    command = [sys.executable, str(script)] if processes <= 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(script)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | (environment or {})
    print(f"[gpu_check] {name} (time limit {time_limit:.0f} s) ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command + flags, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=time_limit)
        run = Run(name, proc.returncode, output, time.perf_counter() - start)
    except subprocess.TimeoutExpired:
        output = stop_session(proc)
        run = Run(name, -1, output, time.perf_counter() - start, time_limit=time_limit)
        print(f"[gpu_check] {name}: TIME LIMIT: stopped after {time_limit:.0f} s", flush=True)
    except BaseException:  # Ctrl-C: no trainer is left behind
        stop_session(proc)
        raise
    print(f"[gpu_check] {name}: {'ok' if run.failure is None else 'FAILED'} ({run.seconds:.0f} s)", flush=True)
    if run.failure:
        print("\n".join("    " + line for line in run.output.strip().splitlines()[-15:]), flush=True)
    return run


def stop_session(proc: subprocess.Popen) -> str:
    """End a trainer and everything it started (torchrun's workers): SIGTERM to its session, SIGKILL
    10 s later. Returns what it printed."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            output, _ = proc.communicate(timeout=wait)
            return output or ""
        except subprocess.TimeoutExpired:
            continue
    output, _ = proc.communicate()
    return output or ""


# ---- data for the training check


def write_markov_shards(folder: Path, vocab_size: int, eot_token: int, train_tokens: int, val_tokens: int,
                        seed: int = 0, branching: int = 8, end_prob: float = 1 / 128) -> None:
    """Learnable tokens at any vocabulary size: a random Markov chain in which every token has
    `branching` likely successors and ends its document with probability end_prob (after the
    end-of-text token a document starts anywhere). data/synthetic.py's exact chain is a dense
    V x V matrix, too large for GPT-2's vocabulary; this one is V x branching."""
    rng = np.random.default_rng(seed)

    def words(n):  # uniform over the vocabulary without the end-of-text token
        w = rng.integers(0, vocab_size - 1, size=n)
        return w + (w >= eot_token)

    successors = words(vocab_size * branching).reshape(vocab_size, branching)
    cdf = np.cumsum(rng.dirichlet(np.ones(branching), size=vocab_size), axis=1)
    cdf[:, -1] = 1.0
    chains = max(1, min(1024, (train_tokens + val_tokens) // 4096))  # rows of >= 4096 tokens
    length = -(-(train_tokens + val_tokens) // chains)
    out = np.empty((chains, length), dtype=np.int64)
    state = np.full(chains, eot_token)  # every row starts a document, so rows join as documents do
    for t in range(length):  # vectorized over independent chains
        out[:, t] = state
        successor = successors[state, (cdf[state] < rng.random(chains)[:, None]).sum(1)]
        ending = rng.random(chains) < end_prob
        state = np.where(state == eot_token, words(chains), np.where(ending, eot_token, successor))
    stream = out.reshape(-1)
    folder.mkdir(parents=True, exist_ok=True)
    tg.write_shard(folder / "generated_val_000000.bin", stream[:val_tokens])
    tg.write_shard(folder / "generated_train_000001.bin", stream[val_tokens:val_tokens + train_tokens])


def training_data(config: tg.Hyperparameters, folder: Path, steps: int) -> tuple[list[str], str]:
    """Flags naming the training check's shards, and where they come from: the configured ones when
    both globs match files, else generated tokens for `steps` full steps written to `folder`."""
    if glob.glob(config.train_files) and glob.glob(config.val_files):
        return [], f"shards {config.train_files}"
    step_tokens = config.batch_slices * config.train_seq_len
    # whole documents per slice (--document_aligned_batches) leave the rest of each slice's last one unused
    waste = 3 if config.document_aligned_batches else 1
    write_markov_shards(folder, config.vocab_size, config.eot_token, waste * steps * step_tokens + 1,
                        config.batch_slices * config.val_seq_len + 1)
    return [f"--train_files={folder / 'generated_train_*.bin'}", f"--val_files={folder / 'generated_val_*.bin'}",
            "--token_bytes_file="], "generated tokens, no shards found"


def machine_probe(argv: list[str]) -> dict:
    """What the trainer's runs will find on this machine: CUDA or not, each attention backend, and on
    a GPU its class (tg.gpu_properties), what the GPU guard says of each recipe on all of the
    machine's GPUs (a count that divides the recipes' 8 slices) and of the runs' own flags on one
    GPU. Run in a child process (probe_machine), so that this one never starts CUDA."""
    config = tg.parse_args(argv)
    cuda = torch.cuda.is_available()
    report = dict(cuda=cuda, backends=tg.attention_backends_here(), gpu=None)
    if cuda and config.device != "cpu":
        gpu = tg.gpu_properties(torch.device("cuda", 0))
        gpus = max(w for w in range(1, torch.cuda.device_count() + 1) if tg.PEAK_WORLD_SIZE % w == 0)
        report["gpu"] = dict(label=gpu.label, gpus=gpus, recipes=tg.recipes_on_gpu(gpu, gpus),
                             this_run=tg.gpu_verdict(config, gpu, 1)[2])
    return report


PROBE = ("import json, sys; sys.path.insert(0, 'tools'); import gpu_check; "
         "print(json.dumps(gpu_check.machine_probe(sys.argv[1:])))")


def probe_machine(argv: list[str]) -> dict | str:
    """machine_probe in a child process (as the trainer's runs see the machine), or why it failed."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError) as e:
        return f"the probe failed ({type(e).__name__})"


def machine_rows(config: tg.Hyperparameters, argv: list[str]) -> list[dict]:
    """The attention backends and the GPU class rows, from one probe of the machine."""
    report = probe_machine(argv)
    if isinstance(report, str):
        return [row("attention backends", "could not be asked", "the runs' backend available",
                    f"attention backends: {report}"),
                row("GPU class", "could not be asked", "the runs' flags run here", f"GPU class: {report}")]
    return [backends_row(config, report), gpu_class_row(report, config)]


def backends_row(config: tg.Hyperparameters, report: dict) -> dict:
    """Which attention backends this machine has, and whether the runs' own is one of them."""
    cuda, found = report["cuda"], report["backends"]
    used = tg.attention_backend(config, "cuda" if cuda and config.device != "cpu" else "cpu")
    measured = "; ".join(f"{name}: yes" if why is None else f"{name}: no ({why})" for name, why in found.items())
    problem = found.get(used)
    return row("attention backends", measured, f"{used} (the runs' backend) available",
               None if problem is None else f"attention backends: --attention={used} cannot run here: {problem}")


def gpu_class_row(report: dict, config: tg.Hyperparameters | None = None) -> dict:
    """The GPU class and which recipes run on it (the GPU guard's verdicts; each refusal's lines are
    printed above the table); failed when the guard refuses the runs' own flags on one GPU, or when
    there is no GPU and the runs' flags need one (the medium preset, --device=cuda)."""
    gpu = report["gpu"]
    if gpu is None:
        if config is not None and (needs := runs_need_a_gpu(config)):
            return row("GPU class", "no CUDA GPU", "the runs' flags run here", f"GPU class: {needs}")
        return row("GPU class", "no CUDA GPU: the runs use the CPU", "the runs' flags run here")
    runs = [name for name, lines in gpu["recipes"].items() if not lines]
    refused = {name: lines for name, lines in gpu["recipes"].items() if lines}
    for name, lines in refused.items():
        for line in lines:
            print(f"[gpu_check] recipe {name} on {gpu['gpus']} GPU(s) like this one: {line}", flush=True)
    flags = [line.split(":", 1)[0] for lines in refused.values() for line in lines[:1]]
    measured = (f"{gpu['label']}, {gpu['gpus']} GPU(s): runs {', '.join(runs) or 'no recipe'}"
                + "".join(f"; not {name} ({flag})" for name, flag in zip(refused, flags)))
    problem = gpu["this_run"]
    return row("GPU class", measured, "the runs' flags run here (1 GPU)",
               None if not problem else f"GPU class: the GPU guard refuses the runs' flags: {problem[0]}")


def runs_need_a_gpu(config: tg.Hyperparameters) -> str | None:
    """Why the runs' flags cannot run on a machine without a CUDA GPU (the trainer would refuse them:
    --device=cuda, or the medium preset's auto device), or None."""
    why = ("--device=cuda" if config.device == "cuda" else
           "the medium preset runs on CUDA GPUs" if config.device == "auto" and config.preset == "medium" else None)
    if why is None:
        return None
    return f"no CUDA GPU here, and the runs need one ({why}); check the trainer on the CPU with --preset tiny"


# ---- the checks: each returns rows of the table


def row(name: str, measured: str, expected: str, failure: str | None = None) -> dict:
    return dict(check=name, measured=measured, expected=expected, ok=failure is None, reason=failure)


def failed_run(name: str, run: Run) -> list[dict]:
    return [row(name, "did not finish", "exit code 0", run.failure)]


def is_record_shape(config: tg.Hyperparameters) -> bool:
    """The shapes of the record of config's recipe (its figures then apply). A candidate has no record."""
    if config.recipe in tg.CANDIDATES:
        return False
    record = tg.make_config(recipe=config.recipe)
    names = ("vocab_size", "model_dim", "num_layers", "num_heads", "head_dim", "mlp_ratio", "train_seq_len",
             "batch_slices", "max_window_tokens", "value_embed_layout", "attention_free_layers", "batch_schedule")
    return all(getattr(config, n) == getattr(record, n) for n in names)


def record_ms_per_step(config: tg.Hyperparameters, step: int, world_size: int) -> str:
    """What the record of config's recipe took per step at `step`, scaled from its 8 GPUs to `world_size`."""
    ms = RECORD_MS_PER_STEP_BY_BATCH[config.recipe][tg.batch_tokens(step, config)]
    return f"record ({config.recipe}): ~{ms * 8 / world_size:,.0f} ms"


def bench_rows(label: str, run: Run, config: tg.Hyperparameters) -> list[dict]:
    """Timing per point, compiled graphs, peak memory and the allocator's settings of one benchmark."""
    report = run.json()
    if report is None:
        return failed_run(f"bench, {label}", run)
    rows, W = [], report["world_size"]
    for p in report["points"]:
        finite = all(math.isfinite(x) for x in p["losses"])
        mfu = f", MFU {100 * p['mfu']:.1f}%" if p["mfu"] is not None else ""
        expected = record_ms_per_step(config, p["step"], W) if is_record_shape(config) else "times > 0, losses finite"
        bad = None if finite and min(p["times_ms"]) > 0 else f"bench, {label}, step {p['step']}: " + (
            "non-finite loss" if not finite else "a step time is not positive")
        rows.append(row(f"bench, {label}, step {p['step']} (window {p['window_blocks']})",
                        f"{p['median_ms']:,.1f} ms/step (min {p['min_ms']:,.1f}), {p['tokens_per_s']:,.0f} tokens/s, "
                        f"{p['tflops_per_process']:.4g} TFLOP/s per process{mfu}", expected, bad))
    rows += graph_rows(label, report, config)
    device_mib, reserved = report["device_memory_mib"], report["peak_memory_reserved_mib"]
    share = f" of {device_mib:,} MiB ({100 * reserved / device_mib:.0f}%)" if device_mib else " (CPU: peak RSS)"
    too_much = device_mib is not None and reserved > MEMORY_LIMIT * device_mib
    rows.append(row(f"peak memory, {label}", f"allocated {report['peak_memory_allocated_mib']:,} MiB, reserved "
                    f"{reserved:,} MiB{share}",
                    f"reserved < {100 * MEMORY_LIMIT:.0f}% of the device"
                    + (f"; record ({config.recipe}): {tg.RECIPES[config.recipe].peak_mib:,} MiB"
                       if is_record_shape(config) else ""),
                    f"peak memory, {label}: {reserved:,} MiB reserved is over {100 * MEMORY_LIMIT:.0f}% of "
                    f"{device_mib:,} MiB" if too_much else None))
    rows.append(allocator_row(label, report))
    if run.failure and all(r["ok"] for r in rows):  # a report, yet the run failed after it
        rows.append(row(f"bench, {label}", "exit code", "0", run.failure))
    return rows


def allocator_row(label: str, report: dict) -> dict:
    """The CUDA allocator's settings and where they were read (every torch: what the allocator
    parsed, or the variable it read at start); on the CPU a row saying there is none."""
    settings, source = report.get("allocator_settings"), report.get("allocator_settings_source", "not reported")
    if settings is None:
        return row(f"allocator, {label}", f"none ({source})", "a CUDA allocator on a GPU", None)
    user_set = any(os.environ.get(name) for name in tg.ALLOC_CONF_VARIABLES)
    on = tg.EXPANDABLE_SEGMENTS in settings
    return row(f"allocator, {label}", f"{settings or '(defaults)'}, from {source}",
               "set by you" if user_set else tg.EXPANDABLE_SEGMENTS,
               None if on or user_set else f"allocator, {label}: expandable segments are not on")


def graph_rows(label: str, report: dict, config: tg.Hyperparameters) -> list[dict]:
    """Compiled graphs: after the warm-up one set per phase of the step grid (batch shape,
    multi-token weights, tied or not; not counted); none added at a later point (another phase of
    the grid); one evaluation graph (a recompile of the forward)."""
    compiled = report["compile"]
    warmup = report["warmup"]["graphs"]
    rows = [row(f"compiled graphs after warm-up, {label}", str(warmup), "one set per phase of the step grid", None)]
    first = report["points"][0]
    for later in report["points"][1:]:
        added = (later["graphs_added"], later["recompiles_added"])
        what = f"step {later['step']} after step {first['step']}"
        rows.append(row(f"{what}, {label}", f"+{added[0]} graphs, +{added[1]} recompiles", "+0 graphs, +0 recompiles",
                        None if added in ((0, 0), (0, None)) else f"{label}: {what} compiled again"))
    e, want = report["evaluation"], 1 if compiled else 0
    ok = e["graphs_added"] == want and e["recompiles_added"] in (want, None)
    rows.append(row(f"into evaluation, {label}", f"+{e['graphs_added']} graphs, +{e['recompiles_added']} recompiles",
                    f"+{want} graph, +{want} recompile" + (" (the evaluation graph)" if compiled else ""),
                    None if ok else f"{label}: evaluation added {e['graphs_added']} graphs, expected {want}"))
    return rows


def losses_row(name: str, run: Run, reference: Run, tolerance: float) -> dict:
    """The first benchmark losses at step 0 of `run` against `reference`'s."""
    got, want = run.json(), reference.json()
    if got is None or want is None:
        return row(name, "no losses to compare", f"max relative difference <= {tolerance:g}",
                   run.failure or reference.failure or f"{name}: no benchmark report")
    a, b = got["points"][0]["losses"][:COMPARED_LOSSES], want["points"][0]["losses"][:COMPARED_LOSSES]
    diff = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))
    return row(name, f"max relative difference {diff:.3g} over {len(a)} losses ({a[0]:.6f} vs {b[0]:.6f} first)",
               f"<= {tolerance:g} of the loss",
               None if diff <= tolerance else f"{name}: losses differ by {diff:.3g} of the loss")


VAL_LINE = re.compile(r"^step:(\d+)/\d+ val_loss:(\S+) train_time:\d+ms step_avg:([\d.]+)ms", re.M)
STEP0_LINE = re.compile(r"^step0_train_loss:(\S+)$", re.M)


def training_row(label: str, run: Run, log_dir: Path, source: str) -> dict:
    """Validation losses of a short run: all finite and each lower than the one before."""
    name = f"training {TRAIN_STEPS} steps, {label}"
    if run.failure:
        return row(name, "did not finish", "exit code 0", run.failure)
    logs = sorted(log_dir.glob("*.txt"))
    found = VAL_LINE.findall(logs[-1].read_text()) if logs else []
    losses = [float(loss) for _, loss, _ in found]
    falling = len(losses) >= 2 and all(math.isfinite(x) for x in losses) and all(
        b < a for a, b in zip(losses, losses[1:]))
    return row(name, " -> ".join(f"{x:.4f}" for x in losses) + (f", {float(found[-1][2]):,.1f} ms/step" if found else "")
               + f" ({source})", f"finite, falling at every validation (every {VAL_EVERY} steps)",
               None if falling else f"{name}: validation losses {losses} are not finite and falling")


def quick_training_row(label: str, run: Run, log_dir: Path, source: str, config: tg.Hyperparameters) -> dict:
    """--quick's training run, validated once at its end: the validation loss finite and below the
    step-0 training loss per token (a sum over a slice's tokens with train_loss_reduction=sum)."""
    name = f"training {QUICK_TRAIN_STEPS} steps at one phase, {label}"
    if run.failure:
        return row(name, "did not finish", "exit code 0", run.failure)
    logs = sorted(log_dir.glob("*.txt"))
    text = logs[-1].read_text() if logs else ""
    found, step0 = VAL_LINE.findall(text), STEP0_LINE.findall(text)
    if not found or not step0:
        return row(name, "no step-0 loss or validation line in the log", "both", f"{name}: the log lacks them")
    per_token = float(step0[0]) / (config.train_seq_len if config.train_loss_reduction == "sum" else 1)
    val_loss = float(found[-1][1])
    ok = math.isfinite(val_loss) and val_loss < per_token
    return row(name, f"step 0 {per_token:.4f} per token -> validation {val_loss:.4f}, "
               f"{float(found[-1][2]):,.1f} ms/step ({source})", "finite, below the step-0 loss",
               None if ok else f"{name}: validation loss {val_loss} is not finite and below {per_token:.4f}")


# ---- the trainer's command lines


def first_full_batch_step(config: tg.Hyperparameters) -> int:
    """The first step at the step grid's largest batch (the full batch, once the ramp reaches it)."""
    sizes = [tg.batch_tokens(step, config) for step in range(config.num_iterations)]
    return sizes.index(max(sizes))


def one_phase_flags(config: tg.Hyperparameters, step: int, steps: int) -> list[str]:
    """A `steps`-step run held at the phase of `step` (tg.grid_phase): its batch, its windows, its
    tie, next-token loss where that step has it; no extension. Its graphs are that step's (with the
    embedding untied from the start, the head is stored fp32 rather than in the model dtype)."""
    split = tg.untie_step(config)
    untied = split and step > split
    flags = [*short_run_flags(config, steps), "--extension_steps=0",
             f"--batch_schedule={tg.batch_tokens(step, config)}",
             f"--window_schedule={tg.attention_windows(step, config)[0]}",
             # untied at `step`: untied from the start; tied: the split after the run's end (odd: an Adam step)
             f"--untie_embed_after_step={0 if untied or not split else (steps + 1) | 1}"]
    if config.multi_token_prediction and tg.multi_token_weights(step, config) == (1.0,):
        flags.append("--multi_token_prediction=false")  # the next-token loss: the same graph
    return flags


def short_run_flags(config: tg.Hyperparameters, steps: int = None) -> list[str]:
    """The training check as a TRAIN_STEPS-step run of config's recipe: num_iterations and every
    value that counts steps (the extension, the momentum warm-up and cool-down, the embedding split:
    tg.with_num_iterations) scaled to its length, so that each phase of the recipe still happens."""
    short = tg.with_num_iterations(config, steps or TRAIN_STEPS)
    scaled = [f.name for f in dataclasses.fields(config) if f.name == "num_iterations" or f.metadata.get("counts_steps")]
    return [f"--{name}={tg.to_text(getattr(short, name))}" for name in scaled
            if getattr(short, name) != getattr(config, name)]


def quick_commands(config: tg.Hyperparameters, argv: list[str], data_flags: list[str], log_dir: Path) -> dict:
    """--quick's two trainer runs, each compiling one phase: the benchmark at the first full-batch step
    and a training run held at that step's phase; coordinate-descent tuning off. The user's flags
    (argv) may override the seed, the warm-up and the tuning."""
    step = first_full_batch_step(config)
    base = ["--seed=0", f"--warmup_steps={WARMUP_STEPS}", "--coordinate_descent_tuning=false", *argv]
    return {
        "bench": [*base, f"--bench_steps={QUICK_BENCH_STEPS}", f"--bench_at_step={step}"],
        "training": [*base, *data_flags, *one_phase_flags(config, step, QUICK_TRAIN_STEPS), "--val_every=0",
                     "--save_every=0", f"--val_tokens={config.batch_slices * config.val_seq_len}",
                     "--synthetic_data=false", f"--log_dir={log_dir}"],
    }


def check_commands(config: tg.Hyperparameters, argv: list[str], data_flags: list[str], log_dir: Path) -> dict:
    """The trainer flags of each check; the user's flags (argv) may override the seed and the warm-up."""
    base = ["--seed=0", f"--warmup_steps={WARMUP_STEPS}", *argv]
    return {
        "bench": [*base, f"--bench_steps={BENCH_STEPS}"],
        "checkpointed bench": [*base, "--activation_checkpointing", f"--bench_steps={CHECKPOINTED_BENCH_STEPS}",
                               "--bench_at_step=0"],
        "training": [*base, *data_flags, *short_run_flags(config), f"--val_every={VAL_EVERY}", "--save_every=0",
                     f"--val_tokens={config.batch_slices * config.val_seq_len}", "--synthetic_data=false",
                     f"--log_dir={log_dir}"],
    }


# ---- main


def print_table(rows: list[dict]) -> None:
    headers = ("check", "measured", "expected", "result")
    cells = [(r["check"], r["measured"], r["expected"], "ok" if r["ok"] else "FAIL") for r in rows]
    widths = [max(len(c[i]) for c in cells + [headers]) for i in range(4)]
    for line in [headers, tuple("-" * w for w in widths), *cells]:
        print("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip())


def own_flags(argv: list[str]) -> tuple[bool, float | None, list[str]]:
    """(--quick, --time_limit in seconds or None, the trainer's flags): gpu_check's own flags taken out."""
    quick, limit, rest = False, None, []
    for arg in argv:
        if arg in ("--quick", "--quick=true"):
            quick = True
        elif arg == "--quick=false":
            quick = False
        elif arg.startswith("--time_limit"):
            text = arg.partition("=")[2]
            try:
                limit = float(text)
            except ValueError:
                limit = None
            if limit is None or not limit > 0:
                raise tg.ConfigError(f"--time_limit: {text!r} is not a number of seconds > 0 (e.g. --time_limit=600)")
        else:
            rest.append(arg)
    return quick, limit, rest


def quick_main(config: tg.Hyperparameters, argv: list[str], gpus: int, dtype: str, limit: float) -> int:
    """--quick: the benchmark and the one-phase training run on one GPU (or the CPU)."""
    label = "1 GPU" if gpus else "CPU"
    rows = machine_rows(config, argv)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        data_flags, source = training_data(config, tmp / "data", QUICK_TRAIN_STEPS)
        flags = quick_commands(config, argv, data_flags, tmp / "logs")
        bench = run_trainer(f"bench, {label}", flags["bench"], 1, limit)
        rows += bench_rows(label, bench, config)
        training = run_trainer(f"training, {label}", flags["training"], 1, limit)
        rows.append(quick_training_row(label, training, tmp / "logs", source, config))
    return finish(rows, bench, gpus, dtype, LOSS_TOLERANCE[dtype], quick=True)


def finish(rows: list[dict], reference: Run, gpus: int, dtype: str, tolerance: float, quick: bool = False) -> int:
    """The table, the summary JSON line, the exit code."""
    print()
    print_table(rows)
    failures = [r["reason"] for r in rows if not r["ok"]]
    report = reference.json() or {}
    print(json.dumps(dict(ok=not failures, quick=quick, gpus=gpus, device_name=report.get("device_name"), dtype=dtype,
                          loss_tolerance=tolerance, checks=rows)), flush=True)
    if failures:
        print("gpu_check: FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def value_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value of `name` given as `name VALUE` or `name=VALUE`, the last one, or None; the other flags)."""
    value, rest, args = None, [], iter(argv)
    for arg in args:
        if arg == name:
            value = next(args, "")
        elif arg.startswith(f"{name}="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
    return value, rest


def offline_flags(argv: list[str]) -> tuple[bool, str | None, list[str]]:
    """(--offline, --arch's text or None, the other flags)."""
    offline, rest = False, []
    for arg in argv:
        if arg in ("--offline", "--offline=true", "--offline=false"):
            offline = arg != "--offline=false"
        else:
            rest.append(arg)
    arch, rest = value_flag(rest, "--arch")
    return offline, arch, rest


def recipe_runs(argv: list[str]) -> list[list[str]]:
    """The trainer flags of each compile: argv, or with --recipe all one set per recipe of tg.RECIPES."""
    recipe, flags = value_flag(argv, "--recipe")
    if recipe != "all":
        return [argv]
    return [[f"--recipe={name}", *flags] for name in tg.RECIPES]


def offline_rows(name: str, run: Run, limit_text: str) -> list[dict]:
    """A recipe's compile, its kernels' shared memory, registers and spills against the arch's limits."""
    report = run.json()
    if report is None:
        return failed_run(f"compile, {name}", run)
    error, breaks = report["error"], report["graph_breaks"]
    seconds = max(report["seconds"].values(), default=0)
    failure = None
    if error:
        avoid = f" (avoid it: {error['flag']})" if error["flag"] else ""
        failure = f"compile, {name}: {error['phase']}: {error['error']}{avoid}"
    elif breaks:
        failure = f"compile, {name}: {breaks} graph break(s): {report['break_reasons'][0]}"
    rows = [row(f"compile, {name}", f"{report['graphs']} graphs, {breaks} graph breaks, {report['recompiles']} "
                f"recompiles, {report['kernels']} Triton kernels ({report['binaries']} binaries), {seconds:,} s",
                "step 0, the last step and an evaluation compile; 0 graph breaks", failure)]
    shared, registers, unfit = report["largest_shared"], report["largest_registers"], report["over_limits"]
    if shared is None:  # no Triton kernel compiled
        return rows
    dropped = (f"; {report['configs_over_limits']} config(s) over a limit, which Triton refuses to load (each "
               "kernel keeps others)" if report["configs_over_limits"] else "")
    too_big = [k for k in unfit if k["shared"] > report["shared_limit"]]
    too_many = [k for k in unfit if k not in too_big]
    rows.append(row(f"shared memory, {name}", f"largest {shared['bytes']:,} B ({shared['kernel']}){dropped}",
                    f"<= {report['shared_limit']:,} B per block ({limit_text}), a config of each kernel",
                    f"shared memory, {name}: {too_big[0]['kernel']} needs {too_big[0]['shared']:,} B in its smallest "
                    "config" if too_big else None))
    rows.append(row(f"registers, {name}", f"largest {registers['registers']} per thread ({registers['kernel']}, "
                    f"{registers['num_warps']} warps)", "<= 255 per thread, <= 65,536 per block, a config of each kernel",
                    f"registers, {name}: {too_many[0]['kernel']} uses {too_many[0]['registers']} per thread at "
                    f"{too_many[0]['num_warps']} warps" if too_many else None))
    rows.append(spills_row(name, report))
    return rows


def spills_row(name: str, report: dict) -> dict:
    """The kernels all of whose configs keep a stack frame (local memory), with the bytes ptxas spilled
    into it; failed for those whose least frame is over inductor's spill threshold (inductor's
    autotuning would skip every config: heavy spilling, not the few registers its threshold allows)."""
    over, within, limit = report["spills"], report["spills_within_threshold"], report["spill_threshold_bytes"]

    def listed(entries):
        text = "; ".join(f"{kernel} {frame:,} B frame, {stores:,} B spilled ({loads:,} B reloaded)"
                         for kernel, frame, stores, loads in entries[:3])
        return text + (f" (+{len(entries) - 3} more)" if len(entries) > 3 else "")

    if over:
        measured = f"over the threshold: {listed(over)}"
    elif within:
        measured = f"within the threshold, every config of {len(within)} kernel(s): {listed(within)}"
    else:
        spilling = report["spilling_configs"]
        measured = f"none ({spilling} config(s) spill; each of their kernels has one that does not)" if spilling else "none"
    return row(f"spills, {name}", measured,
               f"no kernel whose every config keeps more than {limit} B per thread (inductor's spill threshold)",
               f"spills, {name}: every config of {len(over)} kernel(s) spills past inductor's threshold of {limit} B "
               f"per thread: {listed(over)}" if over else None)


def offline_main(arch_text: str | None, argv: list[str], limit: float | None) -> int:
    """--offline --arch CC: the guard with the arch's properties, then each recipe's step compiled for the
    arch in a process of its own (tools/offline_compile.py)."""
    from tools import offline_compile as offline
    try:
        capability = offline.parse_arch(arch_text)
        runs = [(flags, tg.parse_args(flags)) for flags in recipe_runs(argv)]
    except tg.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = offline.arch_gpu(capability)
    many = len(runs) > 1
    rows, admitted = [], []
    for flags, config in runs:
        memory = None if config.gpu_memory_gib is None else int(config.gpu_memory_gib * 2**30)
        refusals = tg.gpu_verdict(config, gpu, tg.PEAK_WORLD_SIZE, memory)[2]
        if refusals and not many:
            print("error: " + "\n".join(refusals), file=sys.stderr)
            return 2
        where = f"{tg.PEAK_WORLD_SIZE} GPUs like {gpu.label}"
        rows.append(row(f"GPU guard, {config.recipe}", f"refused: {refusals[0]}" if refusals else f"runs on {where}",
                        "the guard's verdict (what it refuses is not compiled)"))
        if not refusals:
            admitted.append((flags, config))
    problem = offline.environment_problem() if admitted else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    reports = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_offline_") as tmp:
        tmp = Path(tmp)
        if admitted:
            try:
                library = offline.build_shim(tmp)
            except RuntimeError as e:
                print(f"error: --offline: {e}", file=sys.stderr)
                return 2
        for flags, config in admitted:
            folder = tmp / config.recipe
            run = run_trainer(f"compile {config.recipe} for {capability[0]}.{capability[1]}", [str(folder), *flags],
                              1, limit or offline.COMPILE_TIMEOUT_S, script=Path(offline.__file__),
                              environment=offline.child_environment(capability, folder, library))
            reports[config.recipe] = run.json()
            rows += offline_rows(config.recipe, run, f"{gpu.name}'s opt-in")
    if not admitted:
        rows.append(row("GPU guard", f"refuses every recipe on {gpu.label}", "a recipe that runs",
                        f"the GPU guard refuses every recipe on {gpu.label} (each row says why)"))
    print()
    print_table(rows)
    failures = [r["reason"] for r in rows if not r["ok"]]
    print(json.dumps(dict(ok=not failures, offline=True, arch=f"{capability[0]}.{capability[1]}", gpu=gpu.label,
                          world_size=tg.PEAK_WORLD_SIZE, checks=rows, compiles=reports)), flush=True)
    if failures:
        print("gpu_check: FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    offline, arch, argv = offline_flags(argv)
    try:
        quick, limit, argv = own_flags(argv)
        if arch is not None and not offline:
            raise tg.ConfigError("--arch: names the GPU to compile for with --offline (tools/gpu_check.sh --offline "
                                 "--arch 9.0); a check on this machine's GPUs takes none")
        if offline:
            return offline_main(arch, argv, limit)
        config = tg.parse_args(argv)
    except tg.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if config.device != "cpu" and torch.cuda.is_available() else 0
    dtype = str(tg.weight_dtype(config, "cuda" if gpus else "cpu")).removeprefix("torch.")
    tolerance = LOSS_TOLERANCE[dtype]
    rows, runs = [], {}
    where = f"{gpus} GPU(s)" if gpus else "the CPU"
    print(f"[gpu_check] {where}{', quick check on one' if quick else ''}; trainer flags: "
          f"{' '.join(argv) or '(the record)'}", flush=True)
    if not gpus and runs_need_a_gpu(config):  # every run would be refused: the verdict without them
        rows = machine_rows(config, argv)
        return finish(rows, Run("no run", 0, "", 0.0), gpus, dtype, tolerance, quick=quick)
    if quick:
        return quick_main(config, argv, gpus, dtype, limit or QUICK_TIMEOUT_S)
    limit = limit or RUN_TIMEOUT_S
    rows += machine_rows(config, argv)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        data_flags, source = training_data(config, tmp / "data", TRAIN_STEPS)
        all_gpus = max([w for w in range(1, gpus + 1) if config.batch_slices % w == 0], default=1)
        for processes in [1] + ([all_gpus] if all_gpus > 1 else []):  # a world size must divide batch_slices
            label = f"{processes} GPU(s)" if gpus else "CPU"
            log_dir = tmp / f"logs_{processes}"
            flags = check_commands(config, argv, data_flags, log_dir)
            bench = runs[processes] = run_trainer(f"bench, {label}", flags["bench"], processes, limit)
            rows += bench_rows(label, bench, config)
            if processes == 1:
                checkpointed = run_trainer("bench with activation checkpointing", flags["checkpointed bench"], 1,
                                           limit)
                rows.append(losses_row("activation checkpointing: first losses", checkpointed, bench, tolerance))
            else:
                rows.append(losses_row(f"{label} vs 1: first bench losses", bench, runs[1], tolerance))
            training = run_trainer(f"training, {label}", flags["training"], processes, limit)
            rows.append(training_row(label, training, log_dir, source))
    return finish(rows, runs[1], gpus, dtype, tolerance)


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main, sys.argv[1:])
