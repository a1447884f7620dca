"""records/diff.py beyond record folders (issue 21.7): two scripts (their diff and, for two
trainers, their default configs by value), two recipes of one trainer by their values, and the
one-line refusals. Record folders: tests/test_records.py."""
import subprocess
import sys

import pytest

import train_gpt_medium as tg
from records import diff as diff_cli

ROOT = diff_cli.LIVE_TRAINER.parent
FROZEN = ROOT / "records" / "x01_lineage" / "train_gpt_medium.py"

OLD_TRAINER = """from dataclasses import dataclass


@dataclass
class Hyperparameters:
    recipe: str = "x01"
    muon_lr: float = 0.025
    snoo_period: int = 0
    steps: int = 5690


def make_config(preset="medium"):
    if preset != "medium":
        raise ValueError(f"--preset: unknown preset {preset!r}; choose from ['medium']")
    return Hyperparameters()
"""
NEW_TRAINER = (OLD_TRAINER.replace('"x01"', '"bulk"').replace("0.025", "0.015")
               .replace("    snoo_period: int = 0\n", "").replace("5690\n", "5690\n    windows: tuple = (3, 7)\n"))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run(argv, capsys):
    code = diff_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_plain_scripts_give_their_diff_and_say_why_no_config(tmp_path, capsys):
    a, b = write(tmp_path / "a.py", "lr = 0.1\nsteps = 5\n"), write(tmp_path / "b.py", "lr = 0.2\nsteps = 5\n")
    code, out, err = run([a, b], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"--- {a}", f"+++ {b}", "@@ -1,2 +1,2 @@", "-lr = 0.1", "+lr = 0.2", " steps = 5",
        f"config not compared: {a} and {b} define no make_config (not a trainer)"]


def test_two_trainers_give_their_default_configs_by_value(tmp_path, capsys):
    # the same file name in folders of the same name: each is imported as itself, not as the other
    old, new = write(tmp_path / "a" / "x" / "t.py", OLD_TRAINER), write(tmp_path / "b" / "x" / "t.py", NEW_TRAINER)
    code, out, err = run([old, new, "--stat"], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{old} -> {new}: 3 line(s) added, 3 removed",
        "  +3 -3  (top of file)", "      +3 -3  class Hyperparameters",
        f"config {old} -> {new} (make_config(): each script's defaults):",
        "  recipe: 'x01' -> 'bulk'", "  muon_lr: 0.025 -> 0.015",
        "  snoo_period: only in old (0)", "  windows: only in new ((3, 7))"]
    code, out, _ = run([old, old, "--preset", "medium"], capsys)
    assert code == 0
    assert out == f"config {old} -> {old} (make_config('medium'): each script's defaults): no difference\n"


def test_a_trainer_that_cannot_be_imported_still_gets_its_diff(tmp_path, capsys):
    old = write(tmp_path / "old.py", OLD_TRAINER)
    new = write(tmp_path / "new.py", OLD_TRAINER + 'raise RuntimeError("boom")\n')
    code, out, err = run([old, new], capsys)
    assert (code, err) == (0, "")
    assert '+raise RuntimeError("boom")' in out
    assert out.splitlines()[-1] == (f"config not compared: {new} cannot be imported to read its config "
                                    "(RuntimeError: boom)")


def test_the_readme_command_diffs_the_frozen_script_against_the_live_one():
    """README's "Earlier records (frozen)" command, run as it stands there: the x01 -> bulk change as
    sections, classes and defs, then as the values of the two default configs."""
    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines()
               if ln.startswith("python records/diff.py records/x01_lineage/")]
    proc = subprocess.run([sys.executable, *line.split()[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    out = proc.stdout.splitlines()
    assert out[0].startswith("records/x01_lineage/train_gpt_medium.py -> train_gpt_medium.py: ")
    sections = [ln.split(None, 2)[2] for ln in out if ln.startswith("  +")]
    places = [ln.split(None, 2)[2] for ln in out if ln.startswith("      +")]
    assert "2. Schedules" in sections and "1. Hyperparameters" in sections
    assert {"class Snoo", "class NorMuon", "class Muon", "class HeadSmear", "def lr_multiplier"} <= set(places)
    config = out.index("config records/x01_lineage/train_gpt_medium.py -> train_gpt_medium.py "
                       "(make_config(): each script's defaults):")
    values = out[config + 1:]
    assert values[0] == "  recipe: x01 -> bulk"
    assert {"  muon_lr: 0.025 -> 0.015", "  num_iterations: 5690 -> 4740", "  attention_free_layers: 7 -> (empty)",
            "  snoo_period: only in old (0)", "  head_smear: only in old (false)"} <= set(values)


def test_two_recipes_of_the_frozen_trainer_by_their_values(capsys):
    code, out, err = run(["--trainer", FROZEN, "--recipes", "x01", "smear"], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"recipes x01 -> smear of {FROZEN} (make_config('medium', recipe=...)):",
        "  num_iterations: 5690 -> 5535", "  muon_lr: 0.025 -> 0.03", "  snoo_period: 0 -> 28",
        "  muon_update_smoothing: off -> ema", "  lr_floor: 0.0 -> 0.01", "  backout: off -> mix",
        "  head_smear: false -> true"]


def test_two_recipes_of_the_live_trainer_by_their_values(monkeypatch, capsys):
    monkeypatch.setitem(tg.RECIPES, "hot", tg.Recipe(dict(muon_lr=0.02, num_iterations=4000), "2026-01-01",
                                                     "2026-01-01_Hot", "a hotter Muon", 1000.0, 2, 0.001, 1))
    code, out, err = run(["--recipes", "bulk", "hot"], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == ["recipes bulk -> hot of train_gpt_medium.py (make_config('medium', recipe=...)):",
                                "  num_iterations: 4740 -> 4000", "  muon_lr: 0.015 -> 0.02"]
    # the tiny preset keeps its own step count (a preset's fields win over a recipe's)
    code, out, _ = run(["--recipes", "bulk", "hot", "--preset", "tiny"], capsys)
    assert code == 0 and out.splitlines()[1:] == ["  muon_lr: 0.015 -> 0.02"]
    code, out, _ = run(["--recipes", "hot", "hot"], capsys)
    assert code == 0 and out.endswith("(make_config('medium', recipe=...)): no difference\n")


@pytest.mark.parametrize("argv, message", [
    (["nope.py", "train_gpt_medium.py"], "no such file: nope.py (the older script)"),
    (["train_gpt_medium.py", "nope.py"], "no such file: nope.py (the newer script)"),
    (["train_gpt_medium.py"], "train_gpt_medium.py is a script: give the newer script after it (OLD.py NEW.py)"),
    (["--recipes", "bulk", "nope"], "--recipe: unknown recipe 'nope'; choose from bulk"),
    (["--recipes", "bulk", "smear"], "; here: --trainer records/x01_lineage/train_gpt_medium.py --recipes bulk smear"),
    (["--recipes", "bulk", "bulk", "--preset", "huge"], "--preset: unknown preset 'huge'"),
    (["--trainer", "nope.py", "--recipes", "x01", "smear"], "no such file: nope.py (--trainer"),
    (["--trainer", "README.md", "--recipes", "x01", "smear"], "README.md is not a .py script"),
    (["--trainer", str(FROZEN)], "--trainer goes with --recipes A B"),
    ([], "give a record folder, two .py scripts (OLD.py NEW.py) or --recipes A B"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith("error: ") and message in err


def test_a_script_that_is_not_a_trainer_is_refused_as_trainer(tmp_path, capsys):
    plain = write(tmp_path / "plain.py", "lr = 0.1\n")
    code, out, err = run(["--trainer", plain, "--recipes", "a", "b"], capsys)
    assert (code, out) == (2, "") and err == f"error: {plain.resolve()} has no make_config: not a trainer script\n"
