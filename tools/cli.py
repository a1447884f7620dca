"""What the scripts in data/ and tools/ share: input errors reported as one line, exit code 2.

Every input error (a bad flag, a missing or unreadable file, an output folder that cannot be
written) prints `error: <file or flag>: <what is wrong and what to do>` on stderr and makes the
script exit with code 2, without a traceback, before anything is written.
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
