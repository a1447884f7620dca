"""The claim flow as a user lives it: `RUNS=N ./run.sh ...` -> a folder of its own and a one-screen
summary with the next command -> `records/stats.py <folder>` -> a verdict; a refusal to pool says how
to choose one experiment.

The trainer is replaced by a torch-free stand-in that writes a log in the trainer's format (config
lines, field groups, step lines) into the --log_dir it is given; run.sh and records/ are the real ones.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_records import FAIL_LOSSES, PASS_LOSSES, make_our_set, run_json

from records import stats as stats_cli

ROOT = Path(__file__).resolve().parents[1]

# Writes one finished log (one line per config field, the field groups, val and step lines) into
# --log_dir, with a fresh seed unless --seed is given, as the trainer does.
FAKE_TRAINER = r'''import json, random, sys, uuid
from pathlib import Path
args, flags = sys.argv[1:], {}
for i, a in enumerate(args):  # --field=value and --field value
    if a.startswith("--"):
        flags.update([a[2:].split("=", 1)] if "=" in a else [(a[2:], args[i + 1] if i + 1 < len(args) else "")])
config = {"preset": flags.get("preset", "medium"), "run_id": flags.get("run_id", ""),
          "seed": int(flags["seed"]) if "seed" in flags else random.randrange(2**31),
          "log_dir": flags.get("log_dir", "logs"), "num_iterations": 10, "muon_lr": 0.025, "device": "auto"}
groups = {"preset": "bookkeeping", "run_id": "bookkeeping", "seed": "bookkeeping", "log_dir": "bookkeeping",
          "num_iterations": "recipe", "muon_lr": "recipe", "device": "execution"}
rng = random.Random(config["seed"])
loss, ms = 2.918 + rng.uniform(-0.001, 0.001), 1400000 + rng.randrange(5000)
lines = ["# the trainer", "=" * 100, "Running PyTorch (stand-in)", "=" * 100]
lines += [f"config {k} = {v!r}" for k, v in config.items()]
lines += [f"config_groups = {json.dumps(groups)}", 'experiment_groups = ["recipe", "seed ideas", "execution"]']
lines += ["world_size 8, micro-steps per rank 1, device cuda"]
lines += [f"step:{s}/10 train_time:{ms * s // 10}ms step_avg:{ms / 10:.2f}ms" for s in range(1, 11)]
lines += [f"step:10/10 val_loss:{loss:.6f} train_time:{ms}ms step_avg:{ms / 10:.2f}ms"]
folder = Path(config["log_dir"])
folder.mkdir(parents=True, exist_ok=True)
(folder / f"{config['run_id'] or config['preset']}_{uuid.uuid4()}.txt").write_text("\n".join(lines) + "\n")
print(f"final val_loss {loss:.4f}")
'''


@pytest.fixture
def python(tmp_path):
    """A $PYTHON for run.sh: train_gpt_medium.py runs the stand-in, anything else the real interpreter."""
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    script = tmp_path / "python"
    script.write_text(f'#!/usr/bin/env bash\nif [ "$1" = train_gpt_medium.py ]; then shift; '
                      f'exec {shlex.quote(sys.executable)} {shlex.quote(str(trainer))} "$@"; fi\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    return script


def run_sh(python, args, runs):
    env = {k: v for k, v in os.environ.items() if k not in ("RUNS", "NPROC_PER_NODE", "NNODES")}
    env.update(PYTHON=str(python), CUDA_VISIBLE_DEVICES="", RUNS=str(runs))
    return subprocess.run([str(ROOT / "run.sh"), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def run_name():
    """A --run_id whose batch folder under the repository's logs/ is removed after the test."""
    name = f"pytest-{uuid.uuid4().hex[:8]}"
    yield name
    for folder in (ROOT / "logs").glob(f"{name}-*"):
        shutil.rmtree(folder)


def test_runs_batch_gets_its_own_folder_a_summary_and_the_next_command(python, run_name, capsys):
    proc = run_sh(python, [f"--run_id={run_name}"], runs=3)
    assert proc.returncode == 0, proc.stderr
    (folder,) = (ROOT / "logs").glob(f"{run_name}-*")
    assert re.fullmatch(rf"{run_name}-\d{{8}}-\d{{6}}", folder.name)
    assert f"run.sh: 3 run(s) into logs/{folder.name}/" in proc.stderr
    out = proc.stdout.splitlines()
    head = out.index(f"batch: logs/{folder.name}: 3 finished run(s) of 3 asked")
    rows = out[head + 2:head + 5]
    seeds = [row.split()[1] for row in rows]
    assert len(set(seeds)) == 3 and all(s.isdigit() for s in seeds)  # a fresh seed per run
    assert all(re.search(r" 2\.91\d{4} +14\d\d\.\d{3}s  " + run_name + r"_", row) for row in rows), rows
    assert out[-1] == f"next: python records/stats.py logs/{folder.name} --time-vs bulk"
    # the command it prints gives the verdict on exactly these runs
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        code = stats_cli.main(shlex.split(out[-1])[2:] + ["--json"])
    finally:
        os.chdir(cwd)
    data = json.loads(capsys.readouterr().out)
    assert data["val_loss"]["n"] == 3 and sorted(r["path"].split("/")[-1] for r in data["runs"]) == \
        sorted(row.split()[-1] for row in rows)
    assert code == 1 and data["time_vs"]["holds"] is False  # 1400 s runs are not faster than bulk's 1041 s


def test_a_batch_into_a_given_folder_with_older_logs_names_its_own_files(python, tmp_path):
    folder = tmp_path / "logs"
    make_our_set(folder, PASS_LOSSES[:2])
    old = set(folder.iterdir())
    for log in old:  # written before the batch started
        os.utime(log, (1, 1))
    proc = run_sh(python, ["--preset", "tiny", "--log_dir", str(folder)], runs=2)
    assert proc.returncode == 0, proc.stderr
    new = sorted(set(folder.glob("*.txt")) - old)  # the logs (run.sh also marks the folder as the batch's)
    assert len(new) == 2 and "--log_dir=" not in proc.stderr
    assert f"run.sh: 2 run(s) into {folder}/" in proc.stderr
    command = shlex.split(proc.stdout.splitlines()[-1])
    assert command[:3] == ["next:", "python", "records/stats.py"] and command[-2:] == ["--time-vs", "bulk"]
    assert sorted(command[3:-2]) == list(map(str, new))
    assert "tiny runs: the statistics are real" in proc.stdout


def test_a_failed_batch_still_ends_with_its_summary(tmp_path, run_name):
    script = tmp_path / "python"
    script.write_text(f'#!/usr/bin/env bash\nif [ "$1" = train_gpt_medium.py ]; then echo boom >&2; exit 3; fi\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    proc = run_sh(script, [f"--run_id={run_name}"], runs=2)
    assert proc.returncode == 3 and "run 1 of 2 failed with exit status 3" in proc.stderr
    assert "not a folder of logs (no run wrote a log there)" in proc.stderr


# ---------------------------------------------------------------- choosing one experiment


@pytest.fixture
def mixed(tmp_path):
    folder = make_our_set(tmp_path / "logs", PASS_LOSSES[:4])
    make_our_set(folder, FAIL_LOSSES[:3], first_seed=300, muon_lr=0.03)
    return folder


def test_a_refusal_gives_one_command_per_experiment(mixed, capsys):
    assert stats_cli.main([str(mixed)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: {mixed} holds 2 experiments (groups A, B") and "--pool" in err[0]
    assert err[1] == f"  python records/stats.py {mixed} --group A    # 4 run(s), muon_lr=0.025"
    assert err[2] == f"  python records/stats.py {mixed} --group B    # 3 run(s), muon_lr=0.03"


def test_group_tests_one_experiment(mixed, capsys):
    code, data = run_json(capsys, mixed, "--group", "A")
    assert code == 0 and data["refused"] is None and data["val_loss"]["n"] == 4
    assert sorted(r["val_loss"] for r in data["runs"]) == sorted(PASS_LOSSES[:4])
    code, data = run_json(capsys, mixed, "--group", "B")
    assert code == 1 and data["val_loss"]["n"] == 3


def test_an_unknown_group_names_the_groups(mixed, capsys):
    assert stats_cli.main([str(mixed), "--group", "C"]) == 2
    assert capsys.readouterr().err == f"error: --group C: {mixed} has no group C; its groups: A, B\n"


def test_the_default_batch_folder_is_named_after_the_preset(tmp_path):
    from test_records import fake_python, trainer_calls
    fake, calls = fake_python(tmp_path)
    proc = run_sh(fake, ["--preset", "tiny", "--val_every=3"], runs=2)
    assert proc.returncode == 0
    first, second = trainer_calls(calls)
    assert first == second and re.fullmatch(r"train_gpt_medium\.py --preset tiny --val_every=3 "
                                            r"--log_dir=logs/tiny-\d{8}-\d{6}(-\d+)?", first)
