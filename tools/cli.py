"""What the scripts in data/ and tools/ share: input errors reported as one line, exit code 2.

Every input error (a bad flag, a missing or unreadable file, an output folder that cannot be
written) prints `error: <file or flag>: <what is wrong and what to do>` on stderr and makes the
script exit with code 2, without a traceback, before anything is written.

One policy for every output file the tools and the trainer write (output_file_problem): a missing
folder is made (where its nearest existing folder is writable), a folder is not a file, and a file
that exists is never overwritten unless asked (--overwrite where the tool has it); a file written
under a temporary name takes the umask's permissions when moved into place (move_into_place).

A reader that leaves early (`| head`) ends the script quietly (run_main: BrokenPipeError).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

USAGE_ERROR = 2  # the exit code of every input error, as argparse and the trainer use
ROOT = Path(__file__).resolve().parent.parent


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points to --help (argparse prints the usage first).
    `script` (the caller's __file__) names the program as typed from the repository root."""

    def __init__(self, script: str, **kwargs):
        super().__init__(prog=Path(script).resolve().relative_to(ROOT).as_posix(), **kwargs)

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"error: {message} (see {self.prog} --help)\n")


def fail(message: str) -> int:
    """Print one `error:` line on stderr; returns the exit code of an input error."""
    print(f"error: {message}", file=sys.stderr)
    return USAGE_ERROR


def first_line(error: BaseException) -> str:
    """An exception as one line (many libraries' messages run over several)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def os_error_line(error: OSError, fallback_path) -> str:
    """`<path>: <reason>` for an OSError, naming the file it concerns."""
    return f"{error.filename or fallback_path}: {error.strerror or first_line(error)}"


def output_folder_problem(folder: Path, flag: str) -> str | None:
    """Why `folder` cannot receive files (naming `flag`), or None when it can. Creates nothing:
    the nearest existing ancestor must be a writable folder."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == folder else f" (so {folder} cannot be created there)"
        return f"{flag} {folder}: {existing} is not a folder{where}; choose another {flag}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {folder}: {existing} is not writable; choose another {flag} or fix its permissions"
    return None


def output_file_problem(path: Path, flag: str, overwrite: bool = False, how: str = "pass --overwrite") -> str | None:
    """Why `path` cannot be written as a new output file (naming `flag`), or None when it can: not a
    folder; not an existing file unless `overwrite` (`how`: the way to allow it); its folder writable
    or creatable (make_parent makes it)."""
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path}: is a folder; give a file name"
    if path.exists() and not overwrite:
        return f"{flag} {path}: exists, and is kept; choose another name, or {how}"
    return output_folder_problem(path.parent, flag)


def make_parent(path: Path) -> None:
    """The folder of an output file, made with its parents where missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def move_into_place(temporary: Path, path: Path) -> None:
    """Rename a finished temporary file to `path` (atomically), with the permissions open() gives a new
    file (0666 less the umask), as every other output has: a library that writes through a private
    temporary file of its own (safetensors' save_file: mode 0600) would otherwise leave that mode."""
    umask = os.umask(0)  # read by setting it: the only portable way
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)
    os.replace(temporary, path)


def run_main(main, *args) -> None:
    """`sys.exit(main(*args))` for a script's __main__: a reader that closed the pipe (`| head`) ends
    it quietly, exit 0, with what it printed so far, instead of a BrokenPipeError traceback; Ctrl-C
    (SIGINT) ends it with one line and exit 130 (the shell's code for it), not a traceback."""
    try:
        code = main(*args)
        sys.stdout.flush()
    except KeyboardInterrupt:
        name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "the tool"
        print(f"\n{name}: interrupted (Ctrl-C); stopped", file=sys.stderr, flush=True)
        code = 130
    except BrokenPipeError:
        # the interpreter's own last flush would fail again: stdout goes to /dev/null from here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
