"""tools/export.py: a checkpoint's weights to safetensors and back, bit for bit, with the config as
metadata; the file stands in for the checkpoint in the other tools."""
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
from test_model import randomize
from test_training import runner_and_loader

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
from tools import export  # noqa: E402
from tools import inspect_checkpoint as ic  # noqa: E402
from tools import sample as sm  # noqa: E402


@pytest.fixture(scope="module")
def bf16_checkpoint(synthetic_dir, tmp_path_factory):
    """A tiny checkpoint as a GPU run writes it: bf16 tables, gates and block matrices (fp32 master
    halves kept by Muon), fp32 scalars; random non-zero values at step 20."""
    config = tg.make_config("tiny", dtype="bfloat16", fp32_block_weights=False, warmup_steps=0,
                            checkpoint_dir=str(tmp_path_factory.mktemp("bf16") / "ck"),
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    runner, loader = runner_and_loader(config)
    randomize(runner.model, seed=4)
    return tg.save_checkpoint(runner, loader, 20, 0.0)


def saved_state(path):
    return tg._load(Path(path) / "main.pt")["model"]


def bits_equal(a: dict, b: dict) -> bool:
    return not export.differences(a, b)


def test_fp32_export_and_import_give_back_every_tensor_bit_for_bit(bf16_checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint), "--out", str(out)]) == 0
    original = saved_state(bf16_checkpoint)
    assert {t.dtype for t in original.values()} == {torch.bfloat16, torch.float32}  # both kinds are exercised
    stored = load_file(str(out))
    assert {t.dtype for t in stored.values()} == {torch.float32}
    model, config, step = export.load_safetensors(out)  # in the dtype it trained in
    assert step == 20 and config.dtype == "bfloat16"
    assert bits_equal(original, model.state_dict())
    again = tmp_path / "again.safetensors"  # and out again: the same file contents
    save_file(export.export_tensors(model.state_dict(), "fp32"), str(again))
    assert bits_equal(load_file(str(again)), stored)


def test_bf16_export_rounds_once_and_round_trips_exactly(bf16_checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint), "--out", str(out), "--dtype", "bf16"]) == 0
    original, stored = saved_state(bf16_checkpoint), load_file(str(out))
    rounded = {k: v.to(torch.bfloat16) for k, v in original.items()}
    assert bits_equal(rounded, stored)
    assert any(not torch.equal(v.float(), original[k].float()) for k, v in stored.items())  # fp32 scalars rounded
    model, _, _ = export.load_safetensors(out)  # the fp32 scalars hold bf16 values now: exported again, the same
    assert bits_equal(export.export_tensors(model.state_dict(), "bf16"), stored)
    assert all(torch.equal(v, stored[k].to(v.dtype)) for k, v in model.state_dict().items())


def test_the_metadata_holds_the_config_and_step(bf16_checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint), "--out", str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    saved = tg._load(bf16_checkpoint / "main.pt")["config"]
    assert meta["format"] == export.FORMAT and meta["step"] == "20" and meta["trained_dtype"] == "bfloat16"
    assert json.loads(meta["config"]) == json.loads(json.dumps(saved))


def test_a_safetensors_file_samples_what_its_checkpoint_samples(bf16_checkpoint, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint), "--out", str(out)]) == 0
    capsys.readouterr()
    texts = []
    for source in (bf16_checkpoint, out):
        assert sm.main([str(source), "--prompt_ids=3,4", "--max_new_tokens=8", "--seed=2"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and "<3> <4> " in texts[0]


def test_bad_input_is_refused_before_anything_is_written(bf16_checkpoint, tmp_path, capsys):
    assert export.main([str(tmp_path / "none"), "--out", str(tmp_path / "a.safetensors")]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        export.main([str(bf16_checkpoint), "--out", str(tmp_path / "a.pt")])
    assert e.value.code == 2 and "ending in .safetensors" in capsys.readouterr().err
    (tmp_path / "step_000001").mkdir()
    assert export.main([str(tmp_path / "step_000001"), "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "not a checkpoint folder (no meta.json)" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_file_takes_the_permissions_of_every_other_output(bf16_checkpoint, tmp_path, umask):
    """The mode open() gives a new file under the same umask (safetensors' writer alone makes 0600)."""
    previous = os.umask(umask)
    try:
        assert export.main([str(bf16_checkpoint), "--out", str(tmp_path / "m.safetensors")]) == 0
        (tmp_path / "log.txt").write_text("a log line\n")
    finally:
        os.umask(previous)
    mode = lambda name: stat.S_IMODE((tmp_path / name).stat().st_mode)
    assert mode("m.safetensors") == mode("log.txt") != 0o600


def test_the_inspector_reads_the_file_as_it_reads_its_checkpoint(bf16_checkpoint, synthetic_dir, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint), "--out", str(out)]) == 0
    capsys.readouterr()
    printed = []
    for source in (bf16_checkpoint, out):
        assert ic.main([str(source), "--seq_len=64", f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}"]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and "value embedding of layer" in printed[0]


def test_a_file_of_a_checkpoint_is_refused_naming_its_folder(bf16_checkpoint, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert export.main([str(bf16_checkpoint / "main.pt"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {bf16_checkpoint / 'main.pt'}: a file of the checkpoint "
                                       f"{bf16_checkpoint}; give the folder itself: {bf16_checkpoint}\n")
    assert not out.exists()


def test_a_safetensors_file_of_another_program_is_refused_naming_it(tmp_path):
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "pt"})
    with pytest.raises(tg.CheckpointError, match="without this trainer's metadata"):
        ic.load_model(other)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(tg.CheckpointError, match="junk.safetensors: not a readable safetensors file"):
        export.load_safetensors(tmp_path / "junk.safetensors")
