"""Golden outputs: a refactor of train_gpt_medium.py must leave training unchanged.

tests/golden/make_golden.py recorded them; its docstring says what a machine kind is, when to
regenerate and how the tolerance was measured. The tiny run is compared bit for bit on a machine
kind that has a golden entry, and within the file's tolerance (make_golden.tolerance_of) of every entry elsewhere; the test
says which (its assertion message, the `golden_comparison` property, and a line at the end of the
pytest run)."""
import copy
import json
import math

import pytest

import make_golden  # tests/golden, on sys.path through tests/conftest.py

TINY_GOLDEN = json.loads(make_golden.TINY_FILE.read_text())
DRY_RUN_GOLDEN = json.loads(make_golden.DRY_RUN_FILE.read_text())


@pytest.mark.slow
def test_tiny_preset_validation_history_is_the_golden_one(tiny_seed0_run, record_property):
    record = make_golden.history_record(tiny_seed0_run["result"], tiny_seed0_run["log"])
    what, failures = make_golden.compare(record, TINY_GOLDEN, make_golden.machine_kind())
    record_property("golden_comparison", f"tiny run at --seed=0 compared {what}")
    assert not failures, f"compared {what}: " + "; ".join(failures)


@pytest.mark.parametrize("name", sorted(DRY_RUN_GOLDEN))
def test_dry_run_json_is_the_golden_one(name):
    """Integer counts and FLOPs made of integer products and sums: the same bits on every machine."""
    expected = DRY_RUN_GOLDEN[name]
    assert make_golden.dry_run_json(expected["argv"]) == expected["json"]


# ---- the comparison rule itself, on the recorded entries (no training)


def test_the_recorded_machine_kinds_agree_within_the_tolerance():
    """Each entry is the same run on another kind of machine: they differ, but by less than the tolerance."""
    entries = TINY_GOLDEN["entries"]
    assert len(entries) >= 2 and len({json.dumps(e["machine_kind"], sort_keys=True) for e in entries}) == len(entries)
    for e in entries:
        assert set(e["machine_kind"]) == set(make_golden.MACHINE_KIND_FIELDS)
        assert [h["step"] for h in e["val_history"]] == TINY_GOLDEN["steps"]
        for other in entries:
            assert max(make_golden.differences(e, other).values()) <= make_golden.tolerance_of(TINY_GOLDEN)


def nudged(entry: dict, ulps: int = 0, by: float = 0.0) -> dict:
    """A copy of a golden entry's record whose final val_loss moved up by some ulps or by an amount."""
    record = copy.deepcopy({k: entry[k] for k in ("step0_train_loss_line", "val_history")})
    final = float.fromhex(record["val_history"][-1]["val_loss"])
    for _ in range(ulps):
        final = math.nextafter(final, math.inf)
    record["val_history"][-1]["val_loss"] = (final + by).hex()
    return record


def known_entry() -> dict:
    """An entry whose machine kind is fully recorded (so it can be matched bit for bit)."""
    return next(e for e in TINY_GOLDEN["entries"] if None not in e["machine_kind"].values())


def test_on_a_recorded_machine_kind_one_ulp_fails():
    entry = known_entry()
    what, failures = make_golden.compare(nudged(entry), TINY_GOLDEN, entry["machine_kind"])
    assert what.startswith("bit for bit") and failures == []
    what, failures = make_golden.compare(nudged(entry, ulps=1), TINY_GOLDEN, entry["machine_kind"])
    assert what.startswith("bit for bit") and len(failures) == 1


def test_on_another_machine_kind_the_tolerance_decides():
    entry = known_entry()
    elsewhere = {**entry["machine_kind"], "cpu_model": "a CPU never recorded"}
    tolerance = make_golden.tolerance_of(TINY_GOLDEN)
    what, failures = make_golden.compare(nudged(entry, by=tolerance / 10), TINY_GOLDEN, elsewhere)
    assert what.startswith(f"within {tolerance:g}") and "a CPU never recorded" in what and failures == []
    _, failures = make_golden.compare(nudged(entry, by=3 * tolerance), TINY_GOLDEN, elsewhere)
    assert len(failures) == len(TINY_GOLDEN["entries"])


def test_an_unknown_field_matches_no_machine():
    entry = known_entry()
    kind = entry["machine_kind"]
    assert make_golden.same_kind(kind, dict(kind))
    assert not make_golden.same_kind({**kind, "cpu_capability": None}, {**kind, "cpu_capability": None})
    for field in make_golden.MACHINE_KIND_FIELDS:
        assert not make_golden.same_kind(kind, {**kind, field: "other"}), field
