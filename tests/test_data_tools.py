"""Input errors of the scripts in data/ and tools/: each is one `error:` line on stderr naming the file
or flag and what to do, exit code 2, no traceback, nothing already there overwritten.
(data/cached_fineweb10B.py has its own file, tests/test_download.py.)"""
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT / "tools"))
import gpt2_token_bytes as gtb  # noqa: E402
import inspect_checkpoint as ic  # noqa: E402
import synthetic  # noqa: E402


def one_error_line(capsys) -> str:
    """The single line a script printed on stderr, checked to be an `error:` line without a traceback."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def exit_code(main, argv) -> int:
    """What the script's process would exit with: main's return value, or argparse's SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def refuses(main, argv, capsys, *fragments) -> str:
    """main(argv) exits with code 2 and one error line holding every fragment; returns that line."""
    assert exit_code(main, argv) == 2
    line = one_error_line(capsys)
    for fragment in fragments:
        assert fragment in line
    return line


def deny(monkeypatch, path: Path):
    """Make reading `path` fail as it would without permission (root ignores chmod, so this mocks it)."""
    real_read_text = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)


def no_folder_is_writable(monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)


# ---- every script, as a process: a bad argument is one line and exit code 2, before torch loads

HEAVY_LIBRARIES = ("torch", "huggingface_hub", "scipy", "matplotlib")


@pytest.fixture(scope="module")
def heavy_libraries_refused(tmp_path_factory) -> Path:
    """A folder to put first on PYTHONPATH in which each heavy library fails to import: a script that
    loads one before it has checked its arguments ends in an ImportError instead of exit code 2."""
    folder = tmp_path_factory.mktemp("no_heavy_libraries")
    for name in HEAVY_LIBRARIES:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} imported before the arguments were checked')\n")
    return folder


def without_heavy_libraries(folder: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def test_the_refusing_folder_does_refuse_torch(heavy_libraries_refused):
    """Guards the test below: with that PYTHONPATH, importing torch fails."""
    done = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                          env=without_heavy_libraries(heavy_libraries_refused), timeout=60)
    assert done.returncode == 1 and "torch imported before the arguments were checked" in done.stderr


@pytest.mark.parametrize("script, argv, named", [
    ("data/cached_fineweb10B.py", ["abc"], "num_train"),
    ("data/cached_fineweb10B.py", ["0"], "num_train"),
    ("data/cached_fineweb10B.py", ["1", "--out=data/x/y"], "--out"),  # under a file (see below)
    ("data/gpt2_token_bytes.py", ["no_such_merges.txt"], "no_such_merges.txt"),
    ("data/gpt2_token_bytes.py", ["merges.txt", "--colour=red"], "--colour"),
    ("data/synthetic.py", ["--vocab_size=5"], "--vocab_size"),
    ("data/synthetic.py", ["--out=data/x/y"], "--out"),
    ("tools/inspect_checkpoint.py", ["no_such_checkpoint"], "no_such_checkpoint"),
    ("tools/inspect_checkpoint.py", ["no_such_checkpoint", "--top_k=0"], "--top_k"),
    ("tools/switch_table.py", ["--wrte"], "--wrte"),
    ("tools/bench_threads.py", ["--repeats=0"], "--repeats"),
    ("tests/golden/make_golden.py", ["--jobs=0"], "--jobs"),
])
def test_each_script_refuses_a_bad_argument_in_one_line_with_exit_code_2_before_torch_loads(
        script, argv, named, tmp_path, heavy_libraries_refused):
    """Run from an empty folder in which data/x is a file, with torch and the other heavy libraries
    unimportable (tools/gpu_check.py's flags are the trainer's, checked by the trainer's own parser:
    tests/test_bench.py)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("a file")
    done = subprocess.run([sys.executable, str(ROOT / script), *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=without_heavy_libraries(heavy_libraries_refused), timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ") and named in done.stderr
    nothing_written = [Path("data"), Path("data/x")]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == nothing_written


def test_synthetic_data_written_with_the_trainers_shard_writer_does_not_import_the_trainer_again(
        tmp_path, heavy_libraries_refused):
    """The trainer hands its own write_shard to synthetic.write_dataset (so it is not loaded a second
    time as another module); given a writer, data/synthetic.py imports no trainer, hence no torch
    (refused here), and every shard goes through that writer."""
    code = ("import sys; sys.path.insert(0, 'data'); import synthetic; written = []; "
            f"synthetic.write_dataset({str(tmp_path / 'syn')!r}, vocab_size=50, eot_token=49, train_shards=1, "
            "shard_tokens=1000, val_tokens=500, "
            "write_shard=lambda path, tokens: written.append((path.name, len(tokens)))); "
            "print(sorted(written), 'train_gpt_medium' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=without_heavy_libraries(heavy_libraries_refused), timeout=60)
    assert done.returncode == 0, done.stderr
    shards = "[('synthetic_train_000001.bin', 1000), ('synthetic_val_000000.bin', 500)]"
    assert done.stdout.splitlines()[-1] == f"{shards} False"


# ---- data/gpt2_token_bytes.py: the merges file


def write_merges(path: Path, merges: list[str]) -> Path:
    path.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return path


MERGES_HINT = "expected GPT-2's vocab.bpe"


@pytest.fixture
def bad_merges(tmp_path):
    """A folder of merges files that are not GPT-2's, each wrong in one way."""
    write_merges(tmp_path / "three_merges.txt", ["Ġ t", "Ġ a", "h e"])
    write_merges(tmp_path / "three_parts.txt", ["Ġ t", "a b c"] + ["a b"] * 49998)
    write_merges(tmp_path / "stray_character.txt", ["Ġ t", "a \u4e00"] + ["a b"] * 49998)
    (tmp_path / "latin1.txt").write_bytes("#version: 0.2\nd\xe9j\xe0 vu\n".encode("latin-1"))
    (tmp_path / "a_folder").mkdir()
    return tmp_path


@pytest.mark.parametrize("merges, fragments", [
    ("missing.txt", ["missing.txt: No such file or directory", "give the path of GPT-2's merges file"]),
    ("a_folder", ["a_folder: Is a directory"]),
    ("latin1.txt", ["latin1.txt: not UTF-8 text (at byte offset 15)", MERGES_HINT]),
    ("three_merges.txt", ["three_merges.txt: expected 50000 merges, found 3", MERGES_HINT]),
    ("three_parts.txt", ["three_parts.txt: line 3 is 'a b c', not two parts separated by one space", MERGES_HINT]),
    ("stray_character.txt", ["stray_character.txt: line 3 holds '\u4e00', which is not in GPT-2's byte alphabet"]),
])
def test_a_merges_file_that_is_not_gpt2s_is_refused_naming_it(merges, fragments, bad_merges, capsys):
    out = bad_merges / "out"
    out.mkdir()
    (out / "gpt2_token_bytes.npy").write_bytes(b"earlier table")
    refuses(gtb.main, [str(bad_merges / merges), "--out_dir", str(out)], capsys, *fragments)
    assert (out / "gpt2_token_bytes.npy").read_bytes() == b"earlier table"  # nothing overwritten
    assert sorted(p.name for p in out.iterdir()) == ["gpt2_token_bytes.npy"]


def test_an_unreadable_merges_file_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    merges = write_merges(tmp_path / "merges.txt", ["a b"] * 50000)
    deny(monkeypatch, merges)
    refuses(gtb.main, [str(merges), "--out_dir", str(tmp_path / "out")], capsys, f"{merges}: Permission denied")
    assert not (tmp_path / "out").exists()


def test_merges_file_argument_is_required(capsys):
    refuses(gtb.main, [], capsys, "the following arguments are required: merges", "--help")


def test_an_out_dir_that_is_a_file_or_unwritable_is_refused_before_reading(tmp_path, monkeypatch, capsys):
    merges = write_merges(tmp_path / "merges.txt", ["a b"] * 50000)
    (tmp_path / "taken").write_text("a file")
    refuses(gtb.main, [str(merges), "--out_dir", str(tmp_path / "taken")], capsys,
            f"--out_dir {tmp_path / 'taken'}: {tmp_path / 'taken'} is not a folder")
    no_folder_is_writable(monkeypatch)
    refuses(gtb.main, [str(merges), "--out_dir", str(tmp_path / "new")], capsys,
            f"--out_dir {tmp_path / 'new'}: {tmp_path} is not writable")


def test_a_well_formed_merges_file_writes_both_tables_into_out_dir(tmp_path, capsys):
    merges = write_merges(tmp_path / "merges.txt", ["a b"] * 50000)  # every merge is the 2 bytes "ab"
    assert gtb.main([str(merges), "--out_dir", str(tmp_path / "out")]) == 0
    lengths = np.load(tmp_path / "out" / "gpt2_token_bytes.npy")
    assert lengths.tolist() == [1] * 256 + [2] * 50000 + [0]
    blob = (tmp_path / "out" / "gpt2_tokens.bin").read_bytes()
    assert sorted(blob[:256]) == list(range(256)) and blob[256:] == b"ab" * 50000
    assert "wrote" in capsys.readouterr().out


# ---- data/synthetic.py: the generator's parameters and its output folder


@pytest.mark.parametrize("argv, fragment", [
    (["--vocab_size=8", "--eot_token=7"], "--vocab_size=8: must be 9..8192 for synthetic data"),
    (["--vocab_size=50257", "--eot_token=50256"], "--vocab_size=50257: must be 9..8192"),
    (["--vocab_size=100"], "--eot_token=499: must be 0..99"),  # the default end-of-text id no longer fits
    (["--eot_token=-1"], "--eot_token=-1: must be 0..499"),
    (["--seed=-1"], "--seed=-1: must be at least 0"),
    (["--train_shards=0"], "--train_shards=0: must be at least 1"),
    (["--shard_tokens=0"], "--shard_tokens=0: must be at least 1"),
    (["--val_tokens=-5"], "--val_tokens=-5: must be at least 1"),
    (["--vocab_size=many"], "argument --vocab_size: invalid int value: 'many'"),
    (["--shards=3"], "unrecognized arguments: --shards=3"),
])
def test_synthetic_parameters_out_of_range_are_refused_naming_the_flag(argv, fragment, tmp_path, capsys):
    refuses(synthetic.main, [*argv, "--out", str(tmp_path / "syn")], capsys, fragment)
    assert not (tmp_path / "syn").exists()


def test_write_dataset_checks_its_parameters_before_creating_anything(tmp_path):
    with pytest.raises(synthetic.SyntheticDataError, match="--eot_token=500: must be 0..499"):
        synthetic.write_dataset(tmp_path / "syn", vocab_size=500, eot_token=500)
    assert not (tmp_path / "syn").exists()


def test_synthetic_out_that_is_a_file_or_unwritable_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "taken").write_text("a file")
    refuses(synthetic.main, ["--out", str(tmp_path / "taken" / "syn")], capsys,
            f"--out {tmp_path / 'taken' / 'syn'}: {tmp_path / 'taken'} is not a folder")
    no_folder_is_writable(monkeypatch)
    refuses(synthetic.main, ["--out", str(tmp_path / "syn")], capsys, f"{tmp_path} is not writable")


def test_synthetic_cli_writes_shards_of_the_requested_sizes(tmp_path, capsys):
    out = tmp_path / "syn"
    assert synthetic.main(["--out", str(out), "--train_shards=1", "--shard_tokens=3000", "--val_tokens=2000"]) == 0
    assert tg.shard_token_count(out / "synthetic_train_000001.bin") == 3000
    assert tg.shard_token_count(out / "synthetic_val_000000.bin") == 2000
    assert not (out / "synthetic_train_000002.bin").exists()


# ---- tools/inspect_checkpoint.py: the checkpoint folder and the flags


def handmade_checkpoint(folder: Path, files: dict, meta=None) -> Path:
    """A folder whose meta.json records `files` (name -> bytes) correctly, unless `meta` replaces it."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"format": tg.CHECKPOINT_FORMAT,
              "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}}
    (folder / "meta.json").write_text(json.dumps(record if meta is None else meta))
    return folder


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def checkpoints(tmp_path):
    """Folders that are not checkpoints this script can read, each in one way."""
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "no_meta").mkdir()
    (tmp_path / "meta_is_a_folder" / "meta.json").mkdir(parents=True)
    handmade_checkpoint(tmp_path / "meta_not_json", {}, meta=None)
    (tmp_path / "meta_not_json" / "meta.json").write_text("{")
    handmade_checkpoint(tmp_path / "meta_a_list", {}, meta=[1, 2])
    handmade_checkpoint(tmp_path / "meta_without_sizes", {"main.pt": b"x"},
                        meta={"format": tg.CHECKPOINT_FORMAT, "files": {"main.pt": {}}})
    handmade_checkpoint(tmp_path / "future_format", {}, meta={"format": 99, "files": {}})
    handmade_checkpoint(tmp_path / "main_pt_missing", {"main.pt": b"weights"})
    (tmp_path / "main_pt_missing" / "main.pt").unlink()
    handmade_checkpoint(tmp_path / "main_pt_truncated", {"main.pt": b"weights"})
    (tmp_path / "main_pt_truncated" / "main.pt").write_bytes(b"wei")
    handmade_checkpoint(tmp_path / "main_pt_not_torch", {"main.pt": b"plain text"})
    handmade_checkpoint(tmp_path / "main_pt_no_model", {"main.pt": torch_bytes({"step": 3})})
    return tmp_path


@pytest.mark.parametrize("folder, fragment", [
    ("nowhere", "{tmp}/nowhere: no such checkpoint folder"),
    ("a_file", "{tmp}/a_file: a file, not a checkpoint folder; give a step_<N> folder of --checkpoint_dir"),
    ("no_meta", "{tmp}/no_meta: not a checkpoint folder (no meta.json)"),
    ("meta_is_a_folder", "{tmp}/meta_is_a_folder/meta.json: Is a directory"),
    ("meta_not_json", "{tmp}/meta_not_json/meta.json: unreadable"),
    ("meta_a_list", "{tmp}/meta_a_list/meta.json: not a checkpoint's meta.json"),
    ("meta_without_sizes", "{tmp}/meta_without_sizes/meta.json: not a checkpoint's meta.json"),
    ("future_format", "{tmp}/future_format/meta.json: checkpoint format 99"),
    ("main_pt_missing", "{tmp}/main_pt_missing/main.pt: missing"),
    ("main_pt_truncated", "{tmp}/main_pt_truncated/main.pt: 3 bytes, but 7 were written"),
    ("main_pt_not_torch", "{tmp}/main_pt_not_torch/main.pt: cannot be loaded"),
    ("main_pt_no_model", "{tmp}/main_pt_no_model/main.pt: holds no model this version of the trainer builds"),
])
def test_a_folder_that_is_not_a_readable_checkpoint_is_refused_naming_the_file(folder, fragment, checkpoints,
                                                                               capsys):
    refuses(ic.main, [str(checkpoints / folder)], capsys, fragment.format(tmp=checkpoints))


def test_an_unreadable_meta_json_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    folder = handmade_checkpoint(tmp_path / "ck", {"main.pt": b"weights"})
    deny(monkeypatch, folder / "meta.json")
    refuses(ic.main, [str(folder)], capsys, f"{folder / 'meta.json'}: Permission denied")


def test_an_unreadable_checkpoint_file_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    folder = handmade_checkpoint(tmp_path / "ck", {"main.pt": b"weights"})

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tg, "file_sha256", unreadable)  # the first read of main.pt
    refuses(ic.main, [str(folder)], capsys, f"{folder / 'main.pt'}: Permission denied")


@pytest.mark.parametrize("flags, fragment", [
    (["--top_k=0"], "--top_k must be at least 1, got 0"),
    (["--top_k=-2"], "--top_k must be at least 1, got -2"),
    (["--top_k=five"], "argument --top_k: invalid int value: 'five'"),
    (["--position=-1"], "--position must be at least 0, got -1"),
    (["--colour=red"], "unrecognized arguments: --colour=red"),
])
def test_bad_flags_are_refused_before_the_checkpoint_is_read(flags, fragment, tmp_path, capsys):
    refuses(ic.main, [str(tmp_path / "never_read"), *flags], capsys, fragment, "--help")


@pytest.fixture(scope="module")
def checkpoint(synthetic_dir, tmp_path_factory):
    """A real tiny checkpoint (vocabulary of 500, attention blocks of 16)."""
    from test_inspect import saved_checkpoint
    path, _, _ = saved_checkpoint(synthetic_dir, tmp_path_factory.mktemp("checkpoint"))
    return path


@pytest.fixture
def val_files(tmp_path):
    (tmp_path / "folder_val_000000.bin").mkdir()
    tg.write_shard(tmp_path / "short_val_000000.bin", np.arange(100))
    return tmp_path


@pytest.mark.parametrize("flags, fragment", [
    (["--token=500"], "--token must be in [0, 500)"),
    (["--top_k=501"], "--top_k must be at most the vocabulary size 500, got 501"),
    (["--seq_len=100"], "--seq_len must be a positive multiple of 16"),  # the tiny preset's attn_block_size
    (["--val_files={tmp}/none_*.bin"], "--val_files: no files match '{tmp}/none_*.bin'"),
    (["--val_files={tmp}/folder_val_*.bin"], "{tmp}/folder_val_000000.bin is a folder"),
    (["--val_files={tmp}/short_val_*.bin", "--seq_len=128"],
     "--val_files {tmp}/short_val_*.bin: 100 tokens, fewer than the 129 that --seq_len needs"),
])
def test_flags_that_do_not_fit_the_checkpoint_are_refused(flags, fragment, checkpoint, val_files, capsys):
    argv = [str(checkpoint), *(f.format(tmp=val_files) for f in flags)]
    refuses(ic.main, argv, capsys, fragment.format(tmp=val_files))
