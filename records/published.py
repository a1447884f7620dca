"""The upstream GPT-2 Medium speedrun records from 2025-09-11 on, as data (records/published.json).

Each record holds every run's final validation loss and training time as its README publishes
them, the step count, the record's name, recipe name, date and where in the upstream repository
the numbers come from. A claim made with this repository is compared with them: `stats.py
--time-vs bulk` tests a set of runs against a record's published times, and every text report of
medium-track runs says where they stand against the latest record.

Records claimed in upstream pull requests that are not merged (fp8_yarn, bigram, mudd) are in the
data too, marked with their pull request: `--time-vs mudd` tests against one and says what it is,
but the latest record, the one to beat by default, is the latest merged one.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().with_name("published.json")


@dataclass(frozen=True)
class LogStats:
    """What a claim's committed logs give: how many runs, their mean loss, the one-sided p against
    2.92 (None: fewer than 2 logs, no t-test) and their mean training time."""

    n: int
    mean_val_loss: float
    p: float | None
    mean_train_time_s: float


@dataclass(frozen=True)
class PublishedRecord:
    recipe: str | None  # x01, snoo, ...; None for a record outside the x01 lineage
    name: str
    date: str
    folder: str  # in the upstream repository
    steps: int
    val_loss: tuple[float, ...]
    train_time_s: tuple[float, ...] | None  # per run; None where only a mean is published
    mean_train_time_s: float  # the mean of train_time_s, or the published mean
    n_times: int  # how many runs the time figures are over
    source: str
    notes: str
    pr: int | None = None  # the upstream pull request of a claim; None for a record merged upstream
    merged: bool = True  # False: a claim whose pull request is not merged upstream
    url: str | None = None  # the pull request's address
    log_stats: LogStats | None = None  # a claim's statistics as its committed logs give them

    @property
    def is_claim(self) -> bool:
        return not self.merged

    @property
    def label(self) -> str:
        """e.g. `bulk (BulkSmallTrackTransfer, 2025-12-31)`, `mudd (MuddFormer, 2026-04-27, unmerged claim PR #261)`."""
        claim = f", unmerged claim PR #{self.pr}" if self.is_claim else ""
        return f"{self.recipe or self.name} ({self.name}, {self.date}{claim})"


@functools.lru_cache(maxsize=None)
def _load(path: Path) -> tuple[PublishedRecord, ...]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for r in data["records"]:
        times = tuple(r["train_time_s"]) if r.get("train_time_s") is not None else None
        mean = sum(times) / len(times) if times else r["mean_train_time_s"]
        claim = r.get("claim") or {}
        logs = claim.get("from_logs")
        out.append(PublishedRecord(r["recipe"], r["name"], r["date"], r["folder"], r["steps"], tuple(r["val_loss"]),
                                   times, mean, len(times) if times else r["n_times"], r["source"], r["notes"],
                                   claim.get("pr"), claim.get("merged", True), claim.get("url"),
                                   LogStats(**logs) if logs else None))
    return tuple(sorted(out, key=lambda r: r.date))


def load(path: Path = DATA) -> list[PublishedRecord]:
    """Every record in the data file, oldest first (read once per process)."""
    return list(_load(Path(path)))


def names(records: list[PublishedRecord] | None = None) -> list[str]:
    """The merged records' recipe names --time-vs accepts, oldest first."""
    return [r.recipe for r in (records or load()) if r.recipe and r.merged]


def claim_names(records: list[PublishedRecord] | None = None) -> list[str]:
    """The unmerged claims' names --time-vs also accepts, oldest first."""
    return [r.recipe for r in (records or load()) if r.recipe and r.is_claim]


def find(name: str, records: list[PublishedRecord] | None = None) -> PublishedRecord | None:
    """The record with this recipe name (x01, snoo, ...) or upstream name (case-insensitive), else None."""
    for r in records or load():
        if name and name.lower() in {r.name.lower(), *([r.recipe.lower()] if r.recipe else [])}:
            return r
    return None


def latest(records: list[PublishedRecord] | None = None) -> PublishedRecord:
    """The newest merged record of the lineage (one with a recipe name): the one a new claim must beat.
    An unmerged claim is not: its pull request may still change or be refused."""
    return [r for r in records or load() if r.recipe and r.merged][-1]
