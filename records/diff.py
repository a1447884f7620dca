"""The change a record makes: the unified diff of its training script against its predecessor.

    python records/diff.py RECORD [OTHER]

RECORD is a record folder `<YYYY-MM-DD>_<Name>/`. Without OTHER the diff is against the record
folder just before it among its siblings (date order, ties by name); OTHER may be another record
folder or a .py file. Exit status: 0 with the diff printed (empty if the scripts are equal),
2 when there is no predecessor or no script to compare.
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

RECORD_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}_.+")
SCRIPT_NAME = "train_gpt_medium.py"
SEPARATOR = "=" * 100  # ends the source embedded at the top of every log


class DiffError(Exception):
    """Nothing to diff: no predecessor, or no script in a folder."""


def predecessor(record: Path) -> Path:
    """The sibling record folder just before `record` (names start with the date, so name order is date order)."""
    record = Path(record)
    if not RECORD_FOLDER.fullmatch(record.name):
        record = record.resolve()  # "." or "..": the folder's own name is only known resolved
    if not RECORD_FOLDER.fullmatch(record.name):
        raise DiffError(f"{record} is not a record folder named <YYYY-MM-DD>_<Name>; give OTHER to compare against")
    siblings = sorted(p.name for p in record.parent.iterdir() if p.is_dir() and RECORD_FOLDER.fullmatch(p.name))
    before = siblings[: siblings.index(record.name)]
    if not before:
        raise DiffError(f"{record} has no predecessor: no record folder sorts before it in {record.parent}")
    return record.parent / before[-1]


def read_script(source: Path) -> tuple[str, str]:
    """(source text, label) of a .py file, or of a record folder's script.

    A folder's script is its train_gpt_medium.py, else the source embedded at the top of its first
    log (by name): everything before the first line of exactly 100 `=`.
    """
    source = Path(source)
    if source.is_file() and source.suffix == ".py":
        return source.read_text(encoding="utf-8"), str(source)
    if not source.is_dir():
        raise DiffError(f"{source} is neither a record folder nor a .py file")
    folder = source.resolve().name  # labels name the folder even when it was given as "."
    script = source / SCRIPT_NAME
    if script.is_file():
        return script.read_text(encoding="utf-8"), f"{folder}/{SCRIPT_NAME}"
    logs = sorted(source.glob("*.txt"))
    if not logs:
        raise DiffError(f"{source} has neither {SCRIPT_NAME} nor a *.txt log to take the script from")
    lines = logs[0].read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    ends = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == SEPARATOR]
    if not ends:
        raise DiffError(f"{source}: log {logs[0].name} has no line of 100 '=' ending an embedded script")
    return "".join(lines[: ends[0]]), f"{folder}/{logs[0].name} (embedded source)"


def unified_diff(old: Path, new: Path) -> str:
    """The unified diff from old's script to new's, each labelled with where it came from."""
    (old_text, old_label), (new_text, new_label) = read_script(old), read_script(new)
    # The logger prints the source with one more newline than the file has; trailing blank lines
    # would otherwise show up as a change whenever one side comes from a log.
    old_lines, new_lines = old_text.rstrip("\n").splitlines(), new_text.rstrip("\n").splitlines()
    return "".join(line + "\n" for line in difflib.unified_diff(
        old_lines, new_lines, fromfile=old_label, tofile=new_label, lineterm=""))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 diff printed, 2 nothing to diff)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="the record folder")
    parser.add_argument("other", type=Path, nargs="?", help="record folder or .py file (default: the predecessor)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors exit 2, --help exits 0; return them instead of raising
        return e.code
    try:
        if not args.record.is_dir():
            raise DiffError(f"no such record folder: {args.record}")
        sys.stdout.write(unified_diff(args.other or predecessor(args.record), args.record))
    except (DiffError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
