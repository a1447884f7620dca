"""Several processes, gloo on the CPU, launched the way GPUs are (./run.sh -> torchrun): two
processes train exactly like one process accumulating two micro-steps, a checkpoint resumes bit for
bit on the same and on another world size, and a world size that does not divide the step's slices
is refused. (Muon's round-robin sharding over 4 processes: tests/test_exchange.py.)"""
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent
N = 6  # steps (4 scheduled + 2 extension: batches of 256, then 1024 tokens, the split after step 1);
# validation every 2, checkpoints at 4 and 6: a run resumed at 4 has the extension ahead of it
# The live recipe with Adam stepping every step: then the one cross-rank reduction of a step is a sum
# of two terms (g0/2 + g1/2), exact in either order, so world size 2 equals world size 1 with 2
# micro-steps bit for bit. With Adam on odd steps only (the default) Adam sums four terms, in step
# order on one process and rank by rank on two: equal up to fp32 rounding, tested in
# tests/test_bulk_recipe.py (test_two_processes_equal_accumulation_with_adam_on_odd_steps_...).
# The model: the bulk layout in 4 blocks (FOUR_BLOCK_FLAGS: every layer pattern once, so every kind of
# parameter and optimizer state is there); a bit-for-bit equality holds as strongly on 4 blocks as on 16.
RUN_FLAGS = ("--adam_odd_steps_only=false", *FOUR_BLOCK_FLAGS)
VAL_LINE = re.compile(r"^step:(\d+)/\d+ val_loss:(\d+\.\d{6}) train_time:(\d+)ms", re.M)
# Validation sums 2 slice losses (each ~6) in fp32 in a different order on 2 processes (per-rank
# sums, then an all-reduce) than on 1: the mean moves by at most a few fp32 ulps of ~24 / 2, and the
# log rounds to 6 decimals, so the logged values may differ by one unit of the last place. Measured:
# 1e-6 on the x01 recipe (5.884359 vs 5.884358), 0 on this run. Asserted:
VAL_TOLERANCE = 2e-6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """This process's environment without launcher variables, one thread per process."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def ctrl_c_at_default() -> None:
    """A Popen preexec_fn: SIGINT at its default action in the child, as in a terminal's foreground
    job. A shell that starts jobs in the background (`pytest ... &` from a script) hands them SIGINT
    ignored, and a process that starts with it ignored keeps it so (Python installs no
    KeyboardInterrupt handler, a shell cannot trap it): the Ctrl-C tests would see nothing stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_args(synthetic_dir, out: Path, *extra) -> list[str]:
    return ["--preset=tiny", "--device=cpu", "--seed=0", f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
            f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false",
            f"--num_iterations={N}", "--val_every=2", "--val_tokens=1024", "--warmup_steps=1", "--save_every=4",
            f"--log_dir={out / 'logs'}", f"--checkpoint_dir={out / 'ck'}", *extra]


def launch(commands: list[tuple[list[str], dict]], out: Path) -> Path:
    """Run the commands concurrently (the nodes of one job), require success, return the run's folder."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (cmd, env) in enumerate(commands):
        with open(out / f"proc{i}.out", "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (out / f"proc{i}.out").read_text()[-3000:]
    return out


def one_and_two_processes(argv, one: Path, two: Path) -> tuple[Path, Path]:
    """The same run as one plain process (2 micro-steps per step) into `one` and as two processes
    (./run.sh with NPROC_PER_NODE=2: torchrun --standalone) into `two`; argv(out) is the run's
    flags writing under out."""
    launch([([sys.executable, "train_gpt_medium.py", *argv(one)], clean_env())], one)
    launch([(["./run.sh", *argv(two)], clean_env(NPROC_PER_NODE="2"))], two)
    return one, two


def body(out: Path) -> str:
    (log,) = (out / "logs").glob("*.txt")
    return log.read_text().split("=" * 100 + "\n")[-1]


def val_losses(out: Path) -> dict[int, str]:
    return {int(m[1]): m[2] for m in VAL_LINE.finditer(body(out))}


def step0_train_loss(out: Path) -> float:
    return float(re.search(r"^step0_train_loss:(\S+)$", body(out), re.M)[1])


def checkpoint_tensors(folder: Path) -> dict:
    """Everything a checkpoint restores, by name, independent of how it is split into rank files."""
    main = torch.load(folder / "main.pt", weights_only=True)
    out = {f"model/{k}": v for k, v in main["model"].items()}
    for i, opt in enumerate(main["optimizers"]):  # the replicated ones (Adam)
        out.update({f"opt{i}/{n}/{k}": v for n, s in opt.items() for k, v in s.items()})
    adam_rows: dict[str, list] = {}
    for rank_file in sorted(folder.glob("rank_*.pt")):
        saved = torch.load(rank_file, weights_only=True)
        for name, s in saved["muon"].items():
            out.update({f"muon/{name}/{k}": v for k, v in s.items()})
        for name, piece in saved.get("adam", {}).items():  # Adam's sharded rows: put together by row
            adam_rows.setdefault(name, []).append(piece)
    for name, pieces in adam_rows.items():
        pieces.sort(key=lambda piece: piece["rows"][0])
        for k, v in pieces[0]["state"].items():
            out[f"opt0/{name}/{k}"] = torch.cat([p["state"][k] for p in pieces]) if torch.is_tensor(v) else v
    out["loader"], out["step"] = main["loader"], main["step"]
    return out


def whole_adam_state(rank_states: list[dict], like: dict) -> dict:
    """all_state of W ranks (tests/test_training.py) as one process holds it: where a rank's Adam
    tensor (opt0/...) has fewer rows than the one-process state `like` has, the ranks' rows put
    together in rank order (the sharded moments); everything else as rank 0 holds it."""
    out = dict(rank_states[0])
    for k, v in like.items():
        if k.startswith("opt0/") and torch.is_tensor(v) and out[k].shape != v.shape:
            out[k] = torch.cat([states[k] for states in rank_states])
    return out


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def one_process(synthetic_dir, tmp_path_factory):
    """The reference: one plain process (no process group), 2 micro-steps per step; in this process
    (tg.main: the launch is not what it shows)."""
    out = tmp_path_factory.mktemp("one_process")
    assert tg.main(run_args(synthetic_dir, out, *RUN_FLAGS)) == 0
    return out


@pytest.fixture(scope="module")
def two_nodes(synthetic_dir, tmp_path_factory):
    """World size 2 as two 'nodes' of one process each: ./run.sh's multi-node path (NNODES,
    NODE_RANK, MASTER_ADDR, MASTER_PORT) through torchrun's static rendezvous, over localhost."""
    out = tmp_path_factory.mktemp("two_nodes")
    port = str(free_port())
    nodes = [(["./run.sh", *run_args(synthetic_dir, out, *RUN_FLAGS)],
              clean_env(NNODES="2", NODE_RANK=str(r), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    return launch(nodes, out)


# ---- world size 2 = world size 1 with 2 micro-steps


@pytest.mark.slow
def test_two_processes_log_the_same_losses_as_one_process_with_two_micro_steps(one_process, two_nodes):
    one, two = val_losses(one_process), val_losses(two_nodes)
    assert sorted(one) == sorted(two) == [0, 2, 4, 6]
    diffs = {s: abs(float(one[s]) - float(two[s])) for s in one}
    assert max(diffs.values()) <= VAL_TOLERANCE, diffs
    # the first step's training loss is the mean over both slices on both (the 2 ranks' means, averaged)
    assert step0_train_loss(two_nodes) == pytest.approx(step0_train_loss(one_process), abs=VAL_TOLERANCE)
    assert "world_size 2, micro-steps per rank 1" in body(two_nodes)
    assert "world_size 1, micro-steps per rank 2" in body(one_process)


@pytest.mark.slow
def test_two_processes_train_to_bit_identical_parameters_and_optimizer_states(one_process, two_nodes):
    """Stronger than the losses: the only cross-rank reduction in training is the gradient
    all-reduce, a sum of two terms (g0/2 + g1/2), which is exact-commutative; one process adds the
    same two terms while accumulating. So every parameter, Adam moment and Muon (NorMuon) buffer is
    the same, before and after the embedding split and the batch change."""
    config = tg.parse_args(run_args(Path("unused"), Path("unused"), *RUN_FLAGS))
    assert tg.untie_step(config) == 1 and tg.batch_tokens(0, config) < tg.batch_tokens(1, config)
    assert {name: getattr(config, name) for name in FOUR_BLOCKS} == FOUR_BLOCKS
    for step in (4, N):
        assert_bit_identical(checkpoint_tensors(one_process / "ck/tiny" / f"step_{step:06d}"),
                             checkpoint_tensors(two_nodes / "ck/tiny" / f"step_{step:06d}"))


# ---- resume


@pytest.mark.slow
def test_resume_on_two_processes_is_bit_identical_to_the_uninterrupted_run(two_nodes, synthetic_dir, tmp_path):
    """A new 2-process job (./run.sh with NPROC_PER_NODE=2: torchrun --standalone) resumes the
    uninterrupted run's step-4 checkpoint and runs to its end (step 6)."""
    saved = two_nodes / "ck/tiny/step_000004"
    launch([(["./run.sh", *run_args(synthetic_dir, tmp_path, *RUN_FLAGS, f"--resume={saved}")],
             clean_env(NPROC_PER_NODE="2"))], tmp_path)
    log = body(tmp_path)
    saved_ms = torch.load(saved / "main.pt", weights_only=True)["train_time_ms"]
    assert f"resumed from {saved} at step 4/{N}, train_time {saved_ms:.0f}ms (saved by 2 process(es), now 2)" in log
    resumed, uninterrupted = val_losses(tmp_path), val_losses(two_nodes)
    assert sorted(resumed) == [4, 6]
    assert resumed == {s: uninterrupted[s] for s in resumed}
    assert int(VAL_LINE.search(log)[3]) >= int(saved_ms)  # the clock continues from the saved time
    assert_bit_identical(checkpoint_tensors(tmp_path / f"ck/tiny/step_{N:06d}"),
                         checkpoint_tensors(two_nodes / f"ck/tiny/step_{N:06d}"))


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_resumes_on_one(one_process, two_nodes, synthetic_dir, tmp_path):
    """The Muon state saved in two rank files is re-dealt to one process (this one: tg.main): the run
    ends exactly where the uninterrupted 1-process run (bit-identical to the 2-process one, see
    above) ends."""
    saved = two_nodes / "ck/tiny/step_000004"
    assert tg.main(run_args(synthetic_dir, tmp_path, *RUN_FLAGS, f"--resume={saved}")) == 0
    assert "(saved by 2 process(es), now 1)" in body(tmp_path)
    assert_bit_identical(checkpoint_tensors(tmp_path / f"ck/tiny/step_{N:06d}"),
                         checkpoint_tensors(one_process / f"ck/tiny/step_{N:06d}"))


# ---- a job on several forked processes (tests/test_exchange.py, test_bulk_optim.py, ...)

# The ranks are forked from the test's process: they start with torch and the trainer imported (a
# spawned process spends ~3 s of CPU importing them, most of a small job's cost). Safe here: the
# parent holds no process group, and its one intra-op thread leaves OpenMP no pool to inherit.
RANK_START_METHOD = "fork"


def _rank_worker(rank: int, world_size: int, port: int, out: Path, job) -> None:
    """One rank of a gloo group on localhost: saves job(rank, world_size) as out/rank<rank>.pt."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.save(job(rank, world_size), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # The result is on disk; leave without interpreter shutdown. A gloo worker thread may still be
    # dropping its reference to an all-gather's tensors, which needs the GIL; on a loaded 2-core
    # machine it can be descheduled until the interpreter is finalizing, and a thread that takes
    # the GIL then is ended by pthread_exit inside a noexcept destructor: std::terminate, SIGABRT
    # (seen in CI about once in 50 runs, core dump: ~AsyncAllgatherWork -> decref_pyobject ->
    # take_gil -> PyThread_exit_thread). destroy_process_group does not join those threads here.
    os._exit(0)


def on_ranks(job, world_size: int, out: Path) -> list:
    """job(rank, world_size) (a module-level function) on world_size forked processes of one gloo
    group; each rank's result, by rank (saved under out)."""
    torch.multiprocessing.start_processes(_rank_worker, args=(world_size, free_port(), out, job), nprocs=world_size,
                                          start_method=RANK_START_METHOD)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


# ---- world sizes that cannot work


def test_world_size_3_is_refused_with_the_valid_sizes(synthetic_dir, tmp_path, monkeypatch, capsys):
    """What each of 3 torchrun processes sees: refused before a process group or a log exists."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tg.main(run_args(synthetic_dir, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "world size 3 does not divide --batch_slices=2: run 1 or 2 processes in all" in err
    assert not dist.is_initialized() and not (tmp_path / "logs").exists()
