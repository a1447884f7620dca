"""data/cached_fineweb10B.py: what it fetches, what it skips, and what it says when the hub is out of reach.
No test touches the network: the hub's fetch and its probe request are replaced."""
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import train_gpt_medium as tg
from test_data_tools import one_error_line

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
import cached_fineweb10B as dl  # noqa: E402


@pytest.fixture(autouse=True)
def hub_client_not_in_offline_mode(monkeypatch):
    """The probe's own code path whatever HF_HUB_OFFLINE this test process was started with."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


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


def test_progress_counts_the_missing_shards_only(tmp_path, monkeypatch):
    tg.write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))  # present: not counted
    counted = []

    def recording_progress(paths):
        counted.extend(p.name for p in paths)
        return paths

    monkeypatch.setattr(dl, "progress", recording_progress)
    dl.download(2, tmp_path, fetch=lambda name, directory: tg.write_shard(Path(directory) / name, np.arange(100)))
    assert counted == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]


def test_the_progress_bar_prints_nothing_when_stderr_is_not_a_terminal(tmp_path, capsys):
    dl.download(1, tmp_path, fetch=lambda name, directory: tg.write_shard(Path(directory) / name, np.arange(100)))
    assert capsys.readouterr().err == ""


def test_the_progress_bar_shows_shards_done_and_time_left_on_a_terminal(tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    dl.download(2, tmp_path, fetch=lambda name, directory: tg.write_shard(Path(directory) / name, np.arange(100)))
    updates = [u for u in terminal.getvalue().split("\r") if u.strip()]  # redrawn after each carriage return
    assert updates[0].startswith("shards:   0%") and "0/3 [00:00<?" in updates[0]  # [elapsed<left, rate]
    assert updates[-1].startswith("shards: 100%") and "3/3 [" in updates[-1] and "<00:00, " in updates[-1]


# ---- offline: one quick probe, one clear line, nothing left behind


def failing_request(attempts: list):
    """A probe request that fails as a machine without network does (and counts its calls)."""
    def request(url, timeout):
        attempts.append(url)
        raise ConnectionError("[Errno -2] Name or service not known")
    return request


def offline_probe():
    dl.probe_hub(request=failing_request([]))


def refuse_to_fetch(name, directory):
    raise AssertionError(f"nothing may be fetched, yet {name} was")


def test_offline_probe_makes_exactly_one_attempt_with_a_short_timeout():
    attempts, timeouts = [], []

    def request(url, timeout):
        timeouts.append(timeout)
        failing_request(attempts)(url, timeout)

    with pytest.raises(dl.HubUnreachable, match="out of reach .ConnectionError: .Errno -2. Name or service not known"):
        dl.probe_hub(request=request)
    assert len(attempts) == 1  # no retry loop: an offline machine is told at once
    assert timeouts == [dl.PROBE_TIMEOUT_S] and dl.PROBE_TIMEOUT_S <= 10


def test_probe_asks_the_endpoint_that_hf_endpoint_names(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", "https://hf-mirror.example")
    attempts = []
    dl.probe_hub(request=lambda url, timeout: attempts.append(url))  # answers: no exception
    assert attempts == ["https://hf-mirror.example/api/datasets/kjj0/fineweb10B-gpt2"]


def test_probe_gives_up_on_a_request_that_hangs_past_its_timeout():
    """A hanging DNS lookup ignores the HTTP timeout; the probe still returns after `timeout`."""
    never = threading.Event()
    with pytest.raises(dl.HubUnreachable, match="did not answer within 0.01 s"):
        dl.probe_hub(request=lambda url, timeout: never.wait(), timeout=0.01)
    never.set()  # lets the abandoned request's thread end


def test_hub_offline_mode_is_reported_without_any_request(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    attempts = []
    with pytest.raises(dl.HubUnreachable, match="HF_HUB_OFFLINE is set"):
        dl.probe_hub(request=failing_request(attempts))
    assert attempts == []


def test_offline_prints_one_line_saying_what_to_do_and_creates_no_folder(tmp_path, capsys):
    out = tmp_path / "data" / "fineweb10B"
    assert dl.main(["1", "--out", str(out)], fetch=refuse_to_fetch, probe=offline_probe) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert "could not download from the Hugging Face Hub dataset kjj0/fineweb10B-gpt2" in err
    assert "this machine seems offline" in err and f"Copy the shards into {out}/ by hand" in err
    assert "HF_ENDPOINT" in err
    assert not (tmp_path / "data").exists()


def test_unreachable_hub_gives_a_clear_message_and_keeps_finished_files(tmp_path, capsys):
    tg.write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))
    assert dl.main(["2", "--out", str(tmp_path)], fetch=refuse_to_fetch, probe=offline_probe) == 1
    assert "run the same command again" in capsys.readouterr().err
    assert tg.shard_token_count(tmp_path / "fineweb_val_000000.bin") == 100


def test_files_already_present_need_no_network(tmp_path):
    for name in dl.shard_names(2):
        tg.write_shard(tmp_path / name, np.arange(100))

    def probe_must_not_run():
        raise AssertionError("probed the hub although every file is present")

    assert dl.main(["2", "--out", str(tmp_path)], fetch=refuse_to_fetch, probe=probe_must_not_run) == 0


def test_a_download_failing_midway_removes_only_the_folders_it_created_and_left_empty(tmp_path, capsys):
    def dropped_connection(name, directory):
        (Path(directory) / ".cache" / "huggingface").mkdir(parents=True)  # what the hub client makes first
        raise ConnectionError("connection reset by peer")

    existing = tmp_path / "existing"
    existing.mkdir()
    assert dl.main(["1", "--out", str(existing / "new" / "shards")], fetch=dropped_connection) == 1
    assert "connection reset by peer" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [existing] and list(existing.iterdir()) == []


def test_a_failing_download_keeps_the_files_of_the_folder_it_created(tmp_path):
    out = tmp_path / "new"

    def second_fetch_fails(name, directory):
        if name != "fineweb_val_000000.bin":
            raise ConnectionError("connection reset by peer")
        tg.write_shard(Path(directory) / name, np.arange(100))

    assert dl.main(["1", "--out", str(out)], fetch=second_fetch_fails) == 1
    assert tg.shard_token_count(out / "fineweb_val_000000.bin") == 100


# ---- the command line: num_train in 1..103, --out a folder that can be written


@pytest.mark.parametrize("num_train", ["0", "104", "-1", "abc", "1.5"])
def test_num_train_outside_1_to_103_is_refused_naming_the_argument(num_train, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        dl.main([num_train, "--out", str(tmp_path)], fetch=refuse_to_fetch, probe=offline_probe)
    assert exited.value.code == 2
    assert one_error_line(capsys) == (f"error: argument num_train: must be a whole number of train shards in "
                                      f"1..103, got {num_train!r} (see data/cached_fineweb10B.py --help)")


@pytest.mark.parametrize("argv, expected", [([], 30), (["1"], 1), (["103"], 103)])
def test_num_train_accepts_1_to_103_and_defaults_to_one_record_run(argv, expected):
    assert dl.parse_args(argv).num_train == expected


def test_out_that_is_a_file_is_refused_before_any_network(tmp_path, capsys):
    (tmp_path / "shards").write_text("not a folder")
    assert dl.main(["1", "--out", str(tmp_path / "shards")], fetch=refuse_to_fetch, probe=offline_probe) == 2
    assert one_error_line(capsys).startswith(f"error: --out {tmp_path / 'shards'}: ")


def test_out_in_an_unwritable_folder_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as root, chmod would not stop us
    assert dl.main(["1", "--out", str(tmp_path / "shards")], fetch=refuse_to_fetch, probe=offline_probe) == 2
    assert one_error_line(capsys) == (f"error: --out {tmp_path / 'shards'}: {tmp_path} is not writable; "
                                      "choose another --out or fix its permissions")


def test_help_documents_the_range_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        dl.main(["--help"])
    assert exited.value.code == 0
    assert "1..103" in capsys.readouterr().out
