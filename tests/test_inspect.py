"""tools/inspect_checkpoint.py: lambdas per layer and logit lenses from a saved checkpoint."""
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
from test_model import randomize
from test_training import runner_and_loader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import inspect_checkpoint as ic  # noqa: E402


def saved_checkpoint(synthetic_dir, tmp_path):
    config = tg.make_config("tiny", checkpoint_dir=str(tmp_path / "ck"), warmup_steps=0,
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"),
                            val_files=str(synthetic_dir / "synthetic_val_*.bin"))
    runner, loader = runner_and_loader(config)
    randomize(runner.model, seed=6)  # a non-zero head, so the lenses say something
    return tg.save_checkpoint(runner, loader, 3, 0.0), runner.model, config


def test_report_shows_the_lambdas_and_a_lens_that_agrees_with_the_model(synthetic_dir, tmp_path, capsys):
    path, model, config = saved_checkpoint(synthetic_dir, tmp_path)
    assert ic.main([str(path), "--seq_len=512", "--position=77", "--top_k=3", "--token=5"]) == 0
    out = capsys.readouterr().out
    layer_lines = [line for line in out.splitlines() if line.startswith("lambdas layer ")]
    assert len(layer_lines) == 16
    resid, x0_weights = model.mixing_weights()
    lam = [resid[4].item()] + x0_weights[4].tolist()
    assert layer_lines[4].startswith(f"lambdas layer 4: x:{lam[0]:.4f} x00:{lam[1]:.4f} x01:{lam[2]:.4f}")
    # the lens after the last layer is the model's own prediction: p(next) = exp(-that token's loss)
    ids = tg.read_shard(synthetic_dir / "synthetic_val_000000.bin")[:513].long()
    model.eval()
    with torch.no_grad():
        losses = model(ids[:-1].to(torch.int32), ids[1:], torch.tensor(tg.attention_windows(3, config), dtype=torch.int32), reduction="none")
    (final,) = [line for line in out.splitlines() if line.startswith("after last layer")]
    p_next = float(re.search(r"p\(next=<\d+>\)=(\d\.\d+)", final)[1])
    assert p_next == pytest.approx(math.exp(-losses[77].item()), abs=2e-6)  # printed with 6 decimals
    assert sum(line.startswith("input of layer") for line in out.splitlines()) == 16
    assert out.count("through its o-projection") == 10  # the 10 layers with a value embedding


def test_gpt2_tokens_print_as_text():
    vocab = ic.Vocabulary(50257)
    assert vocab(262) == "' the'" and vocab(15496) == "'Hello'" and vocab(50256) == "<|endoftext|>"
    assert ic.Vocabulary(500)(7) == "<7>"


def test_a_damaged_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "step_000001").mkdir()
    assert ic.main([str(tmp_path / "step_000001")]) == 2
    assert "not a checkpoint folder (no meta.json)" in capsys.readouterr().err


def trainer_lens(runner, step, ids, position):
    """p(next token) read at `position` from x entering each layer, with the model set for `step` by
    the trainer's own Runner (its windows, YaRN tables and embedding tie): what the tool must print."""
    window = runner.window(step)
    runner.set_embedding_tie(step)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0][0, position])) for b in runner.model.blocks]
    try:
        with torch.no_grad():
            runner.model(ids[:-1].to(torch.int32), ids[1:], window, reduction="none")
    finally:
        for h in hooks:
            h.remove()
    probs, _ = ic.lens(runner.model, torch.stack(seen), 1)
    return probs[:, ids[position + 1]].tolist()


@pytest.mark.parametrize("step", [20, 190])
def test_a_bulk_checkpoint_runs_with_its_own_sequence_length_and_windows(synthetic_dir, tmp_path, capsys, step):
    """The bulk recipe's checkpoint (rotary tables as long as its 512-token sequences, a window
    schedule with a capped short window, YaRN changes at steps 16, 32, 47, the input embedding tied to
    the head until step 33): step 20 is tied after one YaRN change, 190 the final validation (long
    27 blocks, short 11) after all three. The tool once ran 2048 tokens and the plain long window.
    Position 425 lies 183 tokens into a document (242-428 of the first validation sequence): past
    a short window of 11 16-token blocks, within the 13 that long // 2 would give."""
    config = tg.make_config("tiny", recipe="bulk", checkpoint_dir=str(tmp_path / "ck"), warmup_steps=0,
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"),
                            val_files=str(synthetic_dir / "synthetic_val_*.bin"))
    runner, loader = runner_and_loader(config)
    randomize(runner.model, seed=6)
    path = tg.save_checkpoint(runner, loader, step, 0.0)
    assert ic.main([str(path), "--position=425", "--top_k=3", "--token=5"]) == 0  # no --seq_len: 512
    lines = capsys.readouterr().out.splitlines()
    printed = [float(re.search(r"p\(next=<\d+>\)=(\d\.\d+)", line)[1]) for line in lines
               if line.startswith("input of layer")]
    ids = tg.read_shard(synthetic_dir / "synthetic_val_000000.bin")[:513].long()
    assert printed == pytest.approx(trainer_lens(runner, step, ids, 425), abs=1e-6)  # printed with 6 decimals
    # the embedding lens reads x00 from the head while the embedding is tied
    (x00,) = [line for line in lines if line.startswith("x00: ")]
    table = runner.model.head.weight if step <= tg.untie_step(config) else runner.model.embeds[0].weight
    top = ic.lens(runner.model, tg.rms_norm(table[5].detach().float())[None], 3)[1][0].tolist()
    assert [int(t) for t in re.findall(r"<(\d+)>", x00)] == top


def test_a_sequence_longer_than_the_run_used_is_refused(synthetic_dir, tmp_path, capsys):
    path, _, _ = saved_checkpoint(synthetic_dir, tmp_path)
    with pytest.raises(SystemExit) as exit_:
        ic.main([str(path), "--seq_len=1024"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--seq_len must be at most 512" in err and "val_seq_len 512" in err and "Traceback" not in err


def test_a_folder_that_is_no_checkpoint_is_called_so(tmp_path, capsys):
    """Not an interrupted save: a folder with no checkpoint file at all (an interrupted save leaves
    main.pt or a rank file without meta.json)."""
    assert ic.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: not a checkpoint folder (no meta.json)" in err and "interrupted" not in err
    (tmp_path / "main.pt").write_bytes(b"")
    assert ic.main([str(tmp_path)]) == 2
    assert "an interrupted save?" in capsys.readouterr().err
