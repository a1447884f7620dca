"""Run logs: where they are, what one holds, and which runs are the same experiment.

Every tool in records/ reads logs through this module: one finder (`find_logs`), one parse per
log file (`read_log`, cached by path, modification time and size, so a sweep that looks at its
folders again and again parses each finished log once), and one rule for "the same experiment"
(`experiment_key`).

A log, as the trainer writes it (upstream logs have the same step lines and no config lines):

    <the training script's source>
    <40 `-`> / # triton_kernels.py / <40 `-`>, then its source (a trainer that logs one; older logs: none)
    ==================================================================  (100 `=`)
    <Python, PyTorch and hardware versions>
    ==================================================================
    config <field> = <repr>                      one line per field of the trainer's config
    config_groups = {"<field>": "<group>", ...}  the group of each field (JSON)
    experiment_groups = ["recipe", ...]          the groups that make a run's experiment (JSON)
    ...
    step:<s>/<N> val_loss:<x> train_time:<ms>ms step_avg:<ms>ms [val_bpb:<x>]
    step:<s>/<N> train_time:<ms>ms step_avg:<ms>ms
    final val_loss:<x> ... package_time:<ms>ms ...
    lambdas layer <i>: <name>:<value> ...
    peak memory allocated: <MiB> MiB reserved: <MiB> MiB
    run ended: <how> (exit <code>)               the last line: finished, interrupted by SIGINT at step
                                                 <s>/<N>, stopped by a non-finite loss or an error at ...

A run that did not finish is reported by its last line (`skip_reason`): "interrupted by SIGTERM at
step 37/190 (exit 143)"; a log without one (killed, crashed before the trainer wrote it, an older or
upstream log) "did not finish (last step seen: 37/190)".

A metrics stream (the trainer's --metrics_jsonl, tools/metrics.py), named as a file ending in
.jsonl, is read as the log it was made from (`parse_metrics_text`); a folder is searched for *.txt
logs only, so a stream beside its log is not counted twice.

The same experiment: runs are one experiment when their logs embed the same script, train for
the same number of steps, and agree on every config field whose group is in the log's
`experiment_groups` (the recipe, the seed ideas and the execution fields: what is computed and
on what hardware and data; not the seed, the names or the output folders). Logs written before
the group lines existed: every config field except `seed`, `run_id` and `log_dir` (the three that
differ between the runs of one batch or sweep by construction). Upstream logs (no config lines):
the script and the step count only.
"""

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

SEPARATOR = "=" * 100  # ends the script source at the top of every log, and the versions block after it
# A script that keeps its device kernels in a file beside it (this trainer; upstream's short track) logs
# that file after its own source, under this header; the script's text holds the header's second line
# as a Python string (KERNELS_MARK), which tells which scripts do.
KERNELS_NAME = "triton_kernels.py"
KERNELS_HEADER = "\n\n" + "-" * 40 + f"\n# {KERNELS_NAME}\n" + "-" * 40 + "\n\n"
KERNELS_MARK = f"# {KERNELS_NAME}\\n"
# Logs written before the trainer wrote its field groups: every config field but these, which differ
# between the runs of one batch or sweep by construction.
FALLBACK_IGNORED = ("seed", "run_id", "log_dir")
FALLBACK_RULE = ("every config field except seed, run_id and log_dir (a log written before the trainer wrote "
                 "its field groups)")
GROUPS_RULE = "the config fields of the groups {}"
UPSTREAM_RULE = "no config lines (upstream log format): the script and the step count only"


class LogError(Exception):
    """A path that gives no logs at all: missing, unreadable, or a folder without *.txt files."""


# -----------------------------------------------------------------------------
# Record folder names

RECORD_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[_-](.+))?")


def record_name(name: str) -> tuple[str, str] | None:
    """(date, label) of a record folder name `YYYY-MM-DD`, `YYYY-MM-DD_Label` or `YYYY-MM-DD-Label`, else None.

    The label is "" for a bare date; a date that does not exist (2025-13-01) is not a record name.
    """
    m = RECORD_NAME.fullmatch(name)
    if m is None:
        return None
    try:
        date.fromisoformat(m[1])
    except ValueError:
        return None
    return m[1], m[2] or ""


def record_folders(parent: Path) -> list[Path]:
    """The record folders directly in `parent`, oldest first (by date, then label)."""
    found = [(record_name(p.name), p) for p in Path(parent).iterdir() if p.is_dir()]
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def newest_record(records_dir: Path) -> Path:
    """The record folder in `records_dir` that sorts last (date first, then label)."""
    if not Path(records_dir).is_dir():
        raise LogError(f"no such records folder: {records_dir}")
    folders = record_folders(records_dir)
    if not folders:
        raise LogError(f"no record folders (YYYY-MM-DD, YYYY-MM-DD_Name or YYYY-MM-DD-Name) in {records_dir}")
    return folders[-1]


# -----------------------------------------------------------------------------
# Finding logs

def find_logs(paths, recursive: bool = False, empty_ok: bool = False) -> list[Path]:
    """The log files named by `paths`: files as given, folders by their *.txt files (with
    `recursive`, in subfolders too), each file once even when named twice. A missing path, or a
    folder without logs (unless `empty_ok`), raises LogError naming it."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            logs = sorted(p.rglob("*.txt") if recursive else p.glob("*.txt"))
            logs = [f for f in logs if f.is_file()]
            if not logs and not empty_ok:
                raise LogError(f"no *.txt logs in folder {p}")
            files.extend(logs)
        elif p.is_file():
            files.append(p)
        else:
            raise LogError(f"no such file or folder: {p}")
    unique = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


# -----------------------------------------------------------------------------
# One log

@dataclass
class RunResult:
    """The outcome of one finished run: its final val loss and its training time (None: not known)."""

    path: Path
    steps: int
    val_loss: float
    train_time_s: float | None
    decimals: int = 6  # digits after the point the loss was printed with (older upstream logs: 4)


@dataclass
class RunLog:
    """Everything the tools read from one log file; `result` is None for a run that did not finish."""

    path: Path
    result: RunResult | None
    skip_reason: str | None
    warnings: list[str]
    script: str | None = None  # script_digest of the embedded source; None: no separator line
    config: dict[str, str] = field(default_factory=dict)  # {field: logged repr}; {} for upstream logs
    groups: dict[str, str] | None = None  # {field: group} from config_groups; None: not written
    experiment_groups: tuple[str, ...] | None = None  # from experiment_groups; None: not written
    content_digest: str = ""  # hash of the whole file, to find copies
    steps: int | None = None  # N of the step:s/N lines
    device: str | None = None  # from the trainer's `world_size ..., device X` line
    history: list = field(default_factory=list)  # [{step, val_loss, train_time_s, val_bpb}], one per val line
    val_bpb: float | None = None
    step0_train_loss: float | None = None
    package_time_s: float | None = None
    peak_memory_mib: int | None = None
    params_total: int | None = None
    lambdas: dict = field(default_factory=dict)  # {layer: {name: value}} from the final `lambdas layer` lines
    ended: str | None = None  # how the run ended, from its `run ended: ` line (None: the log has none)

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def val_loss(self) -> float | None:
        return self.result.val_loss if self.result else None

    @property
    def train_time_s(self) -> float | None:
        return self.result.train_time_s if self.result else None

    @property
    def seed(self) -> str | None:
        return self.config.get("seed")


def embedded_source(text: str) -> str | None:
    """The script at the top of a log: everything before the first line of exactly 100 `=`, or None."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i])
    return None


def logged_source(script: Path) -> str:
    """What a run of `script` embeds at the top of its log: the script's text and, for a script that
    logs its kernels file (KERNELS_MARK in its text) with that file beside it, the header and the
    kernels' text after it. Its digest (script_digest) is then the logs' own."""
    script = Path(script)
    text = script.read_bytes().decode("utf-8", errors="replace")
    kernels = script.parent / KERNELS_NAME
    if KERNELS_MARK in text and kernels.is_file():
        return text + KERNELS_HEADER + kernels.read_bytes().decode("utf-8", errors="replace")
    return text


def source_files(source: str) -> dict[str, str]:
    """The files of an embedded (or logged) source, by name: {"script": ..., "triton_kernels.py": ...};
    a log from before the kernels moved into their own file gives the script alone."""
    script, header, kernels = source.partition(KERNELS_HEADER)
    return {"script": script, KERNELS_NAME: kernels} if header else {"script": source}


def script_digest(source: str) -> str:
    """A short hash of a script's text. Trailing newlines are ignored: the logger adds one to the file's."""
    return hashlib.sha256(source.rstrip("\r\n").encode("utf-8")).hexdigest()[:12]


_CONFIG_LINE = re.compile(r"config (\w+) = (.*)")
_GROUPS_LINE = re.compile(r"(config_groups|experiment_groups) = (.*)")


# The values a step line may carry and the exact formats the trainer prints them in.
# train_time and step_avg end every step line, so a line truncated mid-line misses one of them or
# its `ms` unit and is rejected instead of yielding a wrong number. Other `key:value` tokens pass.
_NUMBER = r"\d+(?:\.\d+)?"
_FIELDS = {
    "val_loss": re.compile(f"{_NUMBER}|nan|inf"),  # a diverged run's last val line says nan (or inf)
    "train_time": re.compile(_NUMBER + "ms"),
    "step_avg": re.compile(f"(?:{_NUMBER}|nan)ms"),
}
_STEP = re.compile(r"step:(\d+)/(\d+)")
_EXTRA_LINES = {  # the trainer's lines beside the step lines
    "params_total": re.compile(r"params total: ([\d,]+) "),
    "step0_train_loss": re.compile(r"step0_train_loss:(\S+)$"),
    "package_time_s": re.compile(r"final val_loss:.* package_time:(\d+)ms"),
    "peak_memory_mib": re.compile(r"peak memory allocated: (\d+) MiB"),
    "lambdas": re.compile(r"lambdas layer (\d+): (.*)$"),
    "device": re.compile(r"world_size \d+, .*device (\w+)"),
    "ended": re.compile(r"run ended: (.+)$"),
}


def parse_step_line(line: str) -> tuple[int, int, dict[str, str]] | None:
    """(step, total, {key: value}) of a `step:` line, or None if any part of it is malformed."""
    head, *tokens = line.split()
    m = _STEP.fullmatch(head)
    if m is None:
        return None
    step, total = int(m[1]), int(m[2])
    values = {}
    for token in tokens:
        key, sep, value = token.partition(":")
        if not (key and sep and value) or key in values:
            return None
        if key in _FIELDS and not _FIELDS[key].fullmatch(value):
            return None
        values[key] = value
    if step > total or "train_time" not in values or "step_avg" not in values:
        return None
    return step, total, values


def _read_extra(log: RunLog, key: str, hit: re.Match) -> None:
    if key == "lambdas":
        log.lambdas[int(hit[1])] = {k: float(v) for k, v in (t.split(":") for t in hit[2].split())}
    elif key == "package_time_s":
        log.package_time_s = int(hit[1]) / 1000
    elif key == "step0_train_loss":
        log.step0_train_loss = float(hit[1])
    elif key in ("device", "ended"):
        setattr(log, key, hit[1])
    else:
        setattr(log, key, int(hit[1].replace(",", "")))


def parse_log(path: Path) -> RunLog:
    """Read a training log (ours or upstream's), or a metrics stream (*.jsonl, --metrics_jsonl),
    uncached; `read_log` is the cached entry point. Raises LogError if the file cannot be read."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror or e}") from e
    parse = parse_metrics_text if path.suffix == ".jsonl" else parse_text
    return parse(raw.decode("utf-8", errors="replace"), path, hashlib.sha256(raw).hexdigest())


def parse_metrics_text(text: str, path: Path = Path("<metrics>"), content_digest: str = "") -> RunLog:
    """The RunLog of a metrics stream (tools/metrics.py): its run record gives the script digest, the
    config lines' values, the groups and the device; its val records the history; its final, step
    and peak_memory records the rest. It is the same experiment as the log it was made from. A line
    that is not a JSON object with a kind becomes a warning naming the file and line."""
    log = RunLog(path, None, None, [], content_digest=content_digest)
    last_seen = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["kind"]
        except (ValueError, KeyError, TypeError):
            log.warnings.append(f"{path}:{lineno}: unreadable metrics record ignored: {line[:120]!r}")
            continue
        if kind == "run":
            log.script, log.config = record.get("script"), dict(record.get("config") or {})
            log.groups = record.get("config_groups")
            log.experiment_groups = tuple(record.get("experiment_groups") or ())
            log.steps, log.device = record.get("num_iterations"), str(record.get("device", "")).split(":")[0] or None
        elif kind == "val":
            step, time_s = record["step"], record["train_time_ms"] / 1000
            log.history.append(dict(step=step, val_loss=record["val_loss"], train_time_s=time_s,
                                    val_bpb=record.get("val_bpb")))
            last_seen = f"{step}/{log.steps}"
            if step == log.steps:
                log.result = RunResult(path, log.steps, record["val_loss"], time_s)
                log.val_bpb = record.get("val_bpb")
        elif kind == "step":
            last_seen = f"{record['step']}/{log.steps}"
            if "train_loss" in record and record["step"] == 1:
                log.step0_train_loss = record["train_loss"]
        elif kind == "final":
            log.package_time_s = record["package_time_ms"] / 1000
        elif kind == "peak_memory":
            log.peak_memory_mib = record["allocated_mib"]
        elif kind == "end":
            log.ended = record.get("how")
    if log.result is None:
        log.skip_reason = unfinished_reason(log, f"last step seen: {last_seen or 'none'}")
    return log


def unfinished_reason(log: RunLog, seen: str) -> str:
    """Why a log holds no result: how the run ended, as its last line says (interrupted at step s/N, ...),
    or for a log without that line "did not finish (<seen>)"."""
    if log.ended and not log.ended.startswith("finished"):
        return log.ended
    return f"did not finish ({seen})"


def parse_text(text: str, path: Path = Path("<text>"), content_digest: str = "") -> RunLog:
    """The RunLog of a log's text.

    Only lines that start with `step:` are step lines: the embedded source holds the same f-strings,
    indented. A `step:` line that does not parse becomes a warning naming the file and line and is
    otherwise ignored; so does one whose total step count differs from the lines before it (a
    file that mixes runs). The run finished when a val line at the final step was read.
    """
    source = embedded_source(text)
    log = RunLog(path, None, None, [], script=script_digest(source) if source is not None else None,
                 content_digest=content_digest)
    first_line = source.count("\n") + 1 if source is not None else 1
    body = text[len(source):] if source is not None else text
    last_seen = None
    for lineno, line in enumerate(body.splitlines(), start=first_line):
        if line.startswith("step:"):
            parsed = parse_step_line(line)
            if parsed is None or (log.steps is not None and parsed[1] != log.steps):
                log.warnings.append(f"{path}:{lineno}: unparseable step line ignored: {line[:120]!r}")
                continue
            step, log.steps, values = parsed
            last_seen = f"{step}/{log.steps}"
            if "val_loss" in values:
                loss, time_s = float(values["val_loss"]), float(values["train_time"][:-2]) / 1000
                bpb = float(values["val_bpb"]) if "val_bpb" in values else None
                log.history.append(dict(step=step, val_loss=loss, train_time_s=time_s, val_bpb=bpb))
                if step == log.steps:
                    log.result = RunResult(path, log.steps, loss, time_s, decimals=len(values["val_loss"].partition(".")[2]))
                    log.val_bpb = bpb
            continue
        m = _CONFIG_LINE.fullmatch(line)
        if m:
            log.config[m[1]] = m[2]
            continue
        m = _GROUPS_LINE.fullmatch(line)
        if m:
            _read_groups(log, m[1], m[2], f"{path}:{lineno}")
            continue
        for key, pattern in _EXTRA_LINES.items():
            hit = pattern.match(line)
            if hit:
                _read_extra(log, key, hit)
                break
    if log.result is None:
        seen = f"last step seen: {last_seen or 'none'}"
        log.skip_reason = unfinished_reason(log, seen + (f"; {len(log.warnings)} unparseable step line(s)"
                                                         if log.warnings else ""))
    return log


def _read_groups(log: RunLog, name: str, text: str, where: str) -> None:
    """The two JSON lines after the config lines; a garbled one is a warning, and the log is then
    read as one written before these lines existed."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if name == "config_groups" and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        log.groups = value
    elif name == "experiment_groups" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        log.experiment_groups = tuple(value)
    else:
        log.warnings.append(f"{where}: unreadable {name} line ignored")


_CACHE: dict[Path, tuple[tuple[int, int], RunLog]] = {}


def read_log(path: Path) -> RunLog:
    """parse_log, cached: a file is parsed again only when its modification time or size changed."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror or e}") from e
    key, stamp = path.resolve(), (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        log = hit[1]
        return log if log.path == path else _renamed(log, path)
    log = parse_log(path)
    _CACHE[key] = (stamp, log)
    return log


def _renamed(log: RunLog, path: Path) -> RunLog:
    """The cached parse of a file reached by another spelling of its path, reported under this one."""
    result = replace(log.result, path=path) if log.result else None
    return replace(log, path=path, result=result)


def read_logs(paths, recursive: bool = False, empty_ok: bool = False) -> list[RunLog]:
    """read_log of every file find_logs finds."""
    return [read_log(f) for f in find_logs(paths, recursive, empty_ok)]


# -----------------------------------------------------------------------------
# The same experiment

def has_groups(log: RunLog) -> bool:
    return log.groups is not None and log.experiment_groups is not None


def experiment_config(log: RunLog) -> dict[str, str]:
    """The config fields that define the run's experiment, {field: logged repr}: those whose group is
    in the log's experiment groups (a field without a group counts); for a log written before the
    group lines, every field except FALLBACK_IGNORED; for an upstream log, none."""
    if not has_groups(log):
        return {k: v for k, v in log.config.items() if k not in FALLBACK_IGNORED}
    return {k: v for k, v in log.config.items() if k not in log.groups or log.groups[k] in log.experiment_groups}


def rule_of(log: RunLog) -> str:
    """Which form of the rule decided this log's experiment, in words."""
    if not log.config:
        return UPSTREAM_RULE
    if not has_groups(log):
        return FALLBACK_RULE
    return GROUPS_RULE.format(", ".join(log.experiment_groups))


def experiment_key(log: RunLog) -> tuple:
    """Runs with equal keys are the same experiment: script digest, experiment config, step count."""
    return log.script, tuple(sorted(experiment_config(log).items())), log.steps


def config_differences(old: RunLog, new: RunLog) -> dict[str, tuple[str, str]]:
    """{field: (old repr, new repr)} over the experiment-defining fields (of either log) that differ."""
    a, b = experiment_config(old), experiment_config(new)
    missing = "(not logged)"
    return {n: (a.get(n, missing), b.get(n, missing)) for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)}


def drop_duplicates(logs: list[RunLog]) -> tuple[list[RunLog], list[str]]:
    """(the logs with each byte-identical copy removed, one warning per copy naming both files)."""
    first, kept, warnings = {}, [], []
    for log in logs:
        original = first.setdefault(log.content_digest, log)
        if original is log:
            kept.append(log)
        else:
            warnings.append(f"{original.path} and {log.path} are byte-identical copies of one log: "
                            f"counted once (as {original.path})")
    return kept, warnings


@dataclass
class Experiment:
    """The logs of one experiment, and what sets it apart from the others it was grouped with."""

    name: str  # "A", "B", ... in order of the first log's path
    logs: list[RunLog]
    distinct: dict[str, str]  # the key parts that differ between the experiments: {"script": ..., "steps": ..., field: value}

    @property
    def runs(self) -> list[RunResult]:
        return [log.result for log in self.logs]

    def differences(self, limit: int | None = None) -> str:
        """What sets this group apart, e.g. `script 0a1b2c3d4e5f, muon_lr=0.03` ("" when alone)."""
        parts = [f"script {v}" if k == "script" else f"{v} steps" if k == "steps" else f"{k}={v}"
                 for k, v in self.distinct.items()]
        if limit is not None and len(parts) > limit:
            parts = parts[:limit] + [f"+{len(parts) - limit} more"]
        return ", ".join(parts)

    def describe_key(self) -> str:
        """One line: script hash, steps, and the config fields that set this group apart."""
        log = self.logs[0]
        parts = [f"script {log.script or 'unknown (no line of 100 =)'}", f"{log.steps} steps"]
        config = {k: v for k, v in self.distinct.items() if k not in ("script", "steps")}
        if not log.config:
            parts.append("no config lines (upstream log format)")
        elif config:
            parts.append("config " + " ".join(f"{k}={v}" for k, v in config.items()))
        else:
            parts.append(f"same values of {rule_of(log)}")
        return ", ".join(parts)


def group_runs(logs: list[RunLog]) -> list[Experiment]:
    """Group logs into experiments (experiment_key), in order of their paths, naming each group and
    what sets it apart."""
    groups: dict[tuple, list[RunLog]] = {}
    for log in sorted(logs, key=lambda p: str(p.path)):
        groups.setdefault(experiment_key(log), []).append(log)
    keys = list(groups)
    differing = {}
    if len({k[0] for k in keys}) > 1:
        differing["script"] = lambda k: str(k[0])
    if len({k[2] for k in keys}) > 1:
        differing["steps"] = lambda k: str(k[2])
    configs = [dict(k[1]) for k in keys]
    for name in sorted({n for c in configs for n in c}):
        if len({c.get(name) for c in configs}) > 1:
            differing[name] = lambda k, name=name: dict(k[1]).get(name, "(not logged)")
    return [Experiment(group_name(i), groups[k], {name: get(k) for name, get in differing.items()})
            for i, k in enumerate(keys)]


def group_name(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"G{i + 1}"
