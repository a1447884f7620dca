"""data/cached_fineweb10B.py: what it fetches, what it skips, and what it says when the hub is out of reach."""
import sys
from pathlib import Path

import numpy as np

import train_gpt_medium as tg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
import cached_fineweb10B as dl  # noqa: E402


def test_fetches_the_validation_shard_and_the_first_n_train_shards(tmp_path):
    fetched = []

    def fake_fetch(name, directory):
        fetched.append(name)
        tg.write_shard(Path(directory) / name, np.arange(1000) % 50257)

    paths = dl.download(3, tmp_path, fetch=fake_fetch)
    assert fetched == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin",
                       "fineweb_train_000003.bin"]
    assert [p.name for p in paths] == fetched


def test_valid_files_are_skipped_and_corrupt_ones_fetched_again(tmp_path):
    tg.write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))
    tg.write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(100))
    (tmp_path / "fineweb_train_000001.bin").write_bytes(b"\0" * 10)  # truncated download
    fetched = []

    def fake_fetch(name, directory):
        fetched.append(name)
        tg.write_shard(Path(directory) / name, np.arange(100))

    dl.download(1, tmp_path, fetch=fake_fetch)
    assert fetched == ["fineweb_train_000001.bin"]
    assert tg.shard_token_count(tmp_path / "fineweb_train_000001.bin") == 100


def test_unreachable_hub_gives_a_clear_message_and_keeps_finished_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub client refuses to connect, as with no network
    tg.write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))
    assert dl.main(["2", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "could not download from the Hugging Face Hub dataset kjj0/fineweb10B-gpt2" in err
    assert "run the same command again" in err
    assert (tmp_path / "fineweb_val_000000.bin").exists()
