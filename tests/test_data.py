"""Shards and the training loader (docs/recipe.md, "Data"): the file format read back independently with numpy,
errors that name the file and the problem, and the loader's slices checked against the shard's
own tokens, across world sizes and shard boundaries."""
import numpy as np
import pytest
import torch

import train_gpt_medium as tg

HEADER_BYTES = 256 * 4


def raw_shard(path, header: list[int], tokens: np.ndarray) -> None:
    """A shard written by hand (header ints, then uint16 tokens): lets the tests write bad ones."""
    h = np.zeros(256, dtype=np.int32)
    h[:len(header)] = header
    path.write_bytes(h.tobytes() + tokens.astype(np.uint16).tobytes())


def labelled_tokens(n: int, first: int) -> np.ndarray:
    """Tokens first, first+1, ...: every position of every shard is recognizable."""
    return (np.arange(n) + first) % 65536


# ---- the shard format


def test_write_then_read_shard_round_trips_uint16_tokens(tmp_path):
    tokens = np.array([0, 65535, 1, 50256, 32768, 65534, 7, 0], dtype=np.int64)
    path = tmp_path / "s.bin"
    tg.write_shard(path, tokens)
    got = tg.read_shard(path)
    assert got.dtype == torch.uint16
    assert got.to(torch.int64).tolist() == tokens.tolist()
    assert tg.shard_token_count(path) == tokens.size


def test_written_shard_has_the_published_layout(tmp_path):
    """256 int32 header (magic 20240520, version 1, count), then uint16 tokens, nothing else."""
    tokens = np.array([3, 65535, 0, 12345])
    path = tmp_path / "s.bin"
    tg.write_shard(path, tokens)
    data = path.read_bytes()
    assert len(data) == HEADER_BYTES + 2 * tokens.size
    header = np.frombuffer(data[:HEADER_BYTES], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 4] and not header[3:].any()
    assert np.frombuffer(data[HEADER_BYTES:], dtype="<u2").tolist() == tokens.tolist()


def test_shard_token_count_reads_the_header_of_a_hand_written_shard(tmp_path):
    path = tmp_path / "s.bin"
    raw_shard(path, [20240520, 1, 1000], labelled_tokens(1000, 5))
    assert tg.shard_token_count(path) == 1000
    assert tg.read_shard(path)[[0, 999]].tolist() == [5, 1004]


def read_error(path) -> str:
    """The message of the ShardError that both shard_token_count and read_shard raise."""
    with pytest.raises(tg.ShardError) as counted:
        tg.shard_token_count(path)
    with pytest.raises(tg.ShardError) as read:
        tg.read_shard(path)
    assert str(counted.value) == str(read.value)
    return str(read.value)


def test_truncated_shard_is_an_error_naming_file_and_counts(tmp_path):
    path = tmp_path / "fineweb_train_000001.bin"
    raw_shard(path, [20240520, 1, 1000], labelled_tokens(997, 0))
    msg = read_error(path)
    assert str(path) in msg and "1000" in msg and "997" in msg and "truncated" in msg


def test_file_shorter_than_the_header_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 100)
    msg = read_error(path)
    assert str(path) in msg and "header" in msg and "100" in msg


def test_wrong_magic_is_an_error(tmp_path):
    path = tmp_path / "magic.bin"
    raw_shard(path, [20240521, 1, 10], labelled_tokens(10, 0))
    msg = read_error(path)
    assert str(path) in msg and "magic" in msg and "20240521" in msg


def test_wrong_version_is_an_error(tmp_path):
    path = tmp_path / "version.bin"
    raw_shard(path, [20240520, 2, 10], labelled_tokens(10, 0))
    msg = read_error(path)
    assert str(path) in msg and "version" in msg


@pytest.mark.parametrize("bad", [65536, 70000, -1])
def test_write_shard_refuses_tokens_outside_uint16(tmp_path, bad):
    path = tmp_path / "s.bin"
    with pytest.raises(ValueError) as err:
        tg.write_shard(path, [1, 2, bad, 3])
    assert str(path) in str(err.value) and "65536" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


# ---- the loader


SEQ = 16  # tokens per slice in these tests


def make_shards(tmp_path, sizes: list[int]) -> list[str]:
    """Shards train_000.bin, ... of the given sizes; shard i's tokens start at 10000*i."""
    paths = []
    for i, n in enumerate(sizes):
        path = tmp_path / f"train_{i:03d}.bin"
        tg.write_shard(path, labelled_tokens(n, 10_000 * i))
        paths.append(str(path))
    return paths


def expected_step(shard: np.ndarray, position: int, batch_slices: int) -> list[tuple[list[int], list[int]]]:
    """batch_slices consecutive slices from `position`; targets are the inputs shifted by one."""
    out = []
    for s in range(batch_slices):
        start = position + s * SEQ
        out.append((shard[start:start + SEQ].tolist(), shard[start + 1:start + SEQ + 1].tolist()))
    return out


def as_lists(batches) -> list[tuple[list[int], list[int]]]:
    return [(x.tolist(), y.tolist()) for x, y in batches]


def count_steps(loader) -> int:
    steps = 0
    while True:
        try:
            loader.next_batch()
        except RuntimeError:
            return steps
        steps += 1


def test_a_step_is_consecutive_slices_with_targets_shifted_by_one(tmp_path):
    files = make_shards(tmp_path, [200])
    shard = labelled_tokens(200, 0)
    loader = tg.DataLoader(files, SEQ, batch_slices=2, rank=0, world_size=1, device="cpu")
    for step in range(3):
        batches = loader.next_batch()
        assert len(batches) == 2
        for inputs, targets in batches:
            assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
            assert inputs.shape == targets.shape == (SEQ,)
        assert as_lists(batches) == expected_step(shard, step * 2 * SEQ, 2), f"step {step}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_yields_its_own_slices_of_the_single_process_step(tmp_path, world_size):
    """Rank r of W yields slices r*k .. r*k+k-1 (k = 4/W) of what one process yields, every step,
    across a shard boundary."""
    files = make_shards(tmp_path, [300, 250])
    single = tg.DataLoader(files, SEQ, 4, 0, 1, "cpu")
    ranks = [tg.DataLoader(files, SEQ, 4, r, world_size, "cpu") for r in range(world_size)]
    k = 4 // world_size
    for step in range(7):  # 4 steps fit in the first shard (4*64 + 1 <= 300), 3 in the second
        whole = as_lists(single.next_batch())
        for r, loader in enumerate(ranks):
            assert as_lists(loader.next_batch()) == whole[r * k:(r + 1) * k], f"step {step}, rank {r}"


def test_loader_moves_to_the_next_shard_when_a_step_plus_one_token_does_not_fit(tmp_path):
    """Step = 2 slices = 32 tokens and needs 33. Shard 0 has 97 = 3*32 + 1 tokens: three steps, the
    last one ending on its final token. Shard 1 has 96: two steps, then the third would need 97."""
    files = make_shards(tmp_path, [97, 96, 40])
    shards = [labelled_tokens(97, 0), labelled_tokens(96, 10_000), labelled_tokens(40, 20_000)]
    loader = tg.DataLoader(files, SEQ, 2, 0, 1, "cpu")
    expected = ([expected_step(shards[0], p, 2) for p in (0, 32, 64)]
                + [expected_step(shards[1], p, 2) for p in (0, 32)]
                + [expected_step(shards[2], 0, 2)])
    for step, want in enumerate(expected):
        assert as_lists(loader.next_batch()) == want, f"step {step}"


def test_running_out_of_shards_is_an_error(tmp_path):
    files = make_shards(tmp_path, [40, 40])
    loader = tg.DataLoader(files, SEQ, 2, 0, 1, "cpu")
    loader.next_batch()
    loader.next_batch()
    with pytest.raises(RuntimeError, match="out of data"):
        loader.next_batch()


def test_steps_available_counts_what_the_loader_delivers(tmp_path):
    sizes = [97, 96, 33, 32, 200, 1, 65]
    files = make_shards(tmp_path, sizes)
    delivered = count_steps(tg.DataLoader(files, SEQ, 2, 0, 1, "cpu"))
    assert delivered == 3 + 2 + 1 + 0 + 6 + 0 + 2
    assert tg.steps_available(files, 2 * SEQ) == delivered


def test_steps_available_counts_what_the_loader_delivers_on_the_synthetic_shards(synthetic_dir):
    files = tg.shard_files(str(synthetic_dir / "synthetic_train_*.bin"), "train_files")
    seq_len, batch_slices = 512, 2
    delivered = count_steps(tg.DataLoader(files, seq_len, batch_slices, 0, 1, "cpu"))
    assert delivered > 0
    assert tg.steps_available(files, batch_slices * seq_len) == delivered


def test_an_empty_shard_feeds_no_steps(tmp_path):
    """A shard with zero tokens is skipped by the loader, so steps_available must count 0 for it
    (not (0 - 1) // step_tokens = -1)."""
    files = make_shards(tmp_path, [97, 0, 65])
    delivered = count_steps(tg.DataLoader(files, SEQ, 2, 0, 1, "cpu"))
    assert delivered == 3 + 0 + 2
    assert tg.steps_available(files, 2 * SEQ) == delivered


def test_shard_files_without_a_match_names_the_flag(tmp_path):
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(FileNotFoundError) as err:
        tg.shard_files(pattern, "train_files")
    assert "--train_files" in str(err.value) and pattern in str(err.value)


def test_shard_files_are_in_sorted_order(tmp_path):
    for name in ("b_002.bin", "b_000.bin", "b_010.bin", "b_001.bin"):
        tg.write_shard(tmp_path / name, [1, 2])
    got = tg.shard_files(str(tmp_path / "b_*.bin"), "train_files")
    assert [p.rsplit("/", 1)[-1] for p in got] == ["b_000.bin", "b_001.bin", "b_002.bin", "b_010.bin"]
