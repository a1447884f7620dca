"""--bench_steps (time training steps on random tokens: no data, no log) and tools/gpu_check.sh (the
GPU verdict in one command), both run on the CPU with the tiny preset."""
import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS  # noqa: E402

TINY = tg.make_config("tiny")
# The tiny preset's step grid (docs/bulk.md, "The tiny form"): 188 scheduled steps in 12 slots and 2
# extension steps; the batch is 256, 512, 768 and 1024 tokens from steps 0, 16, 32 and 47, the long
# window 3, 7, 11, 13, ... blocks in those slots and 23 in the extension. The benchmark times the
# first step of each batch size and the last step.
BENCH_POINTS = [0, 16, 32, 47, 189]
BENCH_WINDOWS = [3, 7, 11, 13, 23]
BENCH_TOKENS = [256, 512, 768, 1024, 1024]


def bench(argv, tmp_path, monkeypatch, capsys) -> tuple[int, list[str], dict]:
    """Run the trainer in-process from an empty folder; (exit code, printed lines, last-line JSON)."""
    monkeypatch.chdir(tmp_path)
    code = tg.main(["--preset=tiny", *argv])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, lines, json.loads(lines[-1]) if code == 0 else None


class Recorded:
    """gpu_check.run_trainer that keeps each finished trainer run by its name."""

    def __init__(self):
        self.runs, self.run_trainer = {}, gpu_check.run_trainer

    def __call__(self, name, *args, **kwargs):
        self.runs[name] = self.run_trainer(name, *args, **kwargs)
        return self.runs[name]


@pytest.fixture(scope="module")
def several_gpus_check(tmp_path_factory):
    """tools/gpu_check.sh --preset tiny with two GPUs counted (patched; the trainer's processes find
    none and run on the CPU over gloo), in-process through gpu_check.main, without shards (the
    pattern matches nothing): every check on one process, then the benchmark and the training run
    again on 2 processes. Fewer steps than gpu_check's own (3 timed bench steps, 6 training steps
    validated every 3): the same checks and rows; one thread per trainer process. On the tiny
    preset's bulk layout in 4 blocks (FOUR_BLOCK_FLAGS: every layer pattern once), which gpu_check
    passes to every run like any trainer flag: what is checked here (the step grid's points and
    windows, the printed lines, the rates, the rows, checkpointing's and 2 processes' losses equal
    to the plain run's, the validation losses falling) does not depend on the depth. With Adam
    stepping every step (a trainer flag, which gpu_check passes to every run): then 2 processes
    compute each loss of the benchmark bit for bit as 1 does (see the test below), so the
    trainer's runs serve the benchmark's own tests too. Returns the exit code, what gpu_check
    printed, its summary and each trainer run (gpu_check.Run) by name."""
    recorded, out, err = Recorded(), io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_check, "BENCH_STEPS", 3)
        mp.setattr(gpu_check, "TRAIN_STEPS", 6)
        mp.setattr(gpu_check, "VAL_EVERY", 3)
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
        mp.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
        mp.setattr(gpu_check, "run_trainer", recorded)
        none = tmp_path_factory.mktemp("no_shards") / "none_*.bin"
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = gpu_check.main(["--preset=tiny", f"--train_files={none}", "--adam_odd_steps_only=false",
                                   *FOUR_BLOCK_FLAGS])
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    return dict(code=code, out=out.getvalue(), err=err.getvalue(), summary=summary, runs=recorded.runs)


@pytest.fixture(scope="module")
def tiny_bench(several_gpus_check):
    """--preset tiny --bench_steps=3 on one process (in 4 blocks): the several-GPU check's one-process
    benchmark (gpu_check adds --seed=0 --warmup_steps=1), its printed lines and its report (the last
    line)."""
    run = several_gpus_check["runs"]["bench, 1 GPU(s)"]
    assert run.failure is None, run.output[-3000:]
    lines = run.output.strip().splitlines()
    return dict(lines=lines, report=json.loads(lines[-1]))


def test_bench_exits_0_and_writes_nothing_in_the_working_folder(tmp_path, monkeypatch, capsys):
    """From an empty folder, with shard patterns that match nothing: random tokens, no data, no log
    (in 4 blocks: the depth changes none of it)."""
    code, lines, report = bench(["--bench_steps=1", "--bench_at_step=0", "--warmup_steps=0", *FOUR_BLOCK_FLAGS,
                                 f"--train_files={tmp_path}/none_*.bin", f"--val_files={tmp_path}/none_*.bin"],
                                tmp_path, monkeypatch, capsys)
    assert code == 0 and lines[0].startswith("bench: 1 process(es) on cpu") and report["points"][0]["step"] == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_times_the_first_step_of_each_batch_size_and_the_last_step(tiny_bench):
    points = tiny_bench["report"]["points"]
    assert [p["step"] for p in points] == BENCH_POINTS and BENCH_POINTS[-1] == TINY.num_iterations - 1
    assert [p["window_blocks"] for p in points] == BENCH_WINDOWS
    assert [p["tokens_per_step"] for p in points] == BENCH_TOKENS
    for p in points:
        assert len(p["times_ms"]) == 3 and min(p["times_ms"]) > 0
        assert len(p["losses"]) == 5  # the two untimed first steps' too


@pytest.mark.slow
def test_bench_alternates_the_two_parities_of_each_point_and_says_which_steps_it_timed(tiny_bench):
    """Each point times its step and the next one (the last step of the run: the one before),
    alternately, so an odd step (Adam steps) and an even one (Adam holds) are both in the numbers."""
    points = tiny_bench["report"]["points"]
    partners = [1, 17, 33, 48, 188]
    for p, other in zip(points, partners, strict=True):
        assert p["timed_steps"] == [p["step"], other, p["step"]]
        assert {p["step"] % 2, other % 2} == {0, 1}
    step_lines = [line for line in tiny_bench["lines"] if line.startswith("step 189 ")]
    assert "3 timed steps (steps 189 and 188, alternating)" in step_lines[0]


def test_a_point_keeps_its_partner_inside_its_phase():
    """The partner shares the point's batch, windows, multi-token weights and tie: step 15 is the
    ramp's last 256-token step, so it pairs with 14, not with 16 (512 tokens)."""
    assert tg.point_steps(15, TINY) == [15, 14] and tg.point_steps(16, TINY) == [16, 17]
    assert tg.grid_phase(15, TINY) != tg.grid_phase(16, TINY)
    one_step = tg.make_config("tiny", num_iterations=1, extension_steps=0, muon_momentum_cooldown_steps=0)
    assert tg.point_steps(0, one_step) == [0]


@pytest.mark.slow
def test_bench_prints_a_line_per_point_before_the_json_line(tiny_bench):
    lines = tiny_bench["lines"]
    assert lines[0].startswith("bench: 1 process(es) on cpu")
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [
        f"step {s} (long window {w} blocks, {t:,} tokens)" for s, w, t in zip(BENCH_POINTS, BENCH_WINDOWS, BENCH_TOKENS)]
    assert any(line.startswith("peak memory: ") for line in lines)
    assert any(line.startswith("compiled graphs: ") for line in lines)


@pytest.mark.slow
def test_bench_flops_per_token_is_the_dry_runs(tiny_bench, tmp_path, monkeypatch, capsys):
    code, _, dry = bench(["--dry_run", *FOUR_BLOCK_FLAGS], tmp_path, monkeypatch, capsys)  # the benchmark's model
    assert code == 0
    assert tiny_bench["report"]["flops_per_token"] == dry["flops_per_token"]


@pytest.mark.slow
def test_bench_rates_follow_from_the_median_step_time(tiny_bench):
    """The point's step time is the mean over its two steps of each one's median (a run's typical
    step, both parities); tokens/s = the point's tokens per step / that time; TFLOP/s = FLOPs per
    token x tokens/s; no MFU on a CPU. The report's tokens_per_step is the full batch (the ramp's
    last size)."""
    report = tiny_bench["report"]
    assert report["tokens_per_step"] == TINY.batch_slices * TINY.train_seq_len == BENCH_TOKENS[-1]
    for p, tokens in zip(report["points"], BENCH_TOKENS, strict=True):
        first, second = p["times_ms"][0::2], p["times_ms"][1::2]  # the point's step, then its partner
        assert p["median_ms_by_step"] == {str(p["timed_steps"][0]): statistics.median(first),
                                          str(p["timed_steps"][1]): statistics.median(second)}
        median_s = (statistics.median(first) + statistics.median(second)) / 2 / 1000
        assert p["median_ms"] == pytest.approx(median_s * 1000) and p["min_ms"] == min(p["times_ms"])
        assert p["tokens_per_s"] == pytest.approx(tokens / median_s)
        assert p["tokens_per_s_per_process"] == pytest.approx(p["tokens_per_s"])
        assert p["tflops"] == pytest.approx(report["flops_per_token"] * p["tokens_per_s"] / 1e12)
        assert p["mfu"] is None
    assert report["peak_tflops_per_device"] is None


@pytest.mark.slow
def test_bench_reports_memory_and_compiled_graphs(tiny_bench):
    report = tiny_bench["report"]
    assert report["peak_memory_allocated_mib"] > 0 and report["device_memory_mib"] is None  # CPU: peak RSS
    assert report["compile"] is False and report["graphs"] == 0  # the CPU default runs eagerly
    assert report["evaluation"] == dict(tokens=TINY.batch_slices * TINY.val_seq_len, graphs_added=0,
                                        recompiles_added=0)


def test_bench_at_step_times_that_step_only(tmp_path, monkeypatch, capsys):
    """The step grid's point, in 4 blocks (the grid does not depend on the depth)."""
    code, _, report = bench(["--bench_steps=1", "--bench_at_step=120", "--warmup_steps=0", *FOUR_BLOCK_FLAGS],
                            tmp_path, monkeypatch, capsys)
    assert code == 0
    # slot floor(12 x 120 / 188) = 7 of the window schedule: 21 blocks
    assert [(p["step"], p["window_blocks"], p["tokens_per_step"]) for p in report["points"]] == [(120, 21, 1024)]
    assert report["points"][0]["timed_steps"] == [120] and report["warmup"]["steps"] == 0


def test_bench_at_step_warms_up_that_points_phase_only(tmp_path, monkeypatch):
    """With --bench_at_step the warm-up runs the point's two steps, not the first warmup_steps and
    the steps around every change of the grid (which compile the other phases' graphs)."""
    ran = []
    monkeypatch.setattr(tg.Runner, "train_step", lambda self, step, batches, mtp_weights=None, host_inputs=None: ran.append(step)
                        or torch.zeros(()))
    monkeypatch.chdir(tmp_path)
    config = tg.make_config("tiny", bench_steps=2, bench_at_step=47, warmup_steps=2, compile=False)
    tg.bench(config, torch.device("cpu"))
    assert ran == [47, 48] + [47, 48] + [47, 48]  # warm-up, the untimed pair, the timed pair
    ran.clear()
    tg.bench(dataclasses.replace(config, bench_at_step=None, bench_steps=1), torch.device("cpu"))
    assert ran[:2] == [0, 1] and ran[2:4] == [0, 1]  # the whole run's warm-up (eager: the first 2 steps)


def test_bench_at_a_step_beyond_the_run_exits_2_naming_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert tg.main(["--preset=tiny", "--bench_steps=1", "--bench_at_step=200"]) == 2
    assert "--bench_at_step" in capsys.readouterr().err


def bench_report(several_gpus_check, name: str) -> dict:
    """The benchmark report a trainer run of the several-GPU check printed (its only JSON line)."""
    run = several_gpus_check["runs"][name]
    assert run.failure is None, run.output[-3000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("{")]
    return json.loads(line)


@pytest.mark.slow
def test_activation_checkpointing_bench_losses_equal_the_plain_ones(several_gpus_check):
    """The same seed and random tokens: recomputing blocks changes no loss (fp32, CPU: exactly). The
    check's checkpointed benchmark (2 timed steps at step 0) runs the plain one's first 4 steps."""
    checkpointed = bench_report(several_gpus_check, "bench with activation checkpointing")["points"][0]
    plain = bench_report(several_gpus_check, "bench, 1 GPU(s)")["points"][0]
    assert checkpointed["step"] == plain["step"] == 0 and len(checkpointed["losses"]) == 4
    assert checkpointed["losses"] == plain["losses"][:4]


@pytest.mark.slow
def test_bench_on_two_processes_prints_once_and_sees_the_same_losses(several_gpus_check):
    """torchrun with 2 gloo processes (the several-GPU check's benchmark): rank 0 alone prints; each
    step draws the whole step's slices and each rank takes its own, so every loss of every point is
    the one-process run's bit for bit. Both run with Adam stepping every step: then each reduction
    across ranks is a sum of two terms (the two slices' gradients; the report's losses, summed in
    fp32 as one process sums its halves), exact in either order, and every other operation sees the
    same shapes at the same thread count. (Adam on odd steps only adds four terms in another order
    on two processes, which no tolerance bounds once the points train on from each other:
    docs/scale.md, "Which resumes are bit for bit", gives a measured case.)"""
    two, one = (bench_report(several_gpus_check, f"bench, {n} GPU(s)") for n in (2, 1))
    output = several_gpus_check["runs"]["bench, 2 GPU(s)"].output
    (headline,) = [line for line in output.splitlines() if line.startswith("bench: ")]
    assert headline.startswith("bench: 2 process(es) on cpu")
    assert two["world_size"] == 2 and one["world_size"] == 1
    points = list(zip(two["points"], one["points"], strict=True))
    for two_point, single in points:
        assert two_point["step"] == single["step"] and two_point["losses"] == single["losses"], two_point["step"]
        assert two_point["tokens_per_s"] == pytest.approx(2 * two_point["tokens_per_s_per_process"])
    # the collectives rank 0 ran in its last timed steps (189 and 188: after the split, the full
    # batch) are those the dry run counts on meta tensors for two ranks, call for call
    config = tg.make_config("tiny", adam_odd_steps_only=False, **FOUR_BLOCKS)
    counted = lambda odd: tg.ledger_summary(tg.step_collectives(config, 2, odd, dtype=torch.float32))  # CPU weights
    assert two["collectives"] == {"even": counted(False), "odd": counted(True)}
    assert one["collectives"] == {}


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA H100 NVL", None),
                                       ("Tesla V100-SXM2-32GB", None)])
def test_peak_bf16_tflops_by_device_name(name, peak):
    assert tg.peak_bf16_tflops(name) == peak


# ---- tools/gpu_check.sh: in-process through gpu_check.main (each check is a trainer process anyway)


def run_gpu_check(capsys, *flags) -> tuple[int, str, str, dict]:
    """gpu_check on the CPU with the tiny preset: (exit code, stdout, stderr, the summary JSON)."""
    code = gpu_check.main(["--preset=tiny", "--device=cpu", *flags])
    out, err = capsys.readouterr()
    return code, out, err, json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_gpu_check_fails_with_the_reason_when_the_loss_is_not_finite(monkeypatch, capsys):
    """An attention scale of 1e38 turns every score into inf: nan losses from the first forward (the
    training run looks for them after every step, so it stops at the first). Nan from the first
    step does not depend on the step's size: one timed benchmark step and a 256-token batch
    throughout (the tiny grid's smallest; its full batch is 1,024 tokens), in 4 blocks (every block's
    attention has the scale)."""
    monkeypatch.setattr(gpu_check, "QUICK_BENCH_STEPS", 1)
    code, _, err, summary = run_gpu_check(capsys, "--quick", "--attn_scale=1e38", "--nonfinite_check_every=1",
                                          "--batch_schedule=256", *FOUR_BLOCK_FLAGS)
    assert code == 1
    assert not summary["ok"]
    assert "gpu_check: FAILED" in err and "non-finite" in err


@pytest.mark.slow
def test_gpu_check_with_several_gpus_repeats_the_checks_on_all_of_them(several_gpus_check):
    """Every check on one process, then the benchmark and the training run again on 2 processes,
    whose first losses match one process's. Without shards the training check trains on generated
    tokens. The step grid: a bench point per batch size, none of which compiles again after the
    warm-up, and a short training run (its extension steps dropped: 6 steps span the grid).
    (--quick's test runs the checks under the CPU's labels.)"""
    summary, out = several_gpus_check["summary"], several_gpus_check["out"]
    assert several_gpus_check["code"] == 0, [c["reason"] for c in summary["checks"] if not c["ok"]]
    names = [c["check"] for c in summary["checks"]]
    assert summary["ok"] and all(c["ok"] for c in summary["checks"])
    for step, window in zip(BENCH_POINTS, BENCH_WINDOWS):
        assert f"bench, 1 GPU(s), step {step} (window {window})" in names
    for step in BENCH_POINTS[1:]:
        assert f"step {step} after step 0, 1 GPU(s)" in names
    for expected in ("compiled graphs after warm-up, 1 GPU(s)", "into evaluation, 1 GPU(s)", "peak memory, 1 GPU(s)",
                     "activation checkpointing: first losses", "training 6 steps, 1 GPU(s)"):
        assert expected in names
    training = next(c for c in summary["checks"] if c["check"] == "training 6 steps, 1 GPU(s)")
    assert "generated tokens" in training["measured"]
    assert "check  " in out and "result" in out  # the table's header
    for label in ("1 GPU(s)", "2 GPU(s)"):
        assert f"bench, {label}, step 0 (window 3)" in names and f"training 6 steps, {label}" in names
    assert "2 GPU(s) vs 1: first bench losses" in names


def test_gpu_check_sh_refuses_a_bad_flag_with_exit_code_2_in_one_line():
    """The shell wrapper end to end: the trainer's own parser checks the flags."""
    env = {k: v for k, v in os.environ.items() if k not in gpu_check.LAUNCHER_VARIABLES}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--num_iterations=0"],
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: --num_iterations")


def test_generated_training_tokens_follow_a_sparse_markov_chain(tmp_path):
    """The training check's tokens without shards: every token (but end-of-text) is followed by at
    most 8 distinct tokens, and documents end about once in 128 tokens."""
    gpu_check.write_markov_shards(tmp_path, vocab_size=300, eot_token=299, train_tokens=200_000, val_tokens=5_000)
    train = tg.read_shard(tmp_path / "generated_train_000001.bin").numpy().astype(np.int64)
    assert tg.read_shard(tmp_path / "generated_val_000000.bin").numel() == 5_000 and train.size == 200_000
    assert train.max() < 300
    pairs = np.unique(np.stack([train[:-1], train[1:]]), axis=1)
    inside = pairs[:, (pairs[0] != 299) & (pairs[1] != 299)]
    successors = np.bincount(inside[0], minlength=299)
    assert 0 < successors.max() <= 8
    assert (train == 299).mean() == pytest.approx(1 / 128, rel=0.2)


def test_gpu_check_compares_with_the_record_of_the_recipe():
    bulk = tg.make_config()
    assert gpu_check.is_record_shape(bulk) and not gpu_check.is_record_shape(TINY)
    assert not gpu_check.is_record_shape(tg.make_config(batch_schedule=(524288,)))
    # the bulk record's log: 72 ms per step at its first batch size, 249 at the full one (8 GPUs)
    assert gpu_check.record_ms_per_step(bulk, 0, 8) == "record (bulk): ~72 ms"
    assert gpu_check.record_ms_per_step(bulk, 2000, 8) == "record (bulk): ~249 ms"
    assert gpu_check.record_ms_per_step(bulk, 2000, 1) == "record (bulk): ~1,992 ms"
    # a claim's own log: PR #261 (mudd) reaches the full batch at its step 1032, 235 ms per step there
    mudd = tg.make_config(recipe="mudd")
    assert gpu_check.record_ms_per_step(mudd, 1031, 8) == "record (mudd): ~179 ms"
    assert gpu_check.record_ms_per_step(mudd, 1032, 1) == "record (mudd): ~1,880 ms"


def test_gpu_check_has_the_logged_step_time_of_every_recipe_at_each_of_its_batch_sizes():
    """Every live recipe (a record or claim, compared when the shapes are its own) has its own
    figure at each batch size its schedule reaches, and no figure for one it never runs."""
    assert set(gpu_check.RECORD_MS_PER_STEP_BY_BATCH) == set(tg.RECIPES)
    for recipe, by_batch in gpu_check.RECORD_MS_PER_STEP_BY_BATCH.items():
        config = tg.make_config(recipe=recipe)
        assert set(by_batch) == {tg.batch_tokens(step, config) for step in range(config.num_iterations)}, recipe


@pytest.mark.parametrize("recipe", sorted([*tg.RECIPES, *tg.CANDIDATES]))
def test_every_check_command_of_every_recipe_passes_the_config_check_at_the_medium_preset(recipe, tmp_path):
    """What gpu_check would start on a GPU machine: each command line is a valid trainer run (a value
    counting steps beyond the 20-step training check, as the record's 50-step momentum cool-down,
    is scaled to it rather than refused)."""
    argv = [f"--recipe={recipe}"]
    config = tg.parse_args(argv)
    data = [f"--train_files={tmp_path / 'train_*.bin'}", f"--val_files={tmp_path / 'val_*.bin'}"]
    for name, flags in gpu_check.check_commands(config, argv, data, tmp_path / "logs").items():
        checked = tg.parse_args(flags)
        tg.check_run_request(checked, torch.device("cpu"))
        if name == "training":
            assert checked.num_iterations == gpu_check.TRAIN_STEPS
            assert checked.muon_momentum_cooldown_steps <= checked.num_iterations
            assert checked.extension_steps < checked.num_iterations


def test_the_training_check_keeps_every_phase_of_the_bulk_recipe_at_its_length():
    """20 steps of the bulk recipe: an extension step, a momentum warm-up and cool-down, and the
    embedding split, each scaled from the record's 4740 steps (40, 300, 50, 785)."""
    short = tg.parse_args(gpu_check.short_run_flags(tg.make_config(recipe="bulk")) + ["--recipe=bulk"])
    assert (short.num_iterations, short.extension_steps) == (20, 1)
    assert (short.muon_momentum_warmup_steps, short.muon_momentum_cooldown_steps) == (1, 1)
    assert 0 < tg.untie_step(short) < short.num_iterations - 1  # the split happens within the check
    assert len(set(map(lambda s: tg.batch_tokens(s, short), range(20)))) == 4  # every batch size of the ramp


# ---- tools/gpu_check.sh --quick: two processes, one phase each


@pytest.mark.slow
def test_the_quick_check_gives_its_verdict_from_a_benchmark_and_a_one_phase_training_run(tmp_path, monkeypatch,
                                                                                        capsys):
    """Without shards the training run trains on generated tokens; one benchmark point (the first
    full-batch step, 47 in the tiny grid) and a short training run validated once, whose validation
    loss must fall below its step-0 loss. Fewer steps than gpu_check's own (4 timed, 10 training):
    2 timed steps (one of each parity) and 5 training steps give the same rows; on the bulk layout
    in 4 blocks (FOUR_BLOCK_FLAGS, passed to both runs), which the rows do not depend on."""
    monkeypatch.setattr(gpu_check, "QUICK_BENCH_STEPS", 2)
    monkeypatch.setattr(gpu_check, "QUICK_TRAIN_STEPS", 5)
    code, out, err, summary = run_gpu_check(capsys, "--quick", f"--train_files={tmp_path / 'none_*.bin'}",
                                            *FOUR_BLOCK_FLAGS)
    assert code == 0, out[-3000:] + err[-3000:]
    assert summary["ok"] and summary["quick"]
    names = [c["check"] for c in summary["checks"]]
    assert names == ["attention backends", "GPU class", "bench, CPU, step 47 (window 13)", "compiled graphs after warm-up, CPU", "into evaluation, CPU",
                     "peak memory, CPU", "allocator, CPU", "training 5 steps at one phase, CPU"]
    assert "generated tokens" in summary["checks"][-1]["measured"]
    assert f"(time limit {gpu_check.QUICK_TIMEOUT_S} s)" in out


@pytest.mark.parametrize("recipe", ["bulk", "mudd"])
def test_the_quick_checks_training_run_stays_in_the_bench_points_phase(recipe, tmp_path):
    """At the record's size: the benchmark times the first full-batch step (bulk: 1175), and every
    step of the training run has that step's batch, windows, loss and tie, so each process compiles
    one phase; coordinate-descent tuning is off in both, whatever the recipe sets."""
    argv = [f"--recipe={recipe}"]
    config = tg.parse_args(argv)
    step = gpu_check.first_full_batch_step(config)
    assert tg.batch_tokens(step, config) == config.batch_slices * config.train_seq_len
    assert tg.batch_tokens(step - 1, config) < tg.batch_tokens(step, config)
    if recipe == "bulk":
        assert step == 1175
    commands = gpu_check.quick_commands(config, argv, [], tmp_path / "logs")
    bench, training = (tg.parse_args(commands[name]) for name in ("bench", "training"))
    assert (bench.bench_at_step, bench.bench_steps) == (step, gpu_check.QUICK_BENCH_STEPS)
    assert not bench.coordinate_descent_tuning and not training.coordinate_descent_tuning
    assert training.num_iterations == gpu_check.QUICK_TRAIN_STEPS and training.val_every == 0
    phases = {tg.grid_phase(s, training) for s in range(training.num_iterations)}
    want = tg.grid_phase(step, config)
    loss_terms = len(tg.multi_token_weights(step, config)) if config.multi_token_prediction else 0
    assert phases == {(want[0], want[1], 0 if loss_terms == 1 else loss_terms, want[3])}
    assert tg.warmup_schedule(training) == [0]  # no change of the grid to visit: the first step only


def test_a_check_that_runs_out_of_time_is_stopped_with_a_line_saying_so_and_leaves_no_process(tmp_path):
    marker = f"--run_id=limit_{os.getpid()}"
    run = gpu_check.run_trainer("bench, CPU", ["--preset=tiny", "--device=cpu", "--bench_steps=1000", marker], 1,
                                time_limit=3)
    assert run.failure == ("bench, CPU: stopped at its time limit of 3 s before it finished "
                           "(more time: --time_limit=SECONDS)")
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == ""


@pytest.mark.parametrize("flag", ["--time_limit=0", "--time_limit=soon", "--time_limit"])
def test_gpu_check_refuses_a_time_limit_that_is_not_seconds(flag, capsys):
    assert gpu_check.main(["--preset=tiny", flag]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: --time_limit: ")


def test_the_allocator_settings_are_read_on_a_torch_that_cannot_report_them(monkeypatch):
    """torch 2.11 has no _accelerator_getAllocatorSettings: the settings then come from the variable
    the allocator read when CUDA started (the trainer sets it unless you did), and say so; torch 2.13
    reports what the allocator parsed."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    settings, source = tg.allocator_settings({"PYTORCH_ALLOC_CONF": tg.EXPANDABLE_SEGMENTS})
    assert settings == tg.EXPANDABLE_SEGMENTS and source.startswith("$PYTORCH_ALLOC_CONF (this torch does not")
    assert tg.allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})[0] == \
        "garbage_collection_threshold:0.6"
    assert tg.allocator_settings({})[0] == ""
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True", raising=False)
    assert tg.allocator_settings({}) == ("expandable_segments:True", "the allocator")


@pytest.mark.parametrize("settings,source,ok", [(None, "no CUDA allocator on the CPU", True),
                                                ("expandable_segments:True", "the allocator", True),
                                                ("", "no variable set (...)", False)])
def test_the_allocator_row_is_never_dropped(settings, source, ok, monkeypatch):
    for name in tg.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    line = gpu_check.allocator_row("1 GPU", dict(allocator_settings=settings, allocator_settings_source=source))
    assert line["check"] == "allocator, 1 GPU" and source in line["measured"] and line["ok"] is ok


def test_gpu_check_without_a_gpu_fails_the_gpu_class_row_for_the_medium_preset_and_runs_nothing(monkeypatch,
                                                                                                capsys):
    """On a CPU the medium preset's runs would be refused: the GPU class row says so (it said ok, then
    both runs failed), and no run is started; --preset tiny is the CPU's check. The machine is probed
    in this process, where CUDA is patched away, so that it has no GPU on any machine (the probe's
    own child process: the tests of the --quick and several-GPU checks)."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "probe_machine", gpu_check.machine_probe)
    started = []
    monkeypatch.setattr(gpu_check, "run_trainer", lambda *args: started.append(args))
    assert gpu_check.main(["--quick"]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gpu_class = next(c for c in summary["checks"] if c["check"] == "GPU class")
    assert not gpu_class["ok"] and "--preset tiny" in gpu_class["reason"] and started == []
