"""records/plot.py: PNG pictures from finished logs, and a clear refusal where there is nothing to draw.

The logs here are written by hand in the trainer's format (no training): a body after the source and
versions blocks with config, val, final, lambdas and peak-memory lines.
"""

import json
from pathlib import Path

import matplotlib.image
import pytest

from records import plot

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run_log(path, final_loss, *, steps=8, seconds=2.0, seed=1, finish=True, lambdas=True, bpb_per_nat=0.42):
    """A finished (or, with finish=False, interrupted) log in the trainer's format: val every 4 steps,
    losses falling linearly to final_loss, times linear up to `seconds`."""
    lines = ['    log.write(f"step:{step}/{N} val_loss:{val_loss:.6f} ...")', "=" * 100,
             "Running PyTorch 2.13.0+cpu", "=" * 100, "config preset = 'tiny'", f"config seed = {seed}",
             "params total: 1,026,912 3.9 MiB, optimizer state 4.9 MiB"]
    last = steps if finish else steps // 2
    for s in range(0, last + 1):
        ms = seconds * 1000 * s / steps
        loss = final_loss + 0.5 * (steps - s) / steps
        if s > 0:
            lines.append(f"step:{s}/{steps} train_time:{ms:.0f}ms step_avg:{ms / s:.2f}ms")
        if s == 0:
            lines.append("step0_train_loss:6.238326")
        if s % 4 == 0:
            lines.append(f"step:{s}/{steps} val_loss:{loss:.6f} train_time:{ms:.0f}ms step_avg:{ms / max(s, 1):.2f}ms "
                         f"val_bpb:{loss * bpb_per_nat:.6f}")
    if finish:
        lines.append(f"final val_loss:{final_loss:.6f} perplexity:1.0 val_bpb:{final_loss * bpb_per_nat:.6f} "
                     f"package_time:{seconds * 1000 + 300:.0f}ms (training + final evaluation)")
        if lambdas:
            lines += [f"lambdas layer {i}: x:{1 + i / 100:.4f} x00:{i / 50:.4f} x01:-0.0100 attn_v:0.5000 "
                      f"attn_ve:0.4000 skip_w:1.0000" for i in range(4)]
        lines.append("peak memory allocated: 449 MiB reserved: 449 MiB")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_png(path):
    """A real, non-empty PNG of the expected small size (dpi 80: a few hundred pixels a side)."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and 5_000 < len(data) < 200_000, len(data)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert 200 < height < 600 and 300 < width < 1000, (height, width)


@pytest.fixture
def two_sets(tmp_path):
    """Two folders of two finished runs each, plus an interrupted log that must be ignored."""
    for name, losses in (("base", [3.10, 3.12]), ("cand", [3.05, 3.06])):
        for i, loss in enumerate(losses):
            write_run_log(tmp_path / name / f"run{i}.txt", loss, seed=i + 1)
    write_run_log(tmp_path / "base" / "crashed.txt", 9.0, finish=False)
    return tmp_path


def test_curves_of_two_folders_make_a_png(two_sets, capsys):
    out = two_sets / "pics" / "curves.png"
    assert plot.main(["curves", str(two_sets / "base"), str(two_sets / "cand"), "-o", str(out)]) == 0
    assert_png(out)
    assert f"wrote {out}" in capsys.readouterr().out


def test_curves_zoom_on_the_end_with_a_target_in_range(two_sets):
    out = two_sets / "zoom.png"
    argv = ["curves", str(two_sets / "base"), str(two_sets / "cand" / "run0.txt"), "--zoom", "0.5", "--target", "3.1"]
    assert plot.main([*argv, "-o", str(out)]) == 0
    assert_png(out)


def test_mean_curve_is_the_mean_and_range_over_runs(two_sets):
    runs = plot.groups([str(two_sets / "base")])[0][1]
    steps, mean, lo, hi = plot.mean_curve(runs, "step")
    assert list(steps) == [0, 4, 8]
    assert mean[-1] == pytest.approx((3.10 + 3.12) / 2) and lo[-1] == 3.10 and hi[-1] == 3.12


def test_ablation_picture_from_an_ablate_output_folder(tmp_path):
    """The layout records/ablate.py writes: sweep.json and logs/<arm>/seed<S>/<log>.txt."""
    sweep = dict(preset="tiny", grid=[["lore_input", ["false", "true"]]], seeds=[1, 2], band_loss=0.01, band_time=1.05)
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    for arm, losses in (("lore_input-false", [3.10, 3.12]), ("lore_input-true", [3.11, 3.11])):
        for seed, loss in zip((1, 2), losses):
            write_run_log(tmp_path / "logs" / arm / f"seed{seed}" / "run.txt", loss, seed=seed)
    labels = [label for label, _ in plot.groups([str(tmp_path)])]
    assert labels == ["lore_input=false", "lore_input=true"]
    out = tmp_path / "ablation.png"
    assert plot.main(["ablation", str(tmp_path), "--metric", "bpb", "-o", str(out)]) == 0
    assert_png(out)


def test_ablation_picture_of_plain_folders_with_bands(two_sets):
    out = two_sets / "ablation.png"
    argv = ["ablation", str(two_sets / "base"), str(two_sets / "cand"), "--baseline", "base",
            "--band-loss", "0.02", "--band-time", "1.1", "-o", str(out)]
    assert plot.main(argv) == 0
    assert_png(out)


def test_lambdas_of_one_run(two_sets):
    out = two_sets / "lambdas.png"
    assert plot.main(["lambdas", str(two_sets / "cand" / "run1.txt"), "-o", str(out)]) == 0
    assert_png(out)


def test_lambdas_are_read_per_layer(two_sets):
    (run,) = plot.groups([str(two_sets / "cand" / "run1.txt")])[0][1]
    assert sorted(run.lambdas) == [0, 1, 2, 3]
    assert run.lambdas[3] == dict(x=1.03, x00=0.06, x01=-0.01, attn_v=0.5, attn_ve=0.4, skip_w=1.0)


@pytest.mark.parametrize("command", ["curves", "ablation", "lambdas"])
def test_a_path_without_finished_runs_is_refused(tmp_path, capsys, command):
    write_run_log(tmp_path / "runs" / "crashed.txt", 3.0, finish=False)
    out = tmp_path / "never.png"
    assert plot.main([command, str(tmp_path / "runs"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'runs'}: no finished runs") and not out.exists()


def test_a_log_without_lambdas_lines_is_refused(tmp_path, capsys):
    log = write_run_log(tmp_path / "old.txt", 3.0, lambdas=False)
    out = tmp_path / "never.png"
    assert plot.main(["lambdas", str(log), "-o", str(out)]) == 2
    assert "no `lambdas layer i:` lines" in capsys.readouterr().err and not out.exists()


def test_one_empty_path_among_good_ones_is_refused(two_sets, capsys):
    (two_sets / "empty").mkdir()
    out = two_sets / "never.png"
    assert plot.main(["curves", str(two_sets / "base"), str(two_sets / "empty"), "-o", str(out)]) == 2
    assert f"{two_sets / 'empty'}: no finished runs" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("name, message", [
    ("x.jpgx", "ends in '.jpgx'; give a name ending in one of "),
    ("picture", "has no file type; give a name ending in one of "),
])
def test_an_output_name_matplotlib_cannot_write_is_refused_before_drawing(two_sets, capsys, name, message):
    out = two_sets / name
    assert plot.main(["curves", str(two_sets / "base"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: -o {out}: {message}") and ".png" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_output_folder_that_cannot_be_written_is_one_line_and_exit_2(two_sets, capsys, where):
    (two_sets / "f.txt").write_text("keep me")
    out = two_sets / "f.txt" / "c.png" if where == "under_a_file" else Path("/proc/no-such-dir/c.png")
    assert plot.main(["curves", str(two_sets / "base"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: -o {out}: cannot write: ") and len(err.splitlines()) == 1
    assert (two_sets / "f.txt").read_text() == "keep me"


def test_other_file_types_matplotlib_writes_are_accepted(two_sets):
    out = two_sets / "curves.svg"
    assert plot.main(["curves", str(two_sets / "base"), "-o", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml")
