"""The change a record makes: its training script and its config against its predecessor's; the
change between two scripts; the values two recipes of one trainer set differently.

    python records/diff.py RECORD [OTHER] [--nearest] [--stat]
    python records/diff.py OLD.py NEW.py [--stat] [--preset NAME]
    python records/diff.py --recipes A B [--trainer SCRIPT] [--preset NAME]

RECORD is a record folder named `YYYY-MM-DD`, `YYYY-MM-DD_Name` or `YYYY-MM-DD-Name`. Without
OTHER the comparison is with the record folder just before it among its siblings (date order, ties
by name); with --nearest, with the earlier record whose script differs least (fewest changed lines).
OTHER may be another record folder or a .py file.

Printed: the unified diff of the scripts (or, with --stat, the counts of added and removed lines per
section of the script: its `# ====` banners with their title line, and within a section per
top-level class/def, or per `# ---- title` sub-banner for lines outside any class/def), then
the config of the first logs of the two folders: the recipe each ran (`recipe: x01 -> bulk`, or
`recipe: bulk (both)`; the presets when they differ), and the config fields that define the
experiment (records/runlogs.py: the groups the logs name as experiment-defining, so not the seed,
names or output folders) and differ: a record may change flags alone, a recipe is a change of
flags. A warning on stderr names a folder that holds more than one distinct script and says
which one was compared.

Two .py files (OLD first, the older one): their unified diff (or --stat), then, when both are
trainers (each defines make_config), the fields of their default configs (`make_config()`, or
`make_config(PRESET)`) that differ: `field: old -> new`, or `field: only in old (value)` for a field
one script does not have. Both scripts are imported for that (a trainer's import has no side
effects). `x01_lineage/train_gpt_medium.py train_gpt_medium.py` is the x01 -> bulk change as code
and as values.

--recipes A B: the fields whose values differ between `make_config(PRESET, recipe=A)` and
`make_config(PRESET, recipe=B)` of the live trainer (or of --trainer SCRIPT, a frozen one), the
recipe field itself left out: what recipe B sets differently from recipe A.

Exit status: 0 with the comparison printed (an empty diff if the scripts are equal), 2 when there
is no predecessor or no script to compare, a file is missing, or a trainer refuses a recipe or
preset (its own message).
"""

import argparse
import ast
import dataclasses
import difflib
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root instead of records/ on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from records import runlogs  # noqa: E402

SCRIPT_NAME = "train_gpt_medium.py"
LIVE_TRAINER = Path(__file__).resolve().parents[1] / SCRIPT_NAME


class DiffError(Exception):
    """Nothing to diff: no predecessor, or no script in a folder."""


class TrainerImportError(DiffError):
    """A trainer script could not be imported to read its config (no torch, a broken script)."""


# -----------------------------------------------------------------------------
# Finding the records to compare

def _record_folder(record: Path) -> Path:
    """`record` with a name runlogs.record_name understands ("." and ".." resolved), else DiffError."""
    record = Path(record)
    if runlogs.record_name(record.name) is None:
        record = record.resolve()  # "." or "..": the folder's own name is only known resolved
    if runlogs.record_name(record.name) is None:
        raise DiffError(f"{record} is not a record folder named YYYY-MM-DD, YYYY-MM-DD_Name or YYYY-MM-DD-Name; "
                        "give OTHER to compare against")
    return record


def earlier_records(record: Path) -> list[Path]:
    """The sibling record folders that sort before `record` (by date, then name), oldest first."""
    record = _record_folder(record)
    siblings = [p.name for p in runlogs.record_folders(record.parent)]
    return [record.parent / name for name in siblings[: siblings.index(record.name)]]


def predecessor(record: Path) -> Path:
    """The sibling record folder just before `record` in date order."""
    before = earlier_records(record)
    if not before:
        raise DiffError(f"{record} has no predecessor: no record folder sorts before it in {Path(record).resolve().parent}")
    return before[-1]


def nearest(record: Path) -> tuple[Path, int]:
    """(the earlier record whose script differs least from `record`'s, its changed-line count).

    Ties go to the later record. Earlier folders without a script are skipped with a warning.
    """
    new_text, _ = read_script(record)
    best = None
    for folder in earlier_records(record):
        try:
            old_text, _ = read_script(folder)
        except DiffError as e:
            print(f"warning: --nearest skips {folder.name}: {e}", file=sys.stderr)
            continue
        added, removed = line_counts(old_text, new_text)
        if best is None or added + removed <= best[1]:
            best = (folder, added + removed)
    if best is None:
        raise DiffError(f"{record} has no earlier record folder with a script to compare against")
    return best


# -----------------------------------------------------------------------------
# Scripts: the folder's .py file, else the source embedded in its first log

def _logs(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.txt"))


def folder_scripts(folder: Path) -> list[tuple[str, str]]:
    """[(file name, script text)] of every script in a folder: its .py file and each log's embedded source."""
    found = []
    script = Path(folder) / SCRIPT_NAME
    if script.is_file():  # with its triton_kernels.py where its logs embed that
        found.append((SCRIPT_NAME, runlogs.logged_source(script)))
    for log in _logs(folder):
        source = runlogs.embedded_source(log.read_text(encoding="utf-8", errors="replace"))
        if source is not None:
            found.append((log.name, source))
    return found


def read_script(source: Path) -> tuple[str, str]:
    """(source text, label) of a .py file, or of a record folder's script.

    A folder's script is its train_gpt_medium.py, else the source embedded at the top of its first
    log (by name): everything before the first line of exactly 100 `=`. A script that logs the
    triton_kernels.py beside it comes with that file, as its logs embed it (runlogs.logged_source).
    """
    source = Path(source)
    if source.is_file() and source.suffix == ".py":
        return runlogs.logged_source(source), str(source)
    if not source.is_dir():
        raise DiffError(f"{source} is neither a record folder nor a .py file")
    folder = source.resolve().name  # labels name the folder even when it was given as "."
    script = source / SCRIPT_NAME
    if script.is_file():
        return runlogs.logged_source(script), f"{folder}/{SCRIPT_NAME}"
    logs = _logs(source)
    if not logs:
        raise DiffError(f"{source} has neither {SCRIPT_NAME} nor a *.txt log to take the script from")
    text = runlogs.embedded_source(logs[0].read_text(encoding="utf-8", errors="replace"))
    if text is None:
        raise DiffError(f"{source}: log {logs[0].name} has no line of 100 '=' ending an embedded script")
    return text, f"{folder}/{logs[0].name} (embedded source)"


def script_warning(folder: Path) -> str | None:
    """A warning when a folder holds more than one distinct script, naming the files and the one read_script uses."""
    if not Path(folder).is_dir():
        return None
    by_digest: dict[str, list[str]] = {}
    for name, text in folder_scripts(folder):
        by_digest.setdefault(runlogs.script_digest(text), []).append(name)
    if len(by_digest) < 2:
        return None
    kinds = "; ".join(", ".join(names) for names in by_digest.values())
    _, used = read_script(folder)
    return f"{Path(folder).resolve().name} holds {len(by_digest)} distinct scripts ({kinds}); compared: {used}"


def _lines(text: str) -> list[str]:
    # The logger prints the source with one more newline than the file has; trailing blank lines
    # would otherwise show up as a change whenever one side comes from a log.
    return text.rstrip("\n").splitlines()


def line_counts(old_text: str, new_text: str) -> tuple[int, int]:
    """(lines added, lines removed) from old to new, as the unified diff counts them."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, _lines(old_text), _lines(new_text)).get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed


def unified_diff(old: Path, new: Path) -> str:
    """The unified diff from old's script to new's, each labelled with where it came from."""
    (old_text, old_label), (new_text, new_label) = read_script(old), read_script(new)
    return "".join(line + "\n" for line in difflib.unified_diff(
        _lines(old_text), _lines(new_text), fromfile=old_label, tofile=new_label, lineterm=""))


# A section starts at a banner: a rule of `=` or `-` followed by a `# Title` line (train_gpt_medium.py's
# numbered `# ====` sections); inside it, `# ---- title` on one line starts a sub-section.
_RULE = re.compile(r"# [=-]{5,}\s*")
_TITLED_RULE = re.compile(r"# -{3,} (.+)")
TOP = "(top of file)"


def _short(title: str) -> str:
    """A banner's title up to its first ': ', ' (' or '; ' ("4. Model", "--attention=fa3", "the model"):
    the rest describes it."""
    return re.split(r": | \(|; ", title.strip(), maxsplit=1)[0]


def _units(lines: list[str], banner_lines: set[int]) -> list[str | None]:
    """For each line, the top-level class or def it belongs to ("class MLP", "def attend"), else None.

    A class/def spans its decorators and the comment lines right above it (up to a blank line or a
    banner). A script that does not parse has no units: its lines go by banners alone."""
    units: list[str | None] = [None] * len(lines)
    try:
        tree = ast.parse("\n".join(lines))
    except (SyntaxError, ValueError):
        return units
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        while start > 0 and lines[start - 1].startswith("#") and start - 1 not in banner_lines:
            start -= 1
        name = f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {node.name}"
        units[start:node.end_lineno] = [name] * (node.end_lineno - start)
    return units


def line_sections(lines: list[str]) -> list[tuple[str, str | None]]:
    """For each line, (its section, its place in the section or None).

    The section is the title of the last rule-and-title banner above ("(top of file)" before the
    first). The place is the top-level class/def that holds the line, else the last `# ---- title`
    sub-banner of the section above it: a sub-banner's comment does not end, so it names only the
    lines outside any class/def (train_gpt_medium.py's MLP class follows the fa3 sub-banner, but
    is not part of it)."""
    banner_lines, starts = set(), {}
    for i, line in enumerate(lines):
        titled = _TITLED_RULE.fullmatch(line)
        if titled and not _RULE.fullmatch(line):
            banner_lines.add(i)
            starts[i] = ("sub", _short(titled[1]))
        elif _RULE.fullmatch(line) and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            banner_lines.update((i, i + 1))
            starts[i] = ("section", _short(lines[i + 1][2:]))
    units = _units(lines, banner_lines)
    out, section, sub = [], TOP, None
    for i in range(len(lines)):
        kind, title = starts.get(i, (None, None))
        if kind == "section":
            section, sub = title, None
        elif kind == "sub":
            sub = title
        out.append((section, units[i] or sub))
    return out


def diff_stat(old: Path, new: Path) -> str:
    """A summary of the script change: lines added and removed in all, per section of the script, and
    under each section per class/def (or sub-banner) it touches."""
    (old_text, old_label), (new_text, new_label) = read_script(old), read_script(new)
    a, b = _lines(old_text), _lines(new_text)
    old_sections, new_sections = line_sections(a), line_sections(b)
    per_section: dict[str, list[int]] = {}
    per_place: dict[str, dict[str, list[int]]] = {}

    def count(where: tuple[str, str | None], side: int) -> None:
        section, place = where
        per_section.setdefault(section, [0, 0])[side] += 1
        if place is not None:
            per_place.setdefault(section, {}).setdefault(place, [0, 0])[side] += 1

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag == "equal":
            continue
        for j in range(j1, j2):
            count(new_sections[j], 0)
        for i in range(i1, i2):
            count(old_sections[i], 1)
    added, removed = sum(v[0] for v in per_section.values()), sum(v[1] for v in per_section.values())
    out = [f"{old_label} -> {new_label}: {added} line(s) added, {removed} removed"]
    counts = list(per_section.values()) + [v for places in per_place.values() for v in places.values()]
    width = max((len(f"+{v[0]} -{v[1]}") for v in counts), default=0)
    for name, v in per_section.items():
        out.append(f"  {f'+{v[0]} -{v[1]}':<{width}}  {name}")
        out += [f"      {f'+{c[0]} -{c[1]}':<{width}}  {place}" for place, c in per_place.get(name, {}).items()]
    return "\n".join(out) + "\n"


# -----------------------------------------------------------------------------
# Configs: the `config` lines of each folder's first log

def first_log(source: Path) -> tuple[runlogs.RunLog, str] | str:
    """(the first log of a folder, read, its label), or a sentence saying why there is no config to compare."""
    source = Path(source)
    if not source.is_dir():
        return f"{source} is a script, not a folder of logs"
    logs = _logs(source)
    name = source.resolve().name
    if not logs:
        return f"{name} has no log"
    log = runlogs.read_log(logs[0])
    if not log.config:
        return f"{name}/{logs[0].name} has no config lines (upstream log format)"
    return log, f"{name}/{logs[0].name}"


def config_report(old: Path, new: Path) -> str:
    """The config section of the output: the experiment-defining fields that differ old -> new, or why
    no comparison was made."""
    sides = [first_log(old), first_log(new)]
    reasons = [s for s in sides if isinstance(s, str)]
    if reasons:
        return f"config not compared: {'; '.join(reasons)}\n"
    (old_log, old_label), (new_log, new_label) = sides
    changed = runlogs.config_differences(old_log, new_log)
    rules = sorted({runlogs.rule_of(old_log), runlogs.rule_of(new_log)})
    head = f"config {old_label} -> {new_label} (compared: {'; '.join(rules)})"
    names = name_lines(old_log, new_log)
    if not changed:
        return "\n".join([f"{head}: no difference"] + names) + "\n"
    return "\n".join([f"{head}:"] + names + [f"  {k}: {a} -> {b}" for k, (a, b) in changed.items()]) + "\n"


def _name(log: runlogs.RunLog, field: str) -> str | None:
    """A name field's logged value without its quotes ('bulk' -> bulk), None when not logged."""
    value = log.config.get(field)
    if value is None:
        return None
    try:
        return str(ast.literal_eval(value))
    except (ValueError, SyntaxError):
        return value


def name_lines(old: runlogs.RunLog, new: runlogs.RunLog) -> list[str]:
    """Which recipe each side ran (and the presets, when they differ): bookkeeping fields, so not in
    the experiment comparison, but what a diff of two recipes is about. Nothing for fields neither
    log has."""
    out = []
    for field in ("recipe", "preset"):
        a, b = _name(old, field), _name(new, field)
        if a is None and b is None or (a == b and field != "recipe"):
            continue
        missing = "(not logged)"
        out.append(f"  {field}: {a} (both)" if a == b else f"  {field}: {a or missing} -> {b or missing}")
    return out


# -----------------------------------------------------------------------------
# Configs by value: a trainer's make_config, imported (two scripts' defaults, two recipes of one)

def load_trainer(path: Path):
    """The trainer module at `path`, imported once per session. The live script is train_gpt_medium
    (the module its tests patch); any other is imported under a name of its own, <its folder>_trainer
    (as tests/golden/make_golden.py names the frozen one), with a digest of its path added when that
    name is taken by another file, so that two scripts of one name never stand in for each other."""
    path = Path(path).resolve()
    name = "train_gpt_medium" if path == LIVE_TRAINER else f"{path.parent.name}_trainer"
    for candidate in (name, f"{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"):
        module = sys.modules.get(candidate)
        if module is None:
            break
        if Path(getattr(module, "__file__", "") or "").resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location(candidate, path)
    if spec is None:  # no loader for the suffix
        raise DiffError(f"{path} is not a .py script: a trainer is a train_gpt_medium.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[candidate] = module  # before running it: dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[candidate]
        raise TrainerImportError(f"{path} cannot be imported to read its config ({type(e).__name__}: {e})") from None
    if not callable(getattr(module, "make_config", None)):
        raise DiffError(f"{path} has no make_config: not a trainer script")
    return module


def defines_make_config(text: str) -> bool:
    """Whether a script's source defines make_config at its top level (a trainer), read without importing it."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == "make_config" for node in tree.body)


def config_values(trainer, preset: str | None, **recipe) -> dict:
    """{field: value} of trainer.make_config(preset, recipe=...), the trainer's own defaults where
    not given. A ConfigError (unknown recipe or preset) becomes a DiffError with the trainer's message."""
    try:
        config = trainer.make_config(*([preset] if preset is not None else []), **recipe)
    except (ValueError, TypeError) as e:  # the trainers' ConfigError is a ValueError
        raise DiffError(str(e)) from None
    return dataclasses.asdict(config)


def _as_typed(trainer):
    """A function giving a value as one would type it (the trainer's to_text); "(empty)" for an empty tuple."""
    to_text = getattr(trainer, "to_text", repr)
    return lambda value: to_text(value) or "(empty)"


def value_differences(trainer_a, a: dict, trainer_b, b: dict, skip: tuple = ()) -> list[str]:
    """`  field: a -> b` for each field in both whose values differ (the recipe first, then in a's
    field order), then `  field: only in old (a)` and `  field: only in new (b)`; values as one would
    type them, fields in `skip` left out."""
    text_a, text_b = _as_typed(trainer_a), _as_typed(trainer_b)
    a = {k: a[k] for k in sorted(a, key=lambda k: k != "recipe")}  # which recipe each side is, before its values
    both = [f"  {k}: {text_a(a[k])} -> {text_b(b[k])}" for k in a if k in b and a[k] != b[k] and k not in skip]
    return (both + [f"  {k}: only in old ({text_a(a[k])})" for k in a if k not in b and k not in skip]
            + [f"  {k}: only in new ({text_b(b[k])})" for k in b if k not in a and k not in skip])


def script_config_report(old: Path, new: Path, preset: str | None) -> str:
    """The config section for two scripts: the fields of their default configs that differ, when
    both are trainers; else why not."""
    others = [str(p) for p in (old, new) if not defines_make_config(Path(p).read_text(encoding="utf-8"))]
    if others:
        verb = "defines" if len(others) == 1 else "define"
        return f"config not compared: {' and '.join(others)} {verb} no make_config (not a trainer)\n"
    try:
        trainer_a, trainer_b = load_trainer(old), load_trainer(new)
    except TrainerImportError as e:  # the diff above still stands
        return f"config not compared: {e}\n"
    a, b = config_values(trainer_a, preset), config_values(trainer_b, preset)
    call = "make_config()" if preset is None else f"make_config({preset!r})"
    head = f"config {old} -> {new} ({call}: each script's defaults)"
    lines = value_differences(trainer_a, a, trainer_b, b)
    return "\n".join([f"{head}:" if lines else f"{head}: no difference"] + lines) + "\n"


def recipes_report(trainer_path: Path | None, recipe_a: str, recipe_b: str, preset: str | None) -> str:
    """The fields whose values differ between two recipes of one trainer (the recipe field left out)."""
    trainer = load_trainer(trainer_path or LIVE_TRAINER)
    try:
        a = config_values(trainer, preset, recipe=recipe_a)
        b = config_values(trainer, preset, recipe=recipe_b)
    except DiffError as e:
        frozen = getattr(trainer, "FROZEN_SCRIPT", None)
        if frozen and {recipe_a, recipe_b} & set(getattr(trainer, "FROZEN_RECIPES", ())):
            raise DiffError(f"{e}; here: --trainer {frozen} --recipes {recipe_a} {recipe_b}") from None
        raise
    label = str(trainer_path) if trainer_path is not None else SCRIPT_NAME
    head = f"recipes {recipe_a} -> {recipe_b} of {label} (make_config({(preset or 'medium')!r}, recipe=...))"
    lines = value_differences(trainer, a, trainer, b, skip=("recipe",))
    return "\n".join([f"{head}:" if lines else f"{head}: no difference"] + lines) + "\n"


def _need_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DiffError(f"no such file: {path} ({what})")
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 comparison printed, 2 nothing to compare)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, nargs="?",
                        help="the record folder, or the older of two .py scripts (OLD.py NEW.py)")
    parser.add_argument("other", type=Path, nargs="?",
                        help="record folder or .py file (default: the predecessor); after OLD.py, the newer script")
    parser.add_argument("--nearest", action="store_true",
                        help="compare with the earlier record whose script differs least, not the previous by date")
    parser.add_argument("--stat", action="store_true", help="print added/removed line counts per section, not the diff")
    parser.add_argument("--recipes", nargs=2, metavar=("A", "B"),
                        help="the config values recipe B sets differently from recipe A (of the live trainer)")
    parser.add_argument("--trainer", type=Path, help="with --recipes: the trainer script whose recipes are compared")
    parser.add_argument("--preset", help="the preset of the compared configs (two trainers, --recipes); default: "
                                         "each trainer's own (medium)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help exits 0; return them instead of raising
        return e.code
    try:
        if args.recipes:
            if args.record or args.nearest or args.stat:
                raise DiffError("--recipes A B compares two recipes' values: give it without RECORD, scripts, "
                                "--nearest or --stat")
            if args.trainer is not None:
                _need_file(args.trainer, "--trainer: a train_gpt_medium.py")
            sys.stdout.write(recipes_report(args.trainer, *args.recipes, args.preset))
            return 0
        if args.trainer is not None:
            raise DiffError("--trainer goes with --recipes A B (two scripts: give them as OLD.py NEW.py)")
        if args.record is None:
            raise DiffError("give a record folder, two .py scripts (OLD.py NEW.py) or --recipes A B")
        if args.record.suffix == ".py":  # two scripts: no logs, so their default configs stand for the config part
            if args.other is None or args.other.suffix != ".py":
                raise DiffError(f"{args.record} is a script: give the newer script after it (OLD.py NEW.py)")
            if args.nearest:
                raise DiffError("--nearest looks among record folders: it does not go with two scripts")
            old = _need_file(args.record, "the older script")
            new = _need_file(args.other, "the newer script")
            config = script_config_report(old, new, args.preset)  # first: a bad --preset prints nothing else
            sys.stdout.write(diff_stat(old, new) if args.stat else unified_diff(old, new))
            sys.stdout.write(config)
            return 0
        if args.preset is not None:
            raise DiffError("--preset goes with two scripts or --recipes A B; a record's config is its logs'")
        if args.nearest and args.other:
            raise DiffError("give OTHER or --nearest, not both")
        if not args.record.is_dir():
            raise DiffError(f"no such record folder: {args.record}")
        other = args.other
        if args.nearest:
            other, changed = nearest(args.record)
            print(f"nearest earlier record: {other.name} ({changed} changed line(s))", file=sys.stderr)
        other = other or predecessor(args.record)
        for folder in (other, args.record):
            warning = script_warning(folder)
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
        sys.stdout.write(diff_stat(other, args.record) if args.stat else unified_diff(other, args.record))
        sys.stdout.write(config_report(other, args.record))
    except (DiffError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from tools.cli import run_main
    run_main(main)
