"""The frozen x01-lineage script, records/x01_lineage/train_gpt_medium.py: its tiny golden run and
dry-run JSONs (records/x01_lineage/golden/, compared by tests/golden/make_golden.py's rule), its
command line, and that it needs nothing from the live script at the repository root. It is loaded
under its own module name (x01_lineage_trainer) or run as a process, never as train_gpt_medium."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

import make_golden  # tests/golden, on sys.path through tests/conftest.py

ROOT = make_golden.ROOT
FROZEN = make_golden.X01_LINEAGE / "train_gpt_medium.py"
TINY_FILE, DRY_RUN_FILE, DRY_RUNS = make_golden.GOLDEN_SETS[FROZEN]
TINY_GOLDEN = json.loads(TINY_FILE.read_text())
DRY_RUN_GOLDEN = json.loads(DRY_RUN_FILE.read_text())
LINEAGE = make_golden.X01_LINEAGE_RECIPES


# The frozen run is compared over its first half: the step-0 loss and the validations at steps 0,
# 50 and 100 of its 200 (its schedule unchanged). The script never changes, so what could move its
# numbers is the machine, torch or the synthetic data, and each moves the first half too; the whole
# run costs about 110 CPU-seconds on a 2-core AMD EPYC (AVX2), the suite's second most expensive
# test. make_golden.py still records the whole run; the live script's golden run is compared whole.
FROZEN_PREFIX_STEPS = 100


@pytest.mark.slow
def test_frozen_tiny_run_is_its_golden_one_over_its_first_half(tmp_path, record_property):
    run = make_golden.quiet_tiny_run(tmp_path, trainer=FROZEN, until_step=FROZEN_PREFIX_STEPS)
    result, log = run["result"], run["log"]
    record = make_golden.history_record(result, log)
    golden = make_golden.golden_prefix(TINY_GOLDEN, FROZEN_PREFIX_STEPS)
    assert golden["steps"] == [0, 50, 100] and [h["step"] for h in result["val_history"]] == golden["steps"]
    what, failures = make_golden.compare(record, golden, make_golden.machine_kind())
    record_property("golden_comparison", f"frozen x01-lineage tiny run at --seed=0, steps 0-{FROZEN_PREFIX_STEPS} "
                                         f"of 200, compared {what}")
    assert not failures, f"compared {what}: " + "; ".join(failures)
    assert log.read_text().startswith(FROZEN.read_text())  # the log embeds the frozen script, not the live one


@pytest.mark.parametrize("name", sorted(DRY_RUN_GOLDEN))
def test_frozen_dry_run_json_is_the_golden_one(name):
    expected = DRY_RUN_GOLDEN[name]
    assert make_golden.dry_run_json(expected["argv"], trainer=FROZEN) == expected["json"]


def test_the_golden_files_pin_each_record_of_the_lineage():
    assert set(DRY_RUN_GOLDEN) == set(DRY_RUNS) and {f"recipe_{n}" for n in LINEAGE} <= set(DRY_RUN_GOLDEN)
    assert TINY_GOLDEN["argv"] == make_golden.TINY_ARGV and len(TINY_GOLDEN["entries"]) >= 1
    tg = make_golden.load_trainer(FROZEN)
    assert [r.date for name, r in tg.RECIPES.items() if name in LINEAGE] == [
        "2025-09-11", "2025-09-16", "2025-09-17", "2025-09-30", "2025-10-04", "2025-11-02"]


def test_it_is_loaded_under_its_own_name_beside_the_live_script():
    import train_gpt_medium as live
    frozen = make_golden.load_trainer(FROZEN)
    assert frozen.__name__ == "x01_lineage_trainer" and frozen is not live
    assert frozen.__file__ == str(FROZEN) and make_golden.load_trainer(FROZEN) is frozen


@pytest.mark.parametrize("name", LINEAGE)
def test_each_recipe_dry_runs_under_the_tiny_preset(name):
    """The recipe keeps its switches, the preset its scale (200 steps); backout adds its 2 mixing
    weights, smear also the smear weight."""
    tg = make_golden.load_trainer(FROZEN)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tg.main(["--dry_run", f"--recipe={name}", "--preset", "tiny"]) == 0
    lines = out.getvalue().splitlines()
    assert f"recipe = {name!r}" in lines and "num_iterations = 200" in lines
    extra = {"backout": 2, "smear": 3}.get(name, 0)
    assert json.loads(lines[-1])["total_params"] == DRY_RUN_GOLDEN["tiny"]["json"]["total_params"] + extra


def python_env():
    """No PYTHONPATH; Python's own bytecode cache off, so that "writes nothing" is about the script
    (with it on, an import writes __pycache__/ beside the copied script)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "CUDA_VISIBLE_DEVICES": "",
            "PYTHONDONTWRITEBYTECODE": "1"}


def test_alone_it_imports_quietly_and_runs_from_the_command_line(tmp_path):
    """A tree holding only the frozen script (no live script, no records/ or tools/): importing it
    prints and writes nothing and imports no module of the repository; its command line runs."""
    copy = tmp_path / "records" / "x01_lineage" / "train_gpt_medium.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(FROZEN, copy)
    load = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('x01_lineage_trainer', {str(copy)!r})\n"
            "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module\n"
            "spec.loader.exec_module(module)\n"
            "assert not {'train_gpt_medium', 'records', 'tools', 'synthetic'} & set(sys.modules), sorted(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, env=python_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "records", "records/x01_lineage", "records/x01_lineage/train_gpt_medium.py"]
    done = subprocess.run([sys.executable, "records/x01_lineage/train_gpt_medium.py", "--recipe", "smear", "--preset",
                           "tiny", "--dry_run"], cwd=tmp_path, env=python_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "recipe = 'smear'" in done.stdout.splitlines()


def test_it_generates_the_tiny_data_with_the_repository_roots_generator(tmp_path):
    """Two folders below the root, the script still finds data/synthetic.py; the data lands under the
    working folder, as for the live script."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('x01_lineage_trainer', {str(FROZEN)!r})\n"
            "tg = importlib.util.module_from_spec(spec); sys.modules[spec.name] = tg\n"
            "spec.loader.exec_module(tg)\n"
            "tg.ensure_synthetic_data(tg.make_config('tiny'))\n"
            "print(sys.modules['synthetic'].__file__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=python_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(ROOT / "data" / "synthetic.py")
    assert list((tmp_path / "data" / "synthetic").glob("*train*.bin"))


def test_help_through_run_sh_with_trainer_runs_the_frozen_script():
    """TRAINER= picks the script run.sh launches; the frozen --help points to its own recipes.md
    (the live script's does not)."""
    env = {**python_env(), "PYTHON": sys.executable, "TRAINER": "records/x01_lineage/train_gpt_medium.py"}
    env.pop("RUNS", None)
    done = subprocess.run([str(ROOT / "run.sh"), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "records/x01_lineage/recipes.md says what each recipe computes" in " ".join(done.stdout.split())
    for name in LINEAGE:
        assert f"\n  {name} (" in done.stdout


def test_run_sh_refuses_a_trainer_that_is_not_there():
    env = {**python_env(), "PYTHON": sys.executable, "TRAINER": "records/no_such/train_gpt_medium.py"}
    done = subprocess.run([str(ROOT / "run.sh"), "--preset", "tiny"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: TRAINER=records/no_such/train_gpt_medium.py: no such script")
    assert len(done.stderr.splitlines()) == 1


def test_make_golden_refuses_a_trainer_without_a_golden_set(capsys):
    with pytest.raises(SystemExit) as exit_:
        make_golden.main(["--trainer", "records/no_such/train_gpt_medium.py"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: --trainer: records/no_such/train_gpt_medium.py has no golden set")
