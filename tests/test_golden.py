"""Golden outputs: a refactor of train_gpt_medium.py must leave training bit-for-bit unchanged.

tests/golden/make_golden.py recorded them (see its docstring for when to regenerate)."""
import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
make_golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_golden)


@pytest.mark.slow
def test_tiny_preset_validation_history_is_bit_for_bit_the_golden_one(tmp_path, monkeypatch):
    monkeypatch.chdir(make_golden.ROOT)
    expected = json.loads((GOLDEN / "tiny_seed0.json").read_text())
    assert make_golden.tiny_history(tmp_path) == expected


@pytest.mark.parametrize("name", sorted(json.loads((GOLDEN / "dry_run.json").read_text())))
def test_dry_run_json_is_the_golden_one(name):
    expected = json.loads((GOLDEN / "dry_run.json").read_text())[name]
    assert make_golden.dry_run_json(expected["argv"]) == expected["json"]
