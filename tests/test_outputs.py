"""One policy for every output file the tools and the trainer write (tools/cli.py, output_file_problem):
a missing folder is made, a folder given for a file is refused, a file that exists is kept (refused
unless --overwrite; the trainer's metrics file: unless the run resumes). Each writer through its own
command line, all cases for all of them; and a reader that leaves early (`| head`) ends a tool quietly."""
import subprocess
import sys
from pathlib import Path

import pytest

import train_gpt_medium as tg
from test_checkpoint import four_block_argv
from test_training import runner_and_loader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools import export, hellaswag  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(synthetic_dir, tmp_path_factory):
    config = tg.make_config("tiny", warmup_steps=0, checkpoint_dir=str(tmp_path_factory.mktemp("out_ck") / "ck"),
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    runner, loader = runner_and_loader(config)
    return tg.save_checkpoint(runner, loader, 2, 0.0)


def write_export(out: Path, checkpoint, synthetic_dir, tmp_path, *flags) -> int:
    return export.main([str(checkpoint), "--out", str(out), *flags])


def write_items(out: Path, checkpoint, synthetic_dir, tmp_path, *flags) -> int:
    return hellaswag.main(["--write_synthetic", str(out), "--items=4", "--synthetic_meta",
                           str(synthetic_dir / "synthetic_meta.json"), *flags])


def write_metrics(out: Path, checkpoint, synthetic_dir, tmp_path, *flags) -> int:
    return tg.main(four_block_argv(synthetic_dir, tmp_path, f"--metrics_jsonl={out}", N=4))


WRITERS = {"tools/export.py --out": (write_export, ".safetensors", True),
           "tools/hellaswag.py --write_synthetic": (write_items, ".jsonl", True),
           "train_gpt_medium.py --metrics_jsonl": (write_metrics, ".jsonl", False)}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_missing_folder_is_made(writer, checkpoint, synthetic_dir, tmp_path):
    write, suffix, _ = WRITERS[writer]
    out = tmp_path / "new" / "deeper" / f"out{suffix}"
    assert write(out, checkpoint, synthetic_dir, tmp_path) == 0
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.parametrize("writer", WRITERS)
def test_an_existing_file_is_kept_and_the_writer_stops_in_one_line(writer, checkpoint, synthetic_dir, tmp_path,
                                                                    capsys):
    write, suffix, has_overwrite = WRITERS[writer]
    out = tmp_path / f"taken{suffix}"
    out.write_text("someone's file\n")
    assert write(out, checkpoint, synthetic_dir, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out}: exists, and is kept" in err and writer.split()[-1] in err
    assert out.read_text() == "someone's file\n" and not (tmp_path / "logs").exists()
    if has_overwrite:
        assert write(out, checkpoint, synthetic_dir, tmp_path, "--overwrite") == 0
        assert out.read_bytes() != b"someone's file\n"


@pytest.mark.parametrize("writer", WRITERS)
def test_a_folder_is_not_a_file(writer, checkpoint, synthetic_dir, tmp_path, capsys):
    write, suffix, _ = WRITERS[writer]
    folder = tmp_path / f"a_folder{suffix}"
    folder.mkdir()
    assert write(folder, checkpoint, synthetic_dir, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder}: is a folder" in err and writer.split()[-1] in err
    assert list(folder.iterdir()) == []


def test_a_reader_that_leaves_early_ends_a_tool_quietly(checkpoint):
    """`tools/inspect_checkpoint.py CKPT | head -3` and `records/stats.py ... | head -1`: the pipe is
    closed before the tool writes; it ends with exit 0 and nothing on stderr, not a BrokenPipeError."""
    for argv in (["tools/inspect_checkpoint.py", str(checkpoint)], ["records/stats.py", "--published"]):
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before the first line
        assert proc.wait(timeout=120) == 0, argv
        assert proc.stderr.read() == b"", argv


def test_ctrl_c_ends_a_tool_with_one_line_and_exit_130(capsys):
    """Ctrl-C in a tool (gpu_check waiting on its trainer, a sweep, a download): exit 130 and one line
    saying it was interrupted, not a KeyboardInterrupt traceback; what it printed before stays."""
    from tools.cli import run_main

    def main():
        print("a line before")
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        run_main(main)
    assert stopped.value.code == 130
    out, err = capsys.readouterr()
    assert out == "a line before\n"
    assert err.strip().endswith("interrupted (Ctrl-C); stopped") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
