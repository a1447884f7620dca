"""Seed-matched ablations and interleaved A/Bs: run trainer configurations (or whole commands) x seeds,
then compare the arms.

    python records/ablate.py --preset tiny --grid lore_input=false,true --grid lore_output=false,true \\
        --seeds 1,2,3 [--launcher "./run.sh"] [--out DIR] [--baseline ARM] \\
        [--band-loss 0.002] [--band-time 1.05] [--band-metric loss|bpb] [--dry_run] [-- extra trainer flags]
    python records/ablate.py --arm base=./run.sh --arm cand="./run.sh --recipe mudd" \\
        --arm up="TRAINER=records/x01_lineage/train_gpt_medium.py ./run.sh" --seeds 1,2,3,4,5 \\
        [--preset medium] [--out DIR] [--baseline NAME] [--target 2.92] [--dry_run] [-- flags for every arm]
    python records/ablate.py --report-only --out DIR [--baseline ARM] [--band-loss X] [--band-time R]

A grid arm is one combination of the --grid values (the grid is their product, in the order given).
--grid FIELD=V1,V2 splits on commas; values that hold commas themselves (value_embed_layout) are
separated by semicolons instead: --grid 'value_embed_layout=0,1,2,...;0,0,1,...'.
An A/B arm (--arm NAME=COMMAND, two or more) is a whole command: a launcher and its flags, with
NAME=VALUE launcher settings in front (TRAINER=..., NPROC_PER_NODE=...; `env` in front works too).
Its script takes the sweep's flags (--preset, --seed, --run_id, --log_dir and the flags after --)
when it is a trainer of this project's kind (a make_config, a parse_args and a Hyperparameters
dataclass with run_id and log_dir: the live script, the frozen x01 one); a script of another kind
(upstream's record scripts) gets no flags, and its log is picked up from the logs/ folder it writes
into.
Runs go seed-major (every arm of seed 1, then every arm of seed 2, ...; each seed's block starts
one arm later than the one before: A B, B A, A B for two arms), so drift of the machine hits all
arms alike. Every arm of a seed gets the same --seed (an A/B: where its script takes one): the
trainer derives each parameter's init from the seed and the parameter's name, so the tensors two
arms share start identical. In an A/B the k-th seed makes slot k, and the arms are compared paired
by slot.
Each grid run is one launcher call logging to <out>/logs/<arm>/seed<S>/ (with stdout.log, stderr.log
and run.json beside the log); each A/B run logs to <out>/<arm>/ (so records/stats.py reads an arm's
folder like any folder of logs), with its stdout.log, stderr.log and run.json in <out>/<arm>/slot<k>/.
Runs that already hold a finished log of the same experiment and seed are skipped, so rerunning an
interrupted sweep completes only what is missing; each finished log is read once (records/runlogs.py
caches it). Results: <out>/runs.csv, <out>/report.md and <out>/report.json (the same statistics at
full precision); an A/B also draws <out>/slots.png (training time per slot and arm).
Stopping the sweep (Ctrl-C, SIGTERM, even SIGKILL on Linux) stops the run it was making, and every
process that run started (each run is a process group of its own, led by a guard that ends the
group when the sweep dies).
Exit status: 0 all runs finished (or --dry_run, --report-only), 1 some run failed, 2 unusable input,
130 / 143 interrupted by SIGINT / SIGTERM.
"""

import argparse
import ast
import csv
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import tqdm  # noqa: E402

from records import runlogs, stats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LAUNCHER = str(REPO / "run.sh")
# Trainer modes that make a run something else than a fresh training run; no arm or extra flag may set them.
NOT_TRAINING = ("dry_run", "resume", "bench_steps")
QUALITY = {"loss": "val_loss", "bpb": "val_bpb"}
COMPARED = ("val_loss", "val_bpb", "train_time_s")  # metrics with paired and Welch tests in the report


class SweepError(Exception):
    """Input the sweep cannot use: a bad grid, flag or output folder. Nothing has run yet."""


# -----------------------------------------------------------------------------
# The sweep: arms, seeds and the runs they make

@dataclass(frozen=True)
class Arm:
    """One configuration of the grid: (field, value text) pairs in grid order."""

    settings: tuple

    @property
    def name(self) -> str:
        """Folder-safe name, e.g. lore_input-true__lore_output-false ('default' for an empty grid)."""
        parts = [f"{f}-{re.sub(r'[^A-Za-z0-9._-]', '_', v)}" for f, v in self.settings]
        return "__".join(parts) or "default"

    @property
    def label(self) -> str:
        return " ".join(f"{f}={v}" for f, v in self.settings) or "default"

    @property
    def flags(self) -> list[str]:
        return [f"--{f}={v}" for f, v in self.settings]


@dataclass(frozen=True)
class CommandArm:
    """One arm of an A/B: its name (its folder) and its command (a launcher and its flags)."""

    name: str
    command: str

    @property
    def label(self) -> str:
        return self.name


@dataclass
class Sweep:
    """What a sweep runs (saved as <out>/sweep.json, which --report-only reads back)."""

    preset: str
    grid: list  # [[field, [value, ...]], ...]
    seeds: list
    extra: list = field(default_factory=list)
    launcher: str = DEFAULT_LAUNCHER
    baseline: str | None = None
    band_loss: float | None = None
    band_time: float | None = None
    band_metric: str = "loss"
    commands: list = field(default_factory=list)  # [[name, command], ...]: an A/B of commands; [] for a grid
    target: float = stats.MEDIUM_TARGET  # an A/B's report: each arm's chance of a run below it

    @property
    def is_ab(self) -> bool:
        return bool(self.commands)

    def arms(self) -> list:
        if self.is_ab:
            return [CommandArm(name, command) for name, command in self.commands]
        fields_ = [f for f, _ in self.grid]
        return [Arm(tuple(zip(fields_, combo))) for combo in itertools.product(*(v for _, v in self.grid))]

    def baseline_arm(self):
        """The --baseline arm (by name or label), else the first arm."""
        arms = self.arms()
        if self.baseline is None:
            return arms[0]
        for arm in arms:
            if self.baseline in (arm.name, arm.label):
                return arm
        raise SweepError(f"--baseline {self.baseline!r} is not an arm; arms: {', '.join(a.name for a in arms)}")


@dataclass(frozen=True)
class Run:
    arm: Arm | CommandArm
    seed: int
    folder: Path  # the run's own files: stdout.log, stderr.log, run.json (a grid run's log too)
    slot: int | None = None  # an A/B: the slot (1, 2, ...: the seed's place in --seeds); None in a grid
    log_dir: Path | None = None  # an A/B: the arm's folder, which its logs go to; None: `folder`

    @property
    def run_id(self) -> str:
        return f"{self.arm.name}_slot{self.slot}" if self.slot is not None else f"{self.arm.name}_s{self.seed}"

    @property
    def logs_folder(self) -> Path:
        return self.log_dir or self.folder

    @property
    def pair(self) -> int:
        """What pairs this run with the other arms' runs: its slot in an A/B, its seed in a grid."""
        return self.slot if self.slot is not None else self.seed

    def logs(self) -> list[Path]:
        """This run's log files, oldest first: every *.txt of a grid run's folder; an A/B run's
        <run_id>_*.txt in its arm's folder (which holds the other slots' logs too)."""
        pattern = f"{self.run_id}_*.txt" if self.slot is not None else "*.txt"
        return sorted(self.logs_folder.glob(pattern), key=lambda p: p.stat().st_mtime)


def plan(sweep: Sweep, out: Path) -> list[Run]:
    """Every run in launch order: seed-major; the k-th seed starts at the k-th arm (arms rotated), so
    no arm always runs first in its block, where a slower or faster machine state would bias it
    (two arms: A B, B A, A B, ...)."""
    arms = sweep.arms()
    order = [(k, seed, arm) for k, seed in enumerate(sweep.seeds) for arm in arms[k % len(arms):] + arms[:k % len(arms)]]
    if sweep.is_ab:
        return [Run(arm, seed, out / arm.name / f"slot{k + 1}", slot=k + 1, log_dir=out / arm.name)
                for k, seed, arm in order]
    return [Run(arm, seed, out / "logs" / arm.name / f"seed{seed}") for k, seed, arm in order]


def trainer_flags(sweep: Sweep, run: Run) -> list[str]:
    return [f"--preset={sweep.preset}", *run.arm.flags, f"--seed={run.seed}", f"--run_id={run.run_id}",
            f"--log_dir={run.folder}", *sweep.extra]


def command(sweep: Sweep, run: Run) -> list[str]:
    """The words the run executes (an A/B arm's launcher settings not included: settings() has them)."""
    if sweep.is_ab:
        arm = arm_launch(run.arm)
        return [*arm.words, *ab_flags(sweep, run, arm)]
    return [*shlex.split(sweep.launcher), *trainer_flags(sweep, run)]


def settings(sweep: Sweep, run: Run) -> dict[str, str]:
    """The environment variables the run's command sets for itself (an A/B arm's NAME=VALUE words)."""
    return dict(arm_launch(run.arm).settings) if sweep.is_ab else {}


def shown_command(sweep: Sweep, run: Run) -> str:
    """The run's command as a shell line one can paste (its settings in front, through env)."""
    env = [f"{k}={v}" for k, v in settings(sweep, run).items()]
    return shlex.join((["env", *env] if env else []) + command(sweep, run))


def parse_grid(text: str) -> list:
    """'field=v1,v2' (or 'field=v1;v2' when values hold commas) -> [field, [v1, v2]]."""
    name, eq, values = text.partition("=")
    sep = ";" if ";" in values else ","
    items = [v.strip() for v in values.split(sep)]
    if not eq or not name or not all(items):
        raise SweepError(f"--grid {text!r}: write FIELD=VALUE1,VALUE2 (e.g. --grid lore_input=false,true)")
    if len(set(items)) != len(items):
        raise SweepError(f"--grid {text!r}: a value is listed twice")
    return [name, items]


def joined_seeds(argv: list[str]) -> list[str]:
    """`--seeds -1,2` as `--seeds=-1,2`: argparse takes a value that starts with '-' for a flag (and
    says "expected one argument"); joined, parse_seeds says what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] == "--seeds" and re.fullmatch(r"-[\d,\s-]+", arg):
            out[-1] = f"--seeds={arg}"
        else:
            out.append(arg)
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: expected comma-separated integers, e.g. --seeds 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: give at least one seed, each once")
    if min(seeds) < 0:
        raise SweepError(f"--seeds {text!r}: a seed is at least 0 (the trainer's --seed), e.g. --seeds 1,2")
    return seeds


# -----------------------------------------------------------------------------
# An A/B arm's command: what it runs, and which flags its script takes (read, never run)

OURS, FOREIGN, LAUNCHER = "this project's trainer", "a script of another kind", "a launcher"
AB_SET = ("preset", "seed", "run_id", "log_dir")  # the flags an A/B passes to a trainer of this project's kind
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_SETTING = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.S)


def parse_arm(text: str) -> list[str]:
    """'NAME=COMMAND' -> [name, command]; SweepError for a bad name or an empty command."""
    name, eq, command_text = text.partition("=")
    if not eq or not name:
        raise SweepError(f"--arm {text!r}: write NAME=COMMAND, e.g. --arm base=./run.sh --arm cand='./run.sh --recipe mudd'")
    if not ARM_NAME.fullmatch(name):
        raise SweepError(f"--arm {text!r}: write NAME=COMMAND with a NAME of letters, digits, - and _ (it names "
                         "the arm's folder), e.g. --arm cand='./run.sh --recipe mudd'")
    if not command_text.strip():
        raise SweepError(f"--arm {text!r}: the command is empty; e.g. --arm {name}=./run.sh")
    return [name, command_text.strip()]


def check_arm_names(arms: list[list[str]]) -> None:
    if len(arms) < 2:
        raise SweepError(f"--arm: an A/B needs two arms or more, got {len(arms)}; add another --arm NAME=COMMAND")
    seen = {}
    for name, _ in arms:
        if name.casefold() in seen:
            raise SweepError(f"--arm {name}: the name is given twice (as {seen[name.casefold()]!r} before); "
                             "give each arm a name of its own")
        seen[name.casefold()] = name


@dataclass(frozen=True)
class ArmLaunch:
    """What an arm's command runs."""

    settings: tuple  # ((NAME, VALUE), ...): the launcher settings in front of the program
    words: tuple  # the command from its program on
    script: Path | None  # the Python script it trains with, where the command names it (run.sh: TRAINER)
    kind: str  # OURS: takes the sweep's flags; FOREIGN: takes none; LAUNCHER: script unknown, takes them all
    fields: frozenset  # OURS: the fields of the script's Hyperparameters
    trainer_words: tuple  # the words its script reads as flags
    workdir: Path  # the folder its script runs in (run.sh changes to its own): a FOREIGN script's logs/ is there

    @property
    def takes(self) -> frozenset:
        """The sweep's own flags this arm's script takes."""
        return {OURS: frozenset(AB_SET) & self.fields, FOREIGN: frozenset(), LAUNCHER: frozenset(AB_SET)}[self.kind]


def script_kind(path: Path, where: str) -> tuple[str, frozenset]:
    """(OURS and its config fields) for a script with a top-level make_config and parse_args and a
    Hyperparameters class with run_id and log_dir fields; (FOREIGN, {}) for any other. Read with ast:
    never run."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except OSError as e:
        raise SweepError(f"{where}: cannot read the script {path}: {e.strerror or e}") from None
    except (SyntaxError, ValueError) as e:
        raise SweepError(f"{where}: the script {path} is not Python this interpreter reads ({e})") from None
    functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    fields_ = {s.target.id for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters"
               for s in n.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    if {"make_config", "parse_args"} <= functions and {"run_id", "log_dir"} <= fields_:
        return OURS, frozenset(fields_)
    return FOREIGN, frozenset()


@functools.lru_cache(maxsize=None)
def _arm_launch(name: str, text: str, cwd: str, trainer_env: str | None) -> ArmLaunch:
    where = f"--arm {name}={text!r}"
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise SweepError(f"{where}: the command does not parse as shell words ({e}); check its quotes") from None
    if words and Path(words[0]).name == "env":
        words = words[1:]
        if words and words[0].startswith("-"):
            raise SweepError(f"{where}: env's options are not read here; write the settings as NAME=VALUE words "
                             "(e.g. --arm up='TRAINER=path/to/script.py ./run.sh')")
    pairs = []
    while words and _SETTING.fullmatch(words[0]):
        pairs.append(_SETTING.fullmatch(words.pop(0)).groups())
    if not words:
        raise SweepError(f"{where}: no command after the settings; e.g. --arm {name}='{text} ./run.sh'")
    program = words[0]
    if shutil.which(program) is None:
        raise SweepError(f"{where}: {program} is not an executable here (not on PATH, or no such file with execute "
                         "permission); give its path from this folder, e.g. ./run.sh")
    env = dict(pairs)
    if "RUNS" in env:
        raise SweepError(f"{where}: RUNS= would make run.sh repeat the run; the A/B makes the runs itself "
                         "(one per --seeds entry): drop RUNS")
    if Path(program).name == "run.sh":
        home = Path(shutil.which(program)).resolve().parent
        trainer = env.get("TRAINER", trainer_env or "train_gpt_medium.py")
        script = home / trainer
        if not script.is_file():
            raise SweepError(f"{where}: TRAINER={trainer}: no such script in {home} (run.sh reads TRAINER from its "
                             "own folder); give its path from there, e.g. TRAINER=records/x01_lineage/train_gpt_medium.py")
        trainer_words, workdir = words[1:], home
    else:
        at = next((i for i, w in enumerate(words[1:], start=1) if w.endswith(".py")), None)
        script = None if at is None else Path(cwd) / words[at]
        if script is not None and not script.is_file():
            raise SweepError(f"{where}: {words[at]}: no such script (paths are from this folder, {cwd})")
        trainer_words, workdir = (words[at + 1:] if at is not None else words[1:]), Path(cwd)
    kind, fields_ = script_kind(script, where) if script is not None else (LAUNCHER, frozenset())
    return ArmLaunch(tuple(pairs), tuple(words), script, kind, fields_, tuple(trainer_words), workdir)


def arm_launch(arm: CommandArm) -> ArmLaunch:
    """The arm's command, read (cached per command, working folder and inherited TRAINER); SweepError
    when it cannot run: bad quotes, a program or a TRAINER script that is not there, RUNS=."""
    return _arm_launch(arm.name, arm.command, os.getcwd(), os.environ.get("TRAINER"))


def ab_flags(sweep: Sweep, run: Run, arm: ArmLaunch) -> list[str]:
    """The flags an A/B run adds to its arm's command: those of AB_SET its script takes, then the
    flags after -- (a FOREIGN script gets none of them)."""
    if arm.kind == FOREIGN:
        return []
    values = dict(preset=sweep.preset, seed=run.seed, run_id=run.run_id, log_dir=run.logs_folder)
    return [f"--{k}={values[k]}" for k in AB_SET if k in arm.takes] + list(sweep.extra)


def script_text(path: Path) -> str:
    """What a run of the script embeds in its log (its kernels file too, where it logs one)."""
    return runlogs.logged_source(path)


def foreign_logs(arm: ArmLaunch) -> dict[Path, int]:
    """{log: modification time in ns} of the *.txt files in the logs/ folder a FOREIGN script writes to."""
    folder = arm.workdir / "logs"
    return {p: p.stat().st_mtime_ns for p in folder.glob("*.txt") if p.is_file()} if folder.is_dir() else {}


def collect_foreign_log(arm: ArmLaunch, before: dict[Path, int], run: Run) -> list[Path]:
    """Move the logs that appeared (or changed) in the script's logs/ folder during the run, and that
    embed this script's source, into the arm's folder as <run_id>_<their name>; returns them."""
    digest = runlogs.script_digest(script_text(arm.script))
    moved = []
    for path, stamp in sorted(foreign_logs(arm).items(), key=lambda kv: kv[1]):
        if before.get(path) == stamp:
            continue
        source = runlogs.embedded_source(path.read_bytes().decode("utf-8", errors="replace"))
        if source is None or runlogs.script_digest(source) != digest:
            continue  # another program's file
        target = run.logs_folder / f"{run.run_id}_{path.name}"
        shutil.move(path, target)
        moved.append(target)
    return moved


# -----------------------------------------------------------------------------
# Reading a run's log (records/runlogs.py: one parse per log file)

def read_run(path: Path) -> tuple[runlogs.RunLog | None, str | None]:
    """(the log, None) for a finished log, (None, why not) otherwise."""
    try:
        log = runlogs.read_log(path)
    except runlogs.LogError as e:
        return None, str(e)
    return (log, None) if log.finished else (None, log.skip_reason)


# -----------------------------------------------------------------------------
# Run outcomes: finished, failed or not run yet

@dataclass
class Outcome:
    run: Run
    status: str  # finished | failed | not run
    metrics: runlogs.RunLog | None = None
    reason: str = ""


def last_line(path: Path) -> str:
    """The line of a failed run's stderr that says why: its last `error: ...` line (the trainer's
    refusal, which torchrun follows with its own report), else its last line."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or [""])[-1]


def inspect(run: Run) -> Outcome:
    """What the run's files say: the newest finished log wins; else run.json's exit code and stderr."""
    logs = run.logs() if run.logs_folder.is_dir() else []
    reads = [read_run(p) for p in logs]
    done = [m for m, _ in reads if m is not None]
    if done:
        return Outcome(run, "finished", done[-1])
    record = run.folder / "run.json"
    if not record.exists():
        return Outcome(run, "not run")
    made = json.loads(record.read_text())
    code = made["exit_code"]
    if code != 0:
        err = last_line(run.folder / "stderr.log")
        return Outcome(run, "failed", reason=f"exit {code}" + (f": {err}" if err else ""))
    if reads:
        why = reads[-1][1]
    elif made.get("looked_in"):
        why = f"no log of {made['script']} appeared in {made['looked_in']}"
    else:
        why = "no log written"
    return Outcome(run, "failed", reason=f"exit 0 but no finished log ({why})")


class Interrupted(Exception):
    """SIGTERM reached the sweep (SIGINT arrives as KeyboardInterrupt)."""


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when its parent dies
STOP_GRACE_S = 40  # after SIGTERM, the run's processes have this long before SIGKILL: more than the 30 s
# torchrun gives its workers (which sit in sessions of their own) before it kills them itself


def _die_with_parent():
    """For preexec_fn: on Linux, the child gets SIGTERM when the sweep dies, even by SIGKILL; if the
    sweep died before the child got there, the child leaves at once. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def setup():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(143)
    return setup


# The run's first process: the leader of a process group of its own (a new session) that starts the
# command in that group and waits for it. A SIGTERM (from the sweep, or from the kernel when the
# sweep died: parent-death signal) or a SIGINT goes to the whole group, so a command that started
# processes of its own (a shell script, run.sh's torchrun) leaves none behind. On Linux the guard is
# a subreaper: what the run started and left becomes its child, so after a stop it waits for all of
# it (torchrun ending its workers), not only for the command. The handler only signals and sets an
# alarm (waiting inside it would deadlock with the wait it interrupted); at the alarm, after the grace
# period, what still runs in the group is killed, the guard with it. The exit status is the command's
# (128 + N for signal N).
GUARD = """import ctypes, os, signal, subprocess, sys
grace = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
stopping = False
def stop(signum, frame):
    global stopping
    stopping = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
    signal.alarm(grace)
    os.killpg(0, signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
try:
    child = subprocess.Popen(sys.argv[2:])
except OSError as e:
    sys.exit(f"{sys.argv[2]}: cannot start: {e.strerror or e}")
if stopping:  # the stop came while the command was being started
    os.killpg(0, signal.SIGTERM)
code = child.wait()
if stopping:
    try:
        while True:
            os.wait()  # the rest of the run, until none is left (or the alarm kills the group)
    except ChildProcessError:
        pass
sys.exit(code if code >= 0 else 128 - code)
"""


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` run under GUARD."""
    return [sys.executable, "-c", GUARD, str(STOP_GRACE_S), *cmd]


def _stop(proc: subprocess.Popen) -> None:
    """Ask the run to stop (SIGTERM to its guard, which passes it to the run's processes; torchrun
    passes it to its workers), then kill the run's process group after the guard's grace period."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def launch(sweep: Sweep, run: Run) -> Outcome:
    """One launcher call, its output in the run's folder; a rerun first sets unfinished logs aside.
    An A/B run of a FOREIGN script: its log, found in the logs/ folder it writes to, is moved to the
    arm's folder (an unfinished one too). An interrupt of the sweep while the run goes on stops the
    run, then propagates."""
    run.folder.mkdir(parents=True, exist_ok=True)
    for old in run.logs():
        if read_run(old)[0] is None:
            old.rename(old.with_name(f"{old.name}.incomplete"))  # kept for a post-mortem, no longer read as a log
    cmd, own = command(sweep, run), settings(sweep, run)
    foreign = arm_launch(run.arm) if sweep.is_ab and arm_launch(run.arm).kind == FOREIGN else None
    before = foreign_logs(foreign) if foreign else {}
    record = dict(command=cmd, settings=own, started_at=time.strftime("%Y-%m-%d %H:%M:%S"), started_unix=time.time())
    if foreign:
        record.update(script=str(foreign.script), looked_in=str(foreign.workdir / "logs"))
    start = time.perf_counter()
    with open(run.folder / "stdout.log", "w") as out, open(run.folder / "stderr.log", "w") as err:
        env = {k: v for k, v in os.environ.items() if k != "RUNS"}  # run.sh would repeat the run RUNS times
        proc = subprocess.Popen(guarded(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={**env, **own},
                                start_new_session=True, preexec_fn=_die_with_parent())
        try:
            code = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            if foreign:
                record["logs"] = [str(p) for p in collect_foreign_log(foreign, before, run)]
    record.update(exit_code=code, wall_s=round(time.perf_counter() - start, 3),
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    (run.folder / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return inspect(run)


# -----------------------------------------------------------------------------
# Checks before anything runs

def flag_name(flag: str) -> str:
    return flag.lstrip("-").partition("=")[0]


def sweep_set_fields(sweep: Sweep) -> set[str]:
    """The fields the sweep passes to every run itself (preset, seed, run id, log folder)."""
    probe = Sweep(sweep.preset, [], [0])
    return {flag_name(f) for f in trainer_flags(probe, plan(probe, Path("."))[0])}


def check_out(out: Path) -> None:
    """--out must be a folder, or a path where one can be made: SweepError otherwise. Writes nothing."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out}: is a file, not a folder; give a folder (it is made if missing)")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise SweepError(f"--out {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SweepError(f"--out {out}: cannot write in {parent} (permission denied); choose another --out")


def check_sweep_flags(sweep: Sweep, out: Path) -> None:
    """The checks that need no trainer: fields set twice or owned by the sweep, arm names, the
    baseline, the launcher, the output folder. Raises SweepError naming the problem."""
    own = sweep_set_fields(sweep)
    for name, _ in sweep.grid:
        if name in own:
            raise SweepError(f"--grid {name}=...: the sweep sets --{name} itself; it cannot be an arm setting")
        if name in NOT_TRAINING:
            raise SweepError(f"--grid {name}=...: the runs of a sweep train from scratch; --{name} cannot be an arm setting")
    if len({name for name, _ in sweep.grid}) != len(sweep.grid):
        raise SweepError("--grid: a field is given twice; put all its values in one --grid FIELD=V1,V2")
    for flag in sweep.extra:
        if flag_name(flag) in own | set(NOT_TRAINING):
            raise SweepError(f"extra trainer flag {flag!r}: the sweep sets it itself or cannot use it "
                             "(use --preset / --seeds / --out)")
    sweep.baseline_arm()
    if len({a.name for a in sweep.arms()}) != len(sweep.arms()):
        raise SweepError("--grid: two arms map to the same folder name; use values that differ in letters or digits")
    launcher = shlex.split(sweep.launcher)
    if not launcher or shutil.which(launcher[0]) is None:
        raise SweepError(f"--launcher {sweep.launcher!r}: {launcher[0] if launcher else 'nothing'} is not an executable")
    check_out(out)


def expected_log(tg, config) -> runlogs.RunLog:
    """The config lines (and field groups) the trainer would log for `config`, read back by records/runlogs.py,
    so that arms and finished logs are compared by the same rule as everything else."""
    return runlogs.parse_text("\n".join(tg.config_lines(config)))


def check_sweep(sweep: Sweep, out: Path) -> None:
    """check_sweep_flags, then with the trainer: every arm a valid trainer config, arms that are
    different experiments, and no finished log in `out` of another experiment or seed than its
    run asks for. Raises SweepError naming the problem."""
    check_sweep_flags(sweep, out)
    sys.path.insert(0, str(REPO))
    import train_gpt_medium as tg  # imports torch: after every check that does not need it

    known = {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    for name, _ in sweep.grid:
        if name not in known:
            close = tg.close_field_names(name)
            hint = f"did you mean {' or '.join(close)}?" if close else "python train_gpt_medium.py --help lists them"
            raise SweepError(f"--grid {name}=...: unknown field {name!r} (fields are the trainer's flags); {hint}")
    experiments = {}
    for run in plan(sweep, out)[:len(sweep.arms())]:  # the first seed's block: validity does not depend on the seed
        try:
            cfg = tg.parse_args(trainer_flags(sweep, run))
        except tg.ConfigError as e:
            raise SweepError(f"arm {run.arm.label}: {e}") from None
        key = runlogs.experiment_config(expected_log(tg, cfg))
        twin = next((label for label, other in experiments.items() if other == key), None)
        if twin is not None:
            raise SweepError(f"arms {twin} and {run.arm.label} are the same configuration (the same experiment: "
                             "they differ in no field of the groups " + ", ".join(tg.EXPERIMENT_GROUPS) + ")")
        experiments[run.arm.label] = key
    for run in plan(sweep, out):
        outcome = inspect(run)
        if outcome.status != "finished":
            continue
        log = outcome.metrics
        expected = expected_log(tg, tg.parse_args(trainer_flags(sweep, run))).config
        checked = {**runlogs.experiment_config(log), **({"seed": log.seed} if log.seed is not None else {})}
        for name, text in checked.items():
            if name in expected and expected[name] != text:
                raise SweepError(f"--out {out}: {log.path} ran with {name} = {text}, this sweep asks for "
                                 f"{expected[name]}; use another --out (or delete that run's folder)")


def check_ab_flags(sweep: Sweep, out: Path) -> None:
    """An A/B's checks that need no trainer: every arm's command can run (its program and script
    are there), sets none of the flags the A/B sets itself, and takes the flags after -- when there
    are some; the baseline; the output folder. Raises SweepError naming the flag and the fix."""
    check_arm_names(sweep.commands)
    own = set(AB_SET) | set(NOT_TRAINING)
    for flag in sweep.extra:
        if flag_name(flag) in own:
            raise SweepError(f"extra trainer flag {flag!r}: the A/B sets it itself or cannot use it "
                             "(use --preset / --seeds / --out)")
    for arm in sweep.arms():
        launch_ = arm_launch(arm)
        if launch_.kind == FOREIGN and sweep.extra:
            raise SweepError(f"--arm {arm.name}: its script {launch_.script} takes no flags of this project (it is not "
                             f"a trainer of its kind), so the flags after -- ({' '.join(sweep.extra)}) would not reach "
                             "it; put them into the other arms' commands instead")
        if launch_.kind == FOREIGN:
            continue
        for word in launch_.trainer_words:
            if word.startswith("--") and flag_name(word) in own:
                raise SweepError(f"--arm {arm.name}: its command sets {word.partition('=')[0]}, which the A/B sets "
                                 "itself (--preset, and --seed, --run_id, --log_dir from --seeds and --out) or "
                                 "cannot use; drop it from the command")
    sweep.baseline_arm()
    check_out(out)


def check_ab(sweep: Sweep, out: Path) -> None:
    """check_ab_flags, then for each arm whose script is of this project's kind: its flags make a
    valid config (the script's own parse_args, imported, not run); and no finished log in `out` from
    another version of its script, or (scripts of this project's kind) of another experiment or
    seed than its run asks for. Raises SweepError naming the problem."""
    check_ab_flags(sweep, out)
    from records import diff  # its trainer loader: the live script as train_gpt_medium, others by their folder

    modules = {}
    for run in plan(sweep, out)[:len(sweep.arms())]:
        arm = arm_launch(run.arm)
        if arm.kind != OURS:
            continue
        try:
            module = modules[run.arm.name] = diff.load_trainer(arm.script)
        except diff.DiffError as e:
            raise SweepError(f"--arm {run.arm.name}: {e}") from None
        try:
            module.parse_args([*arm.trainer_words, *ab_flags(sweep, run, arm)])
        except (Exception, SystemExit) as e:
            raise SweepError(f"--arm {run.arm.name}: {e}") from None
    for run in plan(sweep, out):
        outcome = inspect(run)
        arm = arm_launch(run.arm)
        if outcome.status != "finished" or arm.script is None:
            continue
        log, now = outcome.metrics, runlogs.script_digest(script_text(arm.script))
        if log.script != now:
            raise SweepError(f"--out {out}: {log.path} was made by another version of {arm.script} (script "
                             f"{log.script}, now {now}); use another --out (or delete that log)")
        module = modules.get(run.arm.name)
        if module is None or not callable(getattr(module, "config_lines", None)):
            continue
        expected = runlogs.parse_text("\n".join(module.config_lines(
            module.parse_args([*arm.trainer_words, *ab_flags(sweep, run, arm)])))).config
        checked = {**runlogs.experiment_config(log), **({"seed": log.seed} if log.seed is not None else {})}
        for name, text in checked.items():
            if name in expected and expected[name] != text:
                raise SweepError(f"--out {out}: {log.path} ran with {name} = {text}, this A/B asks for "
                                 f"{expected[name]}; use another --out (or delete that log)")


# -----------------------------------------------------------------------------
# Statistics (all tests from records/stats.py)

def _values(outcomes: list[Outcome], metric: str) -> dict[int, float]:
    """{seed (an A/B: slot): value} of the finished runs that report the metric."""
    return {o.run.pair: getattr(o.metrics, metric) for o in outcomes
            if o.status == "finished" and getattr(o.metrics, metric) is not None}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def compare(base: list[Outcome], arm: list[Outcome], metric: str) -> dict | None:
    """B - A for one metric: per-seed (an A/B: per-slot) deltas, the paired test over the seeds both
    finished, Welch over all runs."""
    a, b = _values(base, metric), _values(arm, metric)
    if not a or not b:
        return None
    seeds = [s for s in a if s in b]
    paired = stats.paired_test([a[s] for s in seeds], [b[s] for s in seeds]) if len(seeds) >= 2 else None
    two_sample = stats.welch(list(a.values()), list(b.values())) if len(a) >= 2 and len(b) >= 2 else None
    return dict(seeds=seeds, deltas=[b[s] - a[s] for s in seeds], mean_a=_mean(a.values()),
                mean_b=_mean(b.values()), paired=paired, welch=two_sample)


def interaction(sweep: Sweep, by_arm: dict[str, list[Outcome]], metric: str) -> dict | None:
    """For two switches of two values each: single-switch and joint deltas from the corner arm (both
    first values), their sum, and the paired test of joint against the sum over seeds with all four."""
    if len(sweep.grid) != 2 or any(len(values) != 2 for _, values in sweep.grid):
        return None
    (f1, (a0, a1)), (f2, (b0, b1)) = sweep.grid
    corner = {key: Arm(((f1, v1), (f2, v2))).name for key, v1, v2 in
              (("base", a0, b0), ("first", a1, b0), ("second", a0, b1), ("both", a1, b1))}
    vals = {key: _values(by_arm[name], metric) for key, name in corner.items()}
    seeds = [s for s in sweep.seeds if all(s in v for v in vals.values())]
    if not seeds:
        return None
    delta = {key: float(np.mean([vals[key][s] - vals["base"][s] for s in seeds])) for key in ("first", "second", "both")}
    additive = [vals["first"][s] + vals["second"][s] - vals["base"][s] for s in seeds]
    return dict(fields=[f1, f2], values=[[a0, a1], [b0, b1]], arms=corner, seeds=seeds, delta_first=delta["first"],
                delta_second=delta["second"], delta_both=delta["both"], sum_of_singles=delta["first"] + delta["second"],
                interaction=delta["both"] - delta["first"] - delta["second"],
                test=stats.paired_test(additive, [vals["both"][s] for s in seeds]) if len(seeds) >= 2 else None)


def summarize(sweep: Sweep, outcomes: list[Outcome]) -> dict:
    """The report's numbers: per-arm descriptions, comparisons with the baseline, bands, 2x2 interaction."""
    by_arm = {arm.name: [o for o in outcomes if o.run.arm == arm] for arm in sweep.arms()}
    base = sweep.baseline_arm()
    quality = QUALITY[sweep.band_metric]

    def cost(runs):  # package time (training + final evaluation); training time where a log lacks it
        return _mean([o.metrics.package_time_s or o.metrics.train_time_s for o in runs if o.status == "finished"])

    arms = []
    for arm in sweep.arms():
        runs = by_arm[arm.name]
        done = [o.metrics for o in runs if o.status == "finished"]
        entry = dict(name=arm.name, label=arm.label, n=len(done), failed=sum(o.status == "failed" for o in runs),
                     not_run=sum(o.status == "not run" for o in runs))
        for metric in ("val_loss", "val_bpb", "step0_train_loss"):
            values = list(_values(runs, metric).values())
            entry[metric] = stats.describe(values) if values else None
        entry.update(train_time_s=_mean(m.train_time_s for m in done), package_time_s=_mean(m.package_time_s for m in done),
                     peak_memory_mib=_mean(m.peak_memory_mib for m in done),
                     params_total=sorted({m.params_total for m in done if m.params_total is not None}))
        if arm != base:
            entry["vs_baseline"] = {metric: compare(by_arm[base.name], runs, metric) for metric in COMPARED}
            q = entry["vs_baseline"][quality]
            base_cost, arm_cost = cost(by_arm[base.name]), cost(runs)
            entry["time_ratio"] = arm_cost / base_cost if base_cost and arm_cost else None
            inside = []
            if sweep.band_loss is not None:
                inside.append(None if q is None else q["mean_b"] - q["mean_a"] <= sweep.band_loss)
            if sweep.band_time is not None:
                inside.append(None if entry["time_ratio"] is None else entry["time_ratio"] <= sweep.band_time)
            entry["inside_bands"] = None if not inside or None in inside else all(inside)
        arms.append(entry)
    return dict(baseline=base.name, band_metric=quality, band_loss=sweep.band_loss, band_time=sweep.band_time,
                runs={s: sum(o.status == s for o in outcomes) for s in ("finished", "failed", "not run")},
                arms=arms, interaction={m: interaction(sweep, by_arm, m) for m in ("val_loss", "val_bpb")},
                failures=[dict(arm=o.run.arm.name, seed=o.run.seed, reason=o.reason)
                          for o in outcomes if o.status == "failed"],
                scripts=dict(Counter(o.metrics.script for o in outcomes if o.status == "finished")),
                changes=arm_changes(sweep, by_arm), mixed_arms=mixed_arms(sweep, by_arm))


def _first_log(runs: list[Outcome]) -> runlogs.RunLog | None:
    return next((o.metrics for o in runs if o.status == "finished"), None)


def arm_changes(sweep: Sweep, by_arm: dict[str, list[Outcome]]) -> dict[str, dict[str, list[str]]]:
    """{arm: {field: [baseline value, arm value]}}: the experiment-defining config fields in which each
    arm's first finished log differs from the baseline's, however many fields its grid values set."""
    base = _first_log(by_arm[sweep.baseline_arm().name])
    out = {}
    for arm in sweep.arms():
        log = _first_log(by_arm[arm.name])
        if base is not None and log is not None and arm != sweep.baseline_arm():
            out[arm.name] = {k: list(v) for k, v in runlogs.config_differences(base, log).items()}
    return out


def mixed_arms(sweep: Sweep, by_arm: dict[str, list[Outcome]]) -> dict[str, list[str]]:
    """{arm: [what sets each group apart]} for arms whose finished runs are more than one experiment."""
    out = {}
    for arm in sweep.arms():
        groups = runlogs.group_runs([o.metrics for o in by_arm[arm.name] if o.status == "finished"])
        if len(groups) > 1:
            out[arm.name] = [f"{g.name}: {len(g.logs)} run(s), {g.differences(limit=3)}" for g in groups]
    return out


# -----------------------------------------------------------------------------
# Writing runs.csv, report.md and report.json

CSV_COLUMNS = ["arm", "seed", "status", "val_loss", "val_bpb", "step0_train_loss", "train_time_s", "package_time_s",
               "peak_memory_mib", "params_total", "script", "log", "reason"]


def write_csv(outcomes: list[Outcome], path: Path, ab: bool = False) -> None:
    """One row per run in launch order. An A/B's rows start with the slot, and their seed is the one
    the run's log reports (empty for a script that takes none, and for a run not finished)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, (["slot"] if ab else []) + CSV_COLUMNS)
        writer.writeheader()
        for o in outcomes:
            row = dict(arm=o.run.arm.name, seed=o.run.seed, status=o.status, reason=o.reason)
            if ab:
                row.update(slot=o.run.slot, seed=o.metrics.seed if o.metrics is not None else None)
            if o.metrics is not None:
                row.update({k: getattr(o.metrics, k) for k in CSV_COLUMNS[3:-2]}, log=o.metrics.path)
            writer.writerow(row)


def _num(x, spec=".6f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _mean_std(d: dict | None, spec=".6f") -> str:
    if d is None:
        return "n/a"
    return f"{d['mean']:{spec}} ± {_num(d['std'], spec)}"


def _script_warning(s: dict) -> list[str]:
    """A warning when the finished runs come from different trainer scripts: a different experiment each."""
    if len(s["scripts"]) < 2:
        return []
    counts = ", ".join(f"{digest}: {n} run(s)" for digest, n in s["scripts"].items())
    return ["", f"**Warning: the finished runs come from {len(s['scripts'])} different trainer scripts** ({counts}; "
            "the `script` column of runs.csv says which). Compare like with like: rerun into a fresh --out."]


def _mixed_warning(s: dict) -> list[str]:
    """A warning per arm whose runs are more than one experiment (records/runlogs.py's rule)."""
    out = []
    for arm, groups in s["mixed_arms"].items():
        out += ["", f"**Warning: arm `{arm}` holds runs of {len(groups)} different experiments** "
                f"({'; '.join(groups)}): its statistics mix them. Rerun into a fresh --out."]
    return out


def _changes_section(sweep: Sweep, s: dict) -> list[str]:
    """What each arm's logs say it changed against the baseline's (all experiment-defining fields)."""
    if not s["changes"]:
        return []
    out = ["", "## What each arm changes", "",
           "The experiment-defining config fields in which an arm's first finished log differs from the "
           "baseline's (a grid value such as a recipe name can set many).", "",
           "| arm | fields (baseline → arm) |", "|---|---|"]
    labels = {a.name: a.label for a in sweep.arms()}
    for arm, changed in s["changes"].items():
        text = "; ".join(f"`{k}`: {a} → {b}" for k, (a, b) in changed.items()) or "none"
        out.append(f"| `{labels[arm]}` | {text} |")
    return out


def render_report(sweep: Sweep, s: dict) -> str:
    """report.md: arms, deltas against the baseline with both tests, bands, the 2x2 interaction, failures."""
    base = next(a for a in s["arms"] if a["name"] == s["baseline"])
    out = ["# Ablation report", "",
           f"Preset `{sweep.preset}`, seeds {', '.join(map(str, sweep.seeds))}, "
           f"extra trainer flags `{' '.join(sweep.extra) or '(none)'}`.",
           f"Runs: {s['runs']['finished']} finished, {s['runs']['failed']} failed, {s['runs']['not run']} not run.",
           f"Baseline: `{base['label']}`. Deltas are arm − baseline (negative loss = better).",
           "Paired test: over the seeds where both arms finished (one seed: the same initial values of every "
           "tensor the two arms share). Welch's test: all finished runs, unpaired. 95% confidence intervals, "
           "two-sided p.", *_script_warning(s), *_mixed_warning(s), "",
           "## Arms", "",
           "| arm | n | val loss (mean ± std) | val BPB (mean ± std) | step-0 train loss | train time s | "
           "package time s | params | peak memory MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for a in s["arms"]:
        params = "/".join(f"{p:,}" for p in a["params_total"]) or "n/a"
        out.append(f"| `{a['label']}` | {a['n']} | {_mean_std(a['val_loss'])} | {_mean_std(a['val_bpb'])} | "
                   f"{_num(a['step0_train_loss'] and a['step0_train_loss']['mean'])} | {_num(a['train_time_s'], '.2f')} | "
                   f"{_num(a['package_time_s'], '.2f')} | {params} | {_num(a['peak_memory_mib'], '.0f')} |")
    others = [a for a in s["arms"] if "vs_baseline" in a]
    titles = {"val_loss": "final val loss", "val_bpb": "val BPB", "train_time_s": "training time (s)"}
    for metric in COMPARED:
        rows = [(a, a["vs_baseline"][metric]) for a in others if a["vs_baseline"][metric]]
        if not rows:
            continue
        spec = ".3f" if metric == "train_time_s" else ".6f"
        out += ["", f"## Against the baseline: {titles[metric]}", "",
                "| arm | seeds | mean Δ (paired) | 95% CI | t | p | Welch Δ | 95% CI | t | p |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for a, c in rows:
            p, w = c["paired"], c["welch"]
            paired = (f"{_num(p['mean_diff'], spec)} | [{_num(p['ci95'][0], spec)}, {_num(p['ci95'][1], spec)}] | "
                      f"{_num(p['t'], '.4f')} | {_num(p['p_two_sided'], '.4g')}") if p else "n/a (< 2 pairs) | | |"
            welch = (f"{_num(w['diff_b_minus_a'], spec)} | [{_num(w['ci95'][0], spec)}, {_num(w['ci95'][1], spec)}] | "
                     f"{_num(w['t'], '.4f')} | {_num(w['p_two_sided'], '.4g')}") if w else "n/a (< 2 runs per arm) | | |"
            out.append(f"| `{a['label']}` | {len(c['seeds'])} | {paired} | {welch} |")
        if metric == "val_loss":
            out += ["", "Per-seed deltas of the final val loss (arm − baseline, same seed):", "",
                    "| arm | " + " | ".join(f"seed {x}" for x in sweep.seeds) + " |",
                    "|---|" + "---|" * len(sweep.seeds)]
            for a, c in rows:
                by_seed = dict(zip(c["seeds"], c["deltas"]))
                out.append(f"| `{a['label']}` | " + " | ".join(_num(by_seed.get(x), "+.6f") for x in sweep.seeds) + " |")
    out += _changes_section(sweep, s)
    if s["band_loss"] is not None or s["band_time"] is not None:
        out += ["", "## Tolerance bands", "",
                f"Inside: mean {s['band_metric']} at most baseline + {_num(s['band_loss'], 'g')} and mean package "
                f"time at most {_num(s['band_time'], 'g')} x baseline (a band not given is not checked).", "",
                "| arm | Δ mean | time ratio | inside |", "|---|---|---|---|"]
        for a in others:
            q = a["vs_baseline"][s["band_metric"]]
            verdict = {True: "yes", False: "no", None: "n/a"}[a["inside_bands"]]
            out.append(f"| `{a['label']}` | {_num(q and q['mean_b'] - q['mean_a'], '+.6f')} | "
                       f"{_num(a['time_ratio'], '.3f')} | {verdict} |")
    for metric, it in s["interaction"].items():
        if it is None:
            continue
        (f1, f2), ((a0, a1), (b0, b1)) = it["fields"], it["values"]
        t = it["test"]
        out += ["", f"## 2x2 interaction: {titles[metric]}", "",
                f"Mean paired deltas from `{f1}={a0} {f2}={b0}` over seeds {', '.join(map(str, it['seeds']))}.", "",
                f"| | {f2}={b0} | {f2}={b1} |", "|---|---|---|",
                f"| {f1}={a0} | 0 | {_num(it['delta_second'], '+.6f')} |",
                f"| {f1}={a1} | {_num(it['delta_first'], '+.6f')} | {_num(it['delta_both'], '+.6f')} |", "",
                f"Sum of the single-switch deltas: {_num(it['sum_of_singles'], '+.6f')}; joint delta: "
                f"{_num(it['delta_both'], '+.6f')}; interaction (joint − sum): {_num(it['interaction'], '+.6f')}"
                + (f", 95% CI [{_num(t['ci95'][0], '+.6f')}, {_num(t['ci95'][1], '+.6f')}], t={_num(t['t'], '.4f')}, "
                   f"p={_num(t['p_two_sided'], '.4g')} (paired over seeds)." if t else " (one seed: no test).")]
    if s["failures"]:
        out += ["", "## Failed runs", ""]
        out += [f"- `{f['arm']}` seed {f['seed']}: {f['reason']}" for f in s["failures"]]
    return "\n".join(out) + "\n"


def write_results(sweep: Sweep, out: Path, outcomes: list[Outcome]) -> dict:
    """runs.csv, report.md and report.json from the outcomes (an A/B: and slots.png); returns the summary."""
    if sweep.is_ab:
        summary = summarize_ab(sweep, outcomes)
        write_csv(outcomes, out / "runs.csv", ab=True)
        (out / "report.md").write_text(render_ab_report(sweep, summary))
        if any(slot["train_time_s"] for slot in summary["slots"]):
            plot_slots(summary, out / "slots.png")
    else:
        summary = summarize(sweep, outcomes)
        write_csv(outcomes, out / "runs.csv")
        (out / "report.md").write_text(render_report(sweep, summary))
    (out / "report.json").write_text(json.dumps(stats.json_safe(summary), indent=2) + "\n")
    return summary


# -----------------------------------------------------------------------------
# An A/B's statistics, report and picture

AB_COMPARED = ("train_time_s", "val_loss")
AB_TITLES = {"train_time_s": "training time (s)", "val_loss": "final val loss"}


def _by_slot(c: dict | None) -> dict | None:
    """compare()'s result with its pairs called slots."""
    if c is None:
        return None
    c = dict(c)
    c["slots"] = c.pop("seeds")
    return c


def ab_verdict(name: str, base: str, c: dict) -> str:
    """One line: is the arm faster or slower than the baseline (the paired 95% CI of the time
    difference excludes 0), or is no difference shown; with the tests' p and the loss difference."""
    t, loss = c["train_time_s"], c["val_loss"]
    if t is None or t["paired"] is None:
        n = len(t["slots"]) if t else 0
        return (f"{name} against {base}: no verdict yet: {n} slot(s) where both finished a run with a training time; "
                "a paired test needs 2 or more")
    p = t["paired"]
    low, high, d = p["ci95"][0], p["ci95"][1], p["mean_diff"]
    if high < 0:
        head = f"{name} is faster than {base} by {-d:.3f} s per run"
    elif low > 0:
        head = f"{name} is slower than {base} by {d:.3f} s per run"
    else:
        head = f"{name} against {base}: no time difference shown, {d:+.3f} s per run"
    text = (f"{head} (paired over {p['n']} slots: 95% CI [{_num(low, '+.3f')}, {_num(high, '+.3f')}] s, "
            f"p = {_num(p['p_two_sided'], '.3g')}")
    if t["welch"]:
        text += f"; Welch p = {_num(t['welch']['p_two_sided'], '.3g')}"
    text += ")"
    if loss and loss["paired"]:
        text += (f"; final val loss {_num(loss['paired']['mean_diff'], '+.6f')} "
                 f"(paired p = {_num(loss['paired']['p_two_sided'], '.3g')})")
    return text


def _log_seed(log: runlogs.RunLog) -> int | str | None:
    """The seed the log reports, as an int where it is one."""
    return int(log.seed) if log.seed is not None and log.seed.lstrip("-").isdigit() else log.seed


def summarize_ab(sweep: Sweep, outcomes: list[Outcome]) -> dict:
    """The A/B report's numbers: per arm n, mean and spread of the training time and final loss, the
    chance of a run below the target; per arm against the baseline the paired (by slot) and Welch
    tests of both and the verdict; per slot its seed, its order and each arm's numbers."""
    arms, base = sweep.arms(), sweep.baseline_arm()
    by_arm = {arm.name: [o for o in outcomes if o.run.arm == arm] for arm in arms}
    entries = []
    for arm in arms:
        runs = by_arm[arm.name]
        done = [o.metrics for o in runs if o.status == "finished"]
        losses = [m.val_loss for m in done]
        times = [m.train_time_s for m in done if m.train_time_s is not None]
        entry = dict(name=arm.name, command=arm.command, n=len(done), failed=sum(o.status == "failed" for o in runs),
                     not_run=sum(o.status == "not run" for o in runs),
                     train_time_s=stats.describe(times) if times else None,
                     val_loss=stats.describe(losses) if losses else None,
                     p_run_below_target=stats.single_run_chance(losses, sweep.target)["p"] if losses else None,
                     p_mean_below_target=stats.claim_test(losses, sweep.target, 0.05)["p"] if losses else None,
                     seeds=[_log_seed(m) for m in done if m.seed is not None],
                     scripts=sorted({m.script for m in done if m.script}))
        if arm != base:
            entry["vs_baseline"] = {m: _by_slot(compare(by_arm[base.name], runs, m)) for m in AB_COMPARED}
            entry["verdict"] = ab_verdict(arm.name, base.name, entry["vs_baseline"])
        entries.append(entry)
    slots = []
    for k, seed in enumerate(sweep.seeds, start=1):
        in_slot = [o for o in outcomes if o.run.slot == k]  # launch order
        done = [o for o in in_slot if o.status == "finished"]
        slots.append(dict(slot=k, seed=seed, order=[o.run.arm.name for o in in_slot],
                          train_time_s={o.run.arm.name: o.metrics.train_time_s for o in done},
                          val_loss={o.run.arm.name: o.metrics.val_loss for o in done}))
    return dict(kind="ab", baseline=base.name, target=sweep.target,
                runs={s: sum(o.status == s for o in outcomes) for s in ("finished", "failed", "not run")},
                arms=entries, verdicts=[e["verdict"] for e in entries if "verdict" in e], slots=slots,
                failures=[dict(arm=o.run.arm.name, slot=o.run.slot, reason=o.reason)
                          for o in outcomes if o.status == "failed"],
                mixed_arms=mixed_arms(sweep, by_arm))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _min_max(d: dict | None, spec: str) -> str:
    return "n/a" if d is None else f"{d['min']:{spec}} – {d['max']:{spec}}"


def render_ab_report(sweep: Sweep, s: dict) -> str:
    """report.md of an A/B: the verdicts, the arms, the tests against the baseline, the slots, the picture."""
    target = f"{s['target']:g}"
    out = ["# A/B report", "",
           f"Arms: {', '.join(f'`{a}`' for a in (e['name'] for e in s['arms']))}; baseline `{s['baseline']}`. "
           f"{len(sweep.seeds)} slots, seeds {', '.join(map(str, sweep.seeds))} (slot k: the k-th seed, the same for "
           f"every arm of the slot whose script takes --seed). Preset `{sweep.preset}` (for the scripts that take "
           f"--preset); flags after `--` for every arm: `{' '.join(sweep.extra) or '(none)'}`.",
           f"Runs: {s['runs']['finished']} finished, {s['runs']['failed']} failed, {s['runs']['not run']} not run. "
           "Differences are arm − baseline (negative time: faster).", *_mixed_warning(s), "",
           "## Verdict", "",
           "A difference is shown when the paired 95% CI of the training time excludes 0.", "",
           *[f"- **{v}.**" for v in s["verdicts"]], "",
           "## Arms", "",
           f"P(run < {target}): the chance that one more run ends below {target} (normal model with the arm's mean and "
           f"std; records/stats.py). p (mean < {target}): the one-sided t-test of a record claim (stats.py's).", "",
           f"| arm | command | n | train time s (mean ± std) | min – max | final val loss (mean ± std) | min – max | "
           f"P(run < {target}) | p (mean < {target}) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for a in s["arms"]:
        out.append(f"| `{a['name']}` | `{_cell(a['command'])}` | {a['n']} | {_mean_std(a['train_time_s'], '.3f')} | "
                   f"{_min_max(a['train_time_s'], '.3f')} | {_mean_std(a['val_loss'])} | {_min_max(a['val_loss'], '.6f')} | "
                   f"{_num(a['p_run_below_target'], '.3g')} | {_num(a['p_mean_below_target'], '.3g')} |")
    others = [a for a in s["arms"] if "vs_baseline" in a]
    out += ["", "## Against the baseline", "",
            "Paired: over the slots where both arms finished (the two runs of a slot ran back to back, with the same "
            "seed where both scripts take one). Welch: all finished runs, unpaired. 95% confidence intervals, "
            "two-sided p (scipy.stats ttest_rel and ttest_ind).", "",
            "| arm | metric | slots | mean Δ (paired) | 95% CI | t | p | Welch Δ | 95% CI | t | p |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in others:
        for metric in AB_COMPARED:
            c = a["vs_baseline"][metric]
            if c is None:
                out.append(f"| `{a['name']}` | {AB_TITLES[metric]} | 0 | n/a | | | | n/a | | | |")
                continue
            spec = ".3f" if metric == "train_time_s" else ".6f"
            p, w = c["paired"], c["welch"]
            paired = (f"{_num(p['mean_diff'], spec)} | [{_num(p['ci95'][0], spec)}, {_num(p['ci95'][1], spec)}] | "
                      f"{_num(p['t'], '.4f')} | {_num(p['p_two_sided'], '.4g')}") if p else "n/a (< 2 pairs) | | |"
            welch = (f"{_num(w['diff_b_minus_a'], spec)} | [{_num(w['ci95'][0], spec)}, {_num(w['ci95'][1], spec)}] | "
                     f"{_num(w['t'], '.4f')} | {_num(w['p_two_sided'], '.4g')}") if w else "n/a (< 2 runs per arm) | | |"
            out.append(f"| `{a['name']}` | {AB_TITLES[metric]} | {len(c['slots'])} | {paired} | {welch} |")
    names = [a["name"] for a in s["arms"]]
    out += ["", "## Slots", "",
            "Training time in seconds per slot, the arms in the order they ran; Δ: arm − baseline in that slot.", "",
            "| slot | seed | order | " + " | ".join(f"`{n}` s" for n in names) + " | "
            + " | ".join(f"Δ `{a['name']}` s" for a in others) + " |",
            "|---|---|---|" + "---|" * (len(names) + len(others))]
    for slot in s["slots"]:
        t = slot["train_time_s"]
        deltas = [t[a["name"]] - t[s["baseline"]] if a["name"] in t and s["baseline"] in t and t[a["name"]] is not None
                  and t[s["baseline"]] is not None else None for a in others]
        out.append(f"| {slot['slot']} | {slot['seed']} | {' '.join(slot['order'])} | "
                   + " | ".join(_num(t.get(n), ".3f") for n in names) + " | "
                   + " | ".join(_num(d, "+.3f") for d in deltas) + " |")
    out += ["", "![training time per slot and arm, and each arm's difference from the baseline](slots.png)"]
    if s["failures"]:
        out += ["", "## Failed runs", ""]
        out += [f"- `{f['arm']}` slot {f['slot']}: {f['reason']}" for f in s["failures"]]
    return "\n".join(out) + "\n"


def plot_slots(s: dict, path: Path) -> None:
    """slots.png: left, each arm's training time per slot (drift of the machine shows as a trend
    every arm shares); right, each arm's difference from the baseline per slot, with its mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    slots = [slot["slot"] for slot in s["slots"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base = s["baseline"]
    for i, a in enumerate(s["arms"]):
        color = colors[i % len(colors)]  # an arm's colour in both panels
        ys = [slot["train_time_s"].get(a["name"]) for slot in s["slots"]]
        xs = [x for x, y in zip(slots, ys) if y is not None]
        if xs:
            left.plot(xs, [y for y in ys if y is not None], marker="o", color=color, label=a["name"])
        pairs = [(slot["slot"], slot["train_time_s"][a["name"]] - slot["train_time_s"][base]) for slot in s["slots"]
                 if slot["train_time_s"].get(a["name"]) is not None and slot["train_time_s"].get(base) is not None]
        if pairs and a["name"] != base:
            right.plot(*zip(*pairs), marker="o", color=color, label=a["name"])
            right.axhline(float(np.mean([d for _, d in pairs])), color=color, linestyle="--", linewidth=1)
    right.axhline(0, color="black", linewidth=0.8)
    for ax, title, ylabel in ((left, "training time per slot", "train time (s)"),
                              (right, f"difference from {base} per slot (dashed: mean)", "Δ train time (s)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("slot")
        ax.set_ylabel(ylabel)
        ax.set_xticks(slots)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -----------------------------------------------------------------------------
# The sweep loop

def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _say(line: str) -> None:
    """A progress line on stdout, printed around the progress bar (if one is drawn on stderr)."""
    with tqdm.tqdm.external_write_mode(file=sys.stdout):
        print(line, flush=True)


def describe_run(sweep: Sweep, run: Run) -> str:
    """'arm X, seed S' (a grid); 'slot K, arm X, seed S' (an A/B; 'no seed' for a script that takes none)."""
    if not sweep.is_ab:
        return f"arm {run.arm.label}, seed {run.seed}"
    seeded = "seed" in arm_launch(run.arm).takes
    return f"slot {run.slot}, arm {run.arm.name}, " + (f"seed {run.seed}" if seeded else "no seed (its script takes none)")


def run_sweep(sweep: Sweep, out: Path) -> list[Outcome]:
    """Run what is missing, seed-major, with a progress line per run and, on a terminal, a progress bar
    with the elapsed time and an ETA (tqdm, on stderr); results rewritten after each run.

    Every run's folder is looked at once before the loop and the launched run's once after it, so a
    sweep of n runs reads each finished log once (not n times)."""
    runs = plan(sweep, out)
    outcomes = [inspect(r) for r in runs]
    write_results(sweep, out, outcomes)
    todo = sum(o.status != "finished" for o in outcomes)
    tqdm.tqdm.monitor_interval = 0  # no monitor thread: the runs are started with fork
    bar = tqdm.tqdm(total=todo, desc="sweep", unit="run", file=sys.stderr, disable=None, smoothing=0,
                    dynamic_ncols=True)
    start, durations = time.perf_counter(), []
    for i, run in enumerate(runs):
        where = f"[run {i + 1}/{len(runs)}] {describe_run(sweep, run)}"
        if outcomes[i].status == "finished":
            _say(f"{where}: finished before ({outcomes[i].metrics.path}), skipped")
            continue
        todo -= 1
        eta = _clock(np.mean(durations) * (todo + 1)) if durations else "unknown until one run ends"
        _say(f"{where}: running; {todo} left after this, elapsed {_clock(time.perf_counter() - start)}, "
             f"remaining ~{eta}")
        t0 = time.perf_counter()
        outcomes[i] = launch(sweep, run)
        durations.append(time.perf_counter() - t0)
        bar.update(1)
        log = outcomes[i].metrics
        result = (f"FAILED: {outcomes[i].reason} (see {run.folder / 'stderr.log'})" if log is None
                  else f"val_loss {log.val_loss:.6f}, train time {_num(log.train_time_s, '.3f')} s" if sweep.is_ab
                  else f"val_loss {log.val_loss:.6f}")
        _say(f"{where}: {result} in {durations[-1]:.1f} s")
        write_results(sweep, out, outcomes)
    bar.close()
    return outcomes


def load_sweep(out: Path) -> Sweep:
    """The sweep saved in <out>/sweep.json."""
    path = Path(out) / "sweep.json"
    if Path(out).exists() and not Path(out).is_dir():
        raise SweepError(f"--out {out}: is a file, not a sweep's output folder")
    if not path.exists():
        raise SweepError(f"--out {out}: no sweep.json there (not the output folder of an ablate.py sweep)")
    try:
        return Sweep(**json.loads(path.read_text()))
    except OSError as e:
        raise SweepError(f"{path}: cannot read: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:  # not JSON, or not the fields a sweep has
        raise SweepError(f"{path}: not a sweep description ({e}); re-run the sweep command to rewrite it") from None


def summary_lines(sweep: Sweep, s: dict, out: Path) -> list[str]:
    """What the sweep says when it ends (finished or interrupted): an A/B's arms and verdicts; the
    counts of runs; where the report is."""
    counts = f"{s['runs']['finished']} finished, {s['runs']['failed']} failed, {s['runs']['not run']} not run"
    if not sweep.is_ab:
        return [f"wrote {out / 'runs.csv'} and {out / 'report.md'}; {counts}"]
    lines = []
    for a in s["arms"]:
        time_s = f"{_mean_std(a['train_time_s'], '.3f')} s" if a["train_time_s"] else "n/a"
        lines.append(f"arm {a['name']}: {a['n']} finished, train time {time_s}, final val loss "
                     f"{_mean_std(a['val_loss'])}, P(run < {s['target']:g}) {_num(a['p_run_below_target'], '.3g')}")
    lines += [f"verdict: {v}" for v in s["verdicts"]]
    pictures = " and slots.png" if (out / "slots.png").exists() else ""
    return lines + [f"wrote {out / 'report.md'} (with runs.csv, report.json{pictures}); {counts}"]


def continue_command(argv: list[str], out: Path, out_given: bool) -> str:
    """The command that continues this sweep: the one given, with --out spelled out (before --)."""
    head, tail = (argv[:argv.index("--")], argv[argv.index("--"):]) if "--" in argv else (argv, [])
    if not out_given:
        head = [*head, "--out", str(out)]
    here = Path(__file__).resolve()
    script = os.path.relpath(here) if not os.path.relpath(here).startswith("..") else str(here)
    return shlex.join(["python", script, *head, *tail])


def build_sweep(args, extra: list[str], overrides: dict) -> tuple[Sweep, Path]:
    """The sweep the flags ask for and its output folder; SweepError for flags that cannot go together."""
    if args.arm:
        for flag, given in (("--grid", args.grid), ("--launcher", args.launcher is not None),
                            ("--band-loss", args.band_loss is not None), ("--band-time", args.band_time is not None),
                            ("--band-metric", args.band_metric is not None)):
            if given:
                why = ("an arm is a whole command: write each configuration as its own --arm "
                       "(e.g. --arm a='./run.sh --lore_input=true')" if flag == "--grid" else
                       "each arm's command is its own launcher (put the launcher in it)" if flag == "--launcher" else
                       "tolerance bands are for --grid sweeps")
                raise SweepError(f"--arm and {flag} cannot be combined: {why}")
        commands = [parse_arm(a) for a in args.arm]
        check_arm_names(commands)
        sweep = Sweep(preset=args.preset, grid=[], seeds=parse_seeds(args.seeds), extra=extra, commands=commands,
                      target=stats.MEDIUM_TARGET if args.target is None else args.target, **overrides)
        default = Path("logs/ablations") / "-".join([args.preset, "ab", *(n for n, _ in commands)])
    else:
        if args.target is not None:
            raise SweepError("--target is for an A/B of --arm commands; a --grid sweep compares its arms by "
                             "--band-loss / --band-time")
        sweep = Sweep(preset=args.preset, grid=[parse_grid(g) for g in args.grid], seeds=parse_seeds(args.seeds),
                      extra=extra, launcher=args.launcher or DEFAULT_LAUNCHER, **overrides)
        default = Path("logs/ablations") / "-".join([args.preset] + [f for f, _ in sweep.grid])
    return sweep, (args.out or default).resolve()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    given = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    argv = joined_seeds(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="medium", help="trainer preset (medium = the record, tiny = CPU)")
    parser.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2",
                        help="one axis of the grid; repeat for more axes")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=COMMAND",
                        help="one arm of an A/B: a name and a command (launcher settings, launcher, flags); "
                             "repeat for each arm (two or more); not with --grid")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, each run for every arm "
                                                          "(an A/B: one slot per seed)")
    parser.add_argument("--launcher", help="a grid's command that takes trainer flags (default: the repository's run.sh)")
    parser.add_argument("--out", type=Path, help="output folder (default: logs/ablations/<preset>-<fields>, "
                                                 "an A/B: logs/ablations/<preset>-ab-<arm names>)")
    parser.add_argument("--baseline", help="arm to compare against, by name or label (default: the first arm)")
    parser.add_argument("--band-loss", type=float, help="tolerance: mean quality at most baseline + this")
    parser.add_argument("--band-time", type=float, help="tolerance: mean package time at most this x baseline")
    parser.add_argument("--band-metric", choices=sorted(QUALITY), help="quality metric of --band-loss (default loss)")
    parser.add_argument("--target", type=float, help="an A/B's target loss: each arm's chance of a run below it "
                                                     f"(default {stats.MEDIUM_TARGET})")
    parser.add_argument("--dry_run", action="store_true", help="list the runs and their commands, run nothing")
    parser.add_argument("--report-only", action="store_true", help="re-make runs.csv and the report from --out's logs")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help 0
        return e.code
    try:
        for name in ("band_loss", "band_time"):
            if getattr(args, name) is not None and not getattr(args, name) > 0:
                raise SweepError(f"--{name.replace('_', '-')} must be positive")
        if args.target is not None and not (0 < args.target < stats.MAX_LOSS):
            raise SweepError(f"--target {args.target:g}: give a val loss in nats per token, e.g. --target 2.92")
        overrides = {k: getattr(args, k) for k in ("baseline", "band_loss", "band_time", "band_metric", "target")
                     if getattr(args, k) is not None}
        if args.report_only:
            if args.out is None:
                raise SweepError("--report-only needs --out DIR (the sweep's output folder)")
            sweep = Sweep(**{**asdict(load_sweep(args.out)), **overrides})
            sweep.baseline_arm()
            try:
                summary = write_results(sweep, args.out, [inspect(r) for r in plan(sweep, args.out)])
            except OSError as e:
                raise SweepError(f"--out {args.out}: cannot write the report: {e.strerror or e}") from None
            if not summary["runs"]["finished"]:
                raise SweepError(f"--out {args.out}: no finished runs yet")
            print(f"wrote {args.out / 'runs.csv'} and {args.out / 'report.md'}")
            return 0
        overrides.pop("target", None)
        sweep, out = build_sweep(args, extra, overrides)
        check_ab(sweep, out) if sweep.is_ab else check_sweep(sweep, out)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = plan(sweep, out)
    if args.dry_run:
        for i, run in enumerate(runs, start=1):
            state = " (finished before: would be skipped)" if inspect(run).status == "finished" else ""
            print(f"[run {i}/{len(runs)}] {describe_run(sweep, run)}{state}\n  {shown_command(sweep, run)}")
        return 0
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(asdict(sweep), indent=2) + "\n")
    except OSError as e:
        print(f"error: --out {out}: cannot write there: {e.strerror or e}; choose another --out", file=sys.stderr)
        return 2
    blocks = "slots, the arms alternating" if sweep.is_ab else "seeds"
    print(f"{len(runs)} runs ({len(sweep.arms())} arms x {len(sweep.seeds)} {blocks}) into {out}", flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        outcomes = run_sweep(sweep, out)
    except (KeyboardInterrupt, Interrupted) as e:
        on_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the summary is the last word: a 2nd Ctrl-C does not cut it
        try:
            summary = write_results(sweep, out, [inspect(r) for r in runs])
            print("\n" + "\n".join(summary_lines(sweep, summary, out)), flush=True)
        finally:
            signal.signal(signal.SIGINT, on_int)
        print(f"\ninterrupted: rerun the same command to continue; finished runs are kept in {out}\n"
              f"  {continue_command(given, out, args.out is not None)}", file=sys.stderr)
        return 143 if isinstance(e, Interrupted) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [o for o in outcomes if o.status == "failed"]
    print("\n".join(summary_lines(sweep, summarize_ab(sweep, outcomes), out)) if sweep.is_ab else
          f"wrote {out / 'runs.csv'} and {out / 'report.md'}; {len(outcomes) - len(failed)} finished, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
