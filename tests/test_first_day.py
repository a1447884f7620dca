"""What a new user hit on the first day (a second look at the trainer's flags and lines): each case
gets one clear line before anything is written, or does what a speedrunner expects. Flags that parsed
to a wrong value, bounds that let a run fail later, the names of the run's outputs, a full disk under
bookkeeping, the time left, the seed of a resumed run, old checkpoints kept or not, the dry run's
notes and its one peak."""
import json
import re

import pytest

import train_gpt_medium as tg
from test_checkpoint import four_block_argv, log_text


def refusal(capsys, *flags) -> str:
    """The one line a tiny dry run with these flags is refused with (exit 2)."""
    assert tg.main(["--preset=tiny", "--dry_run", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---- flags that parsed to another value, or passed every check and failed later


def test_attn_gate_layers_none_removes_every_gate_and_auto_keeps_them_all():
    """none is #317's ablation (no output gate), auto every block's; they were parsed alike."""
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers=none"]).attn_gate_layers == ()
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers=NONE"]).attn_gate_layers == ()
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers=auto"]).attn_gate_layers is None
    none, auto = (tg.make_config("tiny", attn_gate_layers=v) for v in ((), None))
    assert none.gated_layers == [] and auto.gated_layers == list(range(16))
    model = tg.build_model(none, "meta")
    assert all(block.attn.output_gate is None for block in model.blocks)


def test_attn_gate_layers_all_says_what_the_flag_takes(capsys):
    assert ("--attn_gate_layers: expected comma-separated block numbers, none (no block) or auto (every block), "
            "got 'all'") in refusal(capsys, "--attn_gate_layers=all")


@pytest.mark.parametrize("flag", ["xsa_layers", "attn_gate_layers", "dc_layers"])
def test_a_block_listed_twice_is_refused(flag, capsys):
    extra = ["--mudd_gate"] if flag == "dc_layers" else []
    assert f"--{flag}: block 3 is listed twice: list each block once" in refusal(capsys, f"--{flag}=1,3,3", *extra)


@pytest.mark.parametrize("value", ["1e30", "1e39", "11"])
def test_a_prefix_loss_weight_past_10_is_refused(value, capsys):
    """1e30 trained to the step-0 loss without a word, 1e39 overflowed fp32; #337's is 0.25."""
    assert "--prefix_loss_weight" in refusal(capsys, f"--prefix_loss_weight={value}") and "<= 10.0" in \
        refusal(capsys, f"--prefix_loss_weight={value}")


@pytest.mark.parametrize("rows", ["1000000000", "10000000000000"])
def test_sign_rows_the_hash_cannot_reach_are_refused(rows, capsys):
    """(x_(t-1) XOR x_t) of ids below the tiny vocabulary's 500 is below 512, the medium's below 65,536: rows
    past those are never read (a billion did not fit in memory); #299's 8,192 is always allowed."""
    line = refusal(capsys, "--bigram_embed", f"--bigram_sign_rows={rows}")
    assert line.startswith("error: --bigram_sign_rows: ") and "give at most 8192" in line
    assert tg.main(["--preset=tiny", "--dry_run", "--bigram_embed", "--bigram_sign_rows=8192"]) == 0
    assert tg.parse_args(["--bigram_embed", "--bigram_sign_rows=65536"]).bigram_sign_rows == 65536
    with pytest.raises(tg.ConfigError, match="give at most 65536"):
        tg.parse_args(["--bigram_embed", "--bigram_sign_rows=65537"])


# ---- the run's output names


@pytest.mark.parametrize("run_id", ["../../etc/x", "a/b", "..", ".hidden", "x y"])
def test_a_run_id_is_one_name_inside_the_log_and_checkpoint_folders(run_id, capsys):
    assert "--run_id: " in refusal(capsys, f"--run_id={run_id}")
    assert tg.parse_args(["--preset=tiny", "--run_id=ablation-3_b.1"]).run_id == "ablation-3_b.1"


@pytest.mark.parametrize("flag", ["log_dir", "checkpoint_dir"])
def test_an_empty_output_folder_is_refused(flag, capsys):
    """Empty is the working folder: from the repository root, its root."""
    assert f"--{flag}: is empty (the working folder)" in refusal(capsys, f"--{flag}=")


# ---- bookkeeping never stops a record attempt


def test_a_full_disk_under_the_metrics_stream_is_said_once_in_the_log_too_and_the_run_goes_on(
        synthetic_dir, tmp_path, monkeypatch, capsys):
    from tools import metrics
    real, writes = metrics.MetricsStream.emit, []

    def full_after_two(self, record):
        writes.append(record["kind"])
        if len(writes) == 3 and self.file is not None:  # the disk fills: every write from now on fails
            self.file.close()
            self.file = open("/dev/full", "w")
        return real(self, record)
    monkeypatch.setattr(metrics.MetricsStream, "emit", full_after_two)
    out = tmp_path / "m.jsonl"
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, f"--metrics_jsonl={out}", N=4)) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --metrics_jsonl") == 1 and "No space left on device" in err
    assert "the disk is full; free space there or give another --metrics_jsonl" in err  # what to do
    assert len(out.read_text().splitlines()) == 2  # the records before the disk filled
    assert "final val_loss:" in log_text(tmp_path)  # the run finished
    warned = [line for line in log_text(tmp_path).splitlines() if line.startswith("warning: --metrics_jsonl")]
    assert len(warned) == 1 and warned[0] in err  # a log read later has the warning too


# ---- the time left, the seed of a resumed run, old checkpoints


def test_the_time_left_weighs_each_step_by_its_tokens_and_windows_and_is_unknown_at_first(monkeypatch):
    """The tiny grid's first steps have 256 of its 1,024 tokens and short windows: paced per step,
    the estimate after them was far too low; paced per unit of the schedule's work it is not."""
    config = tg.make_config("tiny")
    work = tg.step_work(config, 4.92e6)
    assert work[0] < work[47] / 4 and work[47] < work[-1]  # the ramp, then longer windows
    clock = [100.0]
    monkeypatch.setattr(tg.time, "perf_counter", lambda: clock[0])
    eta = tg.Eta(0, work)
    clock[0] = 103.0
    assert eta.text(5) == " eta:unknown" and eta.text(config.num_iterations) == ""
    clock[0] = 160.0
    left = 60 / sum(work[:40]) * sum(work[40:])
    assert eta.text(40) == f" eta:{int(left) // 60}m{int(left) % 60:02d}s"
    assert 60 / 40 * (len(work) - 40) < 0.6 * left  # the per-step estimate: far too low


def test_a_resumed_run_names_the_seed_of_the_run_it_continues(synthetic_dir, tmp_path):
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, "--save_every=2", "--seed=1234", N=3)) == 0
    resumed = tmp_path / "resumed"
    argv = four_block_argv(synthetic_dir, resumed, f"--resume={tmp_path / 'ck/tiny/step_000002'}", N=3)
    assert tg.main(argv) == 0
    assert "seed 1234 (repeat this run with --seed=1234)" in log_text(resumed)


def test_keep_checkpoints_keeps_the_newest_ones(synthetic_dir, tmp_path):
    """Saved at steps 2, 4 and 6: the first is deleted once the third is whole."""
    assert tg.main(four_block_argv(synthetic_dir, tmp_path, "--save_every=2", "--keep_checkpoints=2", N=6)) == 0
    run_dir = tmp_path / "ck" / "tiny"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000004", "step_000006"]
    assert tg.validate_checkpoint(run_dir / "step_000006")["step"] == 6
    assert "checkpoint deleted (--keep_checkpoints=2): " in log_text(tmp_path)


def test_keep_checkpoints_without_save_every_is_noted(capsys):
    assert tg.main(["--preset=tiny", "--dry_run", "--keep_checkpoints=3"]) == 0
    assert "note: --keep_checkpoints=3 has no effect without --save_every" in capsys.readouterr().out


# ---- the dry run


def test_a_dry_run_notes_the_flags_it_ignores(capsys):
    assert tg.main(["--preset=tiny", "--dry_run", "--metrics_jsonl=m.jsonl", "--save_every=10"]) == 0
    out = capsys.readouterr().out
    assert "note: --metrics_jsonl=m.jsonl is ignored: a dry run writes no log" in out
    assert "note: --save_every=10 is ignored" in out


def test_a_dry_run_on_one_gpu_gives_one_peak_for_one_configuration(capsys):
    """--gpu_count=1: the memory lines and the table of what fits are both for 1 GPU (the memory line
    said 8 GPUs' peak beside the table's 1-GPU one)."""
    assert tg.main(["--dry_run", "--gpu_count=1"]) == 0
    out = capsys.readouterr().out
    peaks = set(re.findall(r"([\d,]+) MiB per GPU on 1 GPU", out)) | set(re.findall(r"this configuration: ([\d,]+) MiB",
                                                                                     out))
    assert len(peaks) == 1 and "per GPU of 1:" in out and "on 8 GPUs;" not in out
    assert json.loads(out.strip().splitlines()[-1])["total_params"] > 0
