"""The 2025-12-31 record's step grid and document-aligned batches (docs/bulk-data.md).

Schedules: the values of the record's step table at every boundary, and at every step a plain
re-derivation from the record's formulas written out here.
Loader: documents, cuts, targets, shard changes and the split over ranks equal a plain loop over
end-of-text positions written here; it resumes exactly, across a batch-size change too. Wiring:
the warm-up visits every batch shape, train() feeds each step its own shape, a resumed run ends
bit-identical to the plain one, and two ranks read the one-process run's slices. (The benchmark
times the first step of each batch size: tests/test_bench.py.)"""
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS

RECORD = tg.make_config()  # the defaults are the record
TINY_GRID = tg.make_config("tiny")  # its grid at 1/25


# ==== the step grid

# (step, tokens per step, long window, short window, lr multiplier): the record's table, each
# boundary on both sides; the lr to the table's 4 decimals (the peaks exactly, below)
TABLE = [
    (0, 131072, 3, 1, 1.0), (391, 131072, 3, 1, 1.0),
    (392, 262144, 7, 3, 1.52), (783, 262144, 7, 3, 1.52),
    (784, 393216, 11, 5, 1.73), (1174, 393216, 11, 5, 1.73),
    (1175, 524288, 13, 6, 1.73),  # the batch is full, the peak not yet: x = 0.25 is not > 3/12
    (1176, 524288, 13, 6, 2.0), (1410, 524288, 13, 6, 2.0),
    (1411, 524288, 13, 6, 1.9994), (1566, 524288, 13, 6, 1.9099),
    (1567, 524288, 15, 7, 1.9093), (1958, 524288, 15, 7, 1.6835),
    (1959, 524288, 17, 8, 1.6829), (2349, 524288, 17, 8, 1.4577),
    (2350, 524288, 19, 9, 1.4571), (2741, 524288, 19, 9, 1.2313),
    (2742, 524288, 21, 10, 1.2308), (3133, 524288, 21, 10, 1.0050),
    (3134, 524288, 23, 11, 1.0044), (4699, 524288, 23, 11, 0.1006),
    (4700, 524288, 23, 11, 0.1), (4739, 524288, 23, 11, 0.1),
]


@pytest.mark.parametrize("step, tokens, long, short, lr", TABLE)
def test_the_record_grid_matches_its_step_table(step, tokens, long, short, lr):
    assert tg.batch_tokens(step, RECORD) == tokens
    assert tg.slice_tokens(step, RECORD) == tokens // 8  # one GPU's sequence of the record
    assert tg.attention_windows(step, RECORD) == (long, short)
    assert tg.grid_lr_multiplier(step, RECORD, 0.1) == pytest.approx(lr, abs=5e-5)


def test_the_lr_peaks_are_exact_and_change_only_strictly_past_a_slot_boundary():
    m = lambda s: tg.grid_lr_multiplier(s, RECORD, 0.1)
    assert [m(s) for s in (0, 391, 392, 783, 784, 1174, 1175, 1176, 1410)] == [
        1.0, 1.0, 1.52, 1.52, 1.73, 1.73, 1.73, 2.0, 2.0]
    assert m(1411) < 2.0  # the cooldown's first step: 1411/4700 >= 1 - 0.7 in floating point
    for step, value in ((2000, 1.659), (3000, 1.082), (4000, 0.504), (4690, 0.106)):
        assert m(step) == pytest.approx(value, abs=5e-4)
    assert m(4700) == m(4701) == m(4739) == 0.1  # down to the floor at S, which the extension keeps


def test_the_record_momentum_warms_up_over_300_steps_and_cools_down_over_the_last_50():
    mu = lambda s: tg.momentum_schedule(s, RECORD)
    assert mu(0) == 0.85 and mu(150) == pytest.approx(0.90, abs=1e-15) and mu(300) == mu(4690) == 0.95
    assert mu(4691) == pytest.approx(0.948, abs=1e-15)
    assert mu(4739) == pytest.approx(0.852, abs=1e-15)


def test_the_record_final_validation_uses_windows_27_and_11():
    assert tg.attention_windows(4740, RECORD) == (27, 11)
    assert tg.is_validation_step(4740, RECORD)


def test_the_record_multi_token_weights_fade_over_two_twelfths():
    w = lambda s: tg.multi_token_weights(s, RECORD)
    assert w(0) == (1.0, 0.5, 0.25)
    assert w(391) == pytest.approx((1.0, 0.5, 0.25 * (1 - 391 / 391.6667)), abs=1e-6) and len(w(391)) == 3
    assert w(392) == pytest.approx((1.0, 0.5 * (2 - 392 / 391.6667)), abs=1e-6)
    assert len(w(783)) == 2 and w(784) == w(4739) == w(4740) == (1.0,)


def test_the_record_splits_its_embeddings_after_the_odd_step_785():
    assert tg.embedding_split_step(RECORD) == 785  # ceil(4700 / 6) = 784, made odd


def test_the_record_rescales_rope_at_the_first_three_long_window_changes_only():
    assert tg.yarn_changes(RECORD) == [(392, 3, 7), (784, 7, 11), (1175, 11, 13)]
    assert tg.yarn_changes(tg.make_config(yarn_window_limit=0)) == []  # YaRN off


def test_the_record_validates_every_250_steps_and_at_the_end():
    assert [s for s in range(4741) if tg.is_validation_step(s, RECORD)] == list(range(0, 4741, 250)) + [4740]


def test_the_record_grid_has_its_slots_and_token_total():
    slots = [s for s in range(1, 4700) if tg.grid_slot(s, RECORD, 12) != tg.grid_slot(s - 1, RECORD, 12)]
    assert slots == [392, 784, 1175, 1567, 1959, 2350, 2742, 3134, 3525, 3917, 4309]
    assert sum(tg.batch_tokens(s, RECORD) for s in range(4740)) == 2_176_974_848


def record_formulas(s: int) -> dict:
    """The record's schedules as its script writes them, with its constants (S = 4700, 40 extension steps)."""
    S, N = 4700, 4740
    x = s / S
    batch = 524288 if s >= S else (131072, 262144, 393216, *[524288] * 9)[int(12 * x)]
    if s >= N:
        windows = (27, 11)
    elif s >= S:
        windows = (23, 23 // 2)
    else:
        long = (3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23)[int(12 * x)]
        windows = (long, min(11, long // 2))
    if s > S:
        lr = 0.1
    else:
        lr = 1.0
        if x > 1 / 12:
            lr = 1.52
        if x > 2 / 12:
            lr = 1.73
        if x > 3 / 12:
            lr = 2.0
        if x >= 1 - 0.7:
            w = (1 - x) / 0.7
            lr = lr * w + (1 - w) * 0.1
    if s < 300:
        momentum = 0.85 + s / 300 * (0.95 - 0.85)
    elif s > N - 50:
        momentum = 0.95 - (s - (N - 50)) / 50 * (0.95 - 0.85)
    else:
        momentum = 0.95
    q = s / (S / 4)
    mtp = (1.0, 0.5, 0.25 * (1 - 3 * q)) if q < 1 / 3 else (1.0, 0.5 * (1 - (3 * q - 1))) if q < 2 / 3 else (1.0,)
    return dict(batch=batch, windows=windows, lr=lr, momentum=momentum, mtp=mtp)


def test_every_step_of_the_record_grid_equals_the_records_formulas_bit_for_bit():
    for s in range(4741):
        want = record_formulas(s)
        got = dict(batch=tg.batch_tokens(s, RECORD), windows=tg.attention_windows(s, RECORD),
                   lr=tg.grid_lr_multiplier(s, RECORD, 0.1),
                   momentum=tg.momentum_schedule(s, RECORD), mtp=tg.multi_token_weights(s, RECORD))
        assert got == want, s


# ---- the tiny form


def test_the_tiny_grid_is_the_record_grid_at_steps_divided_by_25():
    """At every record step that is a multiple of 25, the tiny grid at step/25 has the record's
    windows, lr and multi-token weights and the batch scaled to the tiny slices (1/512)."""
    for s in range(0, 4700, 25):
        t = s // 25
        assert tg.batch_tokens(t, TINY_GRID) * 512 == tg.batch_tokens(s, RECORD)
        assert tg.attention_windows(t, TINY_GRID) == tg.attention_windows(s, RECORD)
        assert tg.grid_lr_multiplier(t, TINY_GRID, 0.1) == tg.grid_lr_multiplier(s, RECORD, 0.1)
        assert tg.multi_token_weights(t, TINY_GRID) == tg.multi_token_weights(s, RECORD)
        assert tg.momentum_schedule(t, TINY_GRID) == tg.momentum_schedule(s, RECORD)
    assert tg.attention_windows(190, TINY_GRID) == (27, 11)


def test_the_tiny_grid_runs_every_phase_within_its_steps():
    c, N = TINY_GRID, TINY_GRID.num_iterations
    assert N <= 200 and tg.scheduled_steps(c) == 188
    assert sorted({tg.batch_tokens(s, c) for s in range(N)}) == [256, 512, 768, 1024]
    assert sorted({tg.slice_tokens(s, c) % c.attn_block_size for s in range(N)}) == [0]
    assert {len(tg.multi_token_weights(s, c)) for s in range(N)} == {1, 2, 3}
    assert tg.embedding_split_step(c) == 33 < N
    assert [(old, new) for _, old, new in tg.yarn_changes(c)] == [(3, 7), (7, 11), (11, 13)]
    assert tg.untie_step(c) == 33 and c.untie_embed_after_step is None
    assert tg.embedding_split_step(tg.make_config("medium", recipe="bulk")) == 785
    assert tg.grid_lr_multiplier(N - 1, c, 0.1) == 0.1  # an extension step
    assert tg.momentum_schedule(N - 1, c) < c.muon_momentum  # inside the cool-down
    assert max(tg.attention_windows(s, c)[0] for s in range(N + 1)) * c.attn_block_size < c.train_seq_len


# ==== the document-aligned loader

EOT = 99  # end-of-text of the loader tests' shards (tokens 0..98 are words)


def document_shard(rng, num_docs: int, lead: int = 0) -> np.ndarray:
    """`lead` words (the end of a document begun in an earlier shard), then documents: an
    end-of-text and 0..14 words, one in five 15..59 words (longer than the tests' cut)."""
    parts = [rng.integers(0, EOT, lead)]
    for _ in range(num_docs):
        n = rng.integers(0, 15) if rng.random() < 0.8 else rng.integers(15, 60)
        parts += [[EOT], rng.integers(0, EOT, n)]
    return np.concatenate(parts).astype(np.int64)


def write_shards(tmp_path, shards) -> list[str]:
    paths = []
    for i, tokens in enumerate(shards):
        paths.append(str(tmp_path / f"docs_{i:03d}.bin"))
        tg.write_shard(paths[-1], tokens)
    return paths


def reference_steps(shards, seq_lens, num_slices: int, cut: int, eot: int = EOT):
    """The record's loop over end-of-text positions, step by step: per step, per slice, the
    (start, stop) token ranges of its pieces and the slice's seq_len + 1 tokens."""
    shard, next_doc = 0, 0
    for seq_len in seq_lens:
        while True:
            tokens = [int(t) for t in shards[shard]]
            bos = [p for p, t in enumerate(tokens) if t == eot]
            doc, step, complete = next_doc, [], True
            for _ in range(num_slices):
                pieces, held = [], 0
                while held <= seq_len:
                    if doc >= len(bos):
                        complete = False
                        break
                    start = bos[doc]
                    stop = min(bos[doc + 1] if doc + 1 < len(bos) else len(tokens), start + cut,
                               start + seq_len - held + 1)
                    pieces.append((start, stop))
                    held += stop - start
                    doc += 1
                if not complete:
                    break
                step.append((pieces, [t for a, b in pieces for t in tokens[a:b]]))
            if complete:
                break
            shard, next_doc = shard + 1, 0  # this step, whole, from the next shard's first document
        next_doc = doc
        yield step


def as_lists(batches):
    return [(x.tolist(), y.tolist()) for x, y in batches]


def expected(step):
    return [(tokens[:-1], tokens[1:]) for _, tokens in step]


def aligned_loader(files, num_slices=4, cut=12, rank=0, world_size=1):
    return tg.DocumentAlignedLoader(files, num_slices, cut, EOT, rank, world_size, "cpu")


@pytest.fixture
def doc_shards(tmp_path):
    """Four shards: the second starts inside a document, the third holds too little for a step."""
    rng = np.random.default_rng(0)
    shards = [document_shard(rng, 120), document_shard(rng, 90, lead=7), document_shard(rng, 3, lead=2),
              document_shard(rng, 250)]
    return shards, write_shards(tmp_path, shards)


RAMP = [8] * 4 + [16] * 4 + [24] * 3 + [32] * 12  # slice lengths of a batch ramp; step 11 opens shard 1, 15 shard 3


def test_aligned_slices_equal_the_reference_loop_across_shards_and_a_ramp(doc_shards):
    shards, files = doc_shards
    loader = aligned_loader(files)
    for i, (seq_len, want) in enumerate(zip(RAMP, reference_steps(shards, RAMP, 4, 12))):
        batches = loader.next_batch(seq_len)
        assert all(x.dtype == torch.int32 and y.dtype == torch.int64 and x.shape == (seq_len,) for x, y in batches)
        assert as_lists(batches) == expected(want), f"step {i}"
    assert loader.file_index == 3  # the walk reached the last shard: every transition was compared


def test_a_slice_is_whole_documents_cut_to_length_with_targets_shifted_by_one(tmp_path):
    E = EOT
    docs = [[E, 1, 2, 3], [E] + [4] * 20, [E, 5, 6], [E] + [7] * 5, [E] + [8] * 10, [E] + [9] * 9]
    files = write_shards(tmp_path, [[30, 31] + [t for d in docs for t in d]])  # 2 words before the first document
    a, b = aligned_loader(files, num_slices=2, cut=8).next_batch(15)
    # slice 0: 4 tokens, 8 of the 21 (cut), 3, then 1 of the next document fills 16 = 15 + 1
    s0 = [E, 1, 2, 3, E, 4, 4, 4, 4, 4, 4, 4, E, 5, 6, E]
    assert a[0].tolist() == s0[:-1] and a[1].tolist() == s0[1:]
    assert a[1][11].item() == E  # the cut document's last position is trained on the next document's start
    # slice 1 starts at the next document (the rest of [E, 7, ...] is dropped): 8 of 11 (cut), 8 of 10
    s1 = [E] + [8] * 7 + [E] + [9] * 7
    assert b[0].tolist() == s1[:-1] and b[1].tolist() == s1[1:]


def record_cu_seqlens(pieces) -> list[int]:
    """The record's document boundaries of a slice: 0, then the running piece lengths, the last
    one a token shorter (its last token is a target only)."""
    lengths = [stop - start for start, stop in pieces]
    lengths[-1] -= 1
    return [0] + np.cumsum(lengths).tolist()


def test_document_starts_of_a_slice_are_its_end_of_text_positions(doc_shards):
    """Document ids counted from end-of-text tokens (what the attention masks use) give exactly the
    record's document boundaries: every piece starts with one and holds no other."""
    shards, files = doc_shards
    loader = aligned_loader(files)
    for seq_len, want in zip(RAMP, reference_steps(shards, RAMP, 4, 12)):
        for (inputs, _), (pieces, _) in zip(loader.next_batch(seq_len), want):
            starts = sorted(set(record_cu_seqlens(pieces)) - {seq_len})
            assert torch.nonzero(inputs == EOT).flatten().tolist() == starts


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_yields_its_own_slices_of_the_one_process_step(doc_shards, world_size):
    _, files = doc_shards
    single = aligned_loader(files)
    ranks = [aligned_loader(files, rank=r, world_size=world_size) for r in range(world_size)]
    k = 4 // world_size
    for step, seq_len in enumerate(RAMP):
        whole = as_lists(single.next_batch(seq_len))
        for r, loader in enumerate(ranks):
            assert as_lists(loader.next_batch(seq_len)) == whole[r * k:(r + 1) * k], f"step {step}, rank {r}"


@pytest.mark.parametrize("stop_after", [3, 11, 15])  # before a size change; before a change of shard (twice)
def test_a_resumed_loader_continues_with_the_same_slices_across_a_size_change(doc_shards, stop_after):
    _, files = doc_shards
    loader = aligned_loader(files)
    for seq_len in RAMP[:stop_after]:
        loader.next_batch(seq_len)
    state = tg.loader_state(loader)
    assert set(state) == {"file", "file_tokens", "position"} and state["file"].startswith("docs_")
    resumed = aligned_loader(files)
    tg.load_loader_state(resumed, state)
    for step, seq_len in enumerate(RAMP[stop_after:], stop_after):
        assert as_lists(resumed.next_batch(seq_len)) == as_lists(loader.next_batch(seq_len)), f"step {step}"


def test_a_position_inside_a_document_resumes_at_the_next_document(tmp_path):
    """A contiguous loader's position (a forced resume) lands mid-document: the walk begins at the
    next end-of-text."""
    E = EOT
    files = write_shards(tmp_path, [[E, 1, 2, 3, E, 4, 5, E, 6, 7, 8, 9, E, 1, 1, 1, 1, 1]])
    loader = aligned_loader(files, num_slices=1)
    tg.load_loader_state(loader, dict(file="docs_000.bin", file_tokens=18, position=5))
    assert loader.next_batch(5)[0][0].tolist() == [E, 6, 7, 8, 9]


def test_a_step_that_does_not_fit_comes_whole_from_the_next_shards_first_document(tmp_path):
    E = EOT
    files = write_shards(tmp_path, [[E, 1, 2, E, 3, 4, 5, 6, E, 7],  # 10 tokens: one slice of 8 + 1 fits, two do not
                                    [11, 12, E, *range(13, 23), E, *range(23, 33)]])
    a, b = aligned_loader(files, num_slices=2, cut=100).next_batch(8)
    assert a[0].tolist() == [E, *range(13, 20)] and b[0].tolist() == [E, *range(23, 30)]


def test_running_out_of_documents_names_the_flag(tmp_path):
    files = write_shards(tmp_path, [[EOT, 1, 2, 3] * 5])
    loader = aligned_loader(files, num_slices=2)
    loader.next_batch(4)
    with pytest.raises(tg.ShardError, match="--train_files: the documents of the 1 shard"):
        loader.next_batch(8)


def test_a_ramp_of_contiguous_slices_takes_each_steps_own_length(tmp_path):
    tokens = np.arange(1000) % 500
    files = write_shards(tmp_path, [tokens])
    loader = tg.DataLoader(files, 64, 2, 0, 1, "cpu")
    position = 0
    for seq_len in (16, 16, 32, 64):
        got = as_lists(loader.next_batch(seq_len))
        want = [(tokens[p:p + seq_len].tolist(), tokens[p + 1:p + seq_len + 1].tolist())
                for p in (position, position + seq_len)]
        assert got == want
        position += 2 * seq_len


def test_steps_fed_counts_what_the_loaders_deliver(tmp_path):
    """Contiguous slices with a ramp: exactly; whole documents: never fewer than delivered."""
    rng = np.random.default_rng(1)
    shards = [document_shard(rng, 40), document_shard(rng, 25)]
    files = write_shards(tmp_path, shards)
    for aligned in (False, True):
        config = tg.make_config("tiny", batch_slices=2, train_seq_len=64, attn_block_size=8, num_iterations=100,
                                extension_steps=0, batch_schedule=(32, 64, 128), document_aligned_batches=aligned,
                                document_cut_tokens=12, eot_token=EOT, vocab_size=100, val_seq_len=64, val_tokens=128)
        loader = tg.train_loader(config, files, 0, 1, "cpu")
        delivered = 0
        try:
            while delivered < 100:
                loader.next_batch(tg.slice_tokens(delivered, config))
                delivered += 1
        except (RuntimeError, tg.ShardError):
            pass
        fed = tg.steps_fed(files, config)
        assert fed == delivered if not aligned else fed >= delivered > 0


# ==== wiring: the warm-up, the benchmark, train(), resume, two processes


def test_the_warmup_runs_every_batch_shape_of_the_grid(monkeypatch):
    """The tiny grid's model on four blocks (FOUR_BLOCKS: the steps are recorded, not run)."""
    seen = []
    monkeypatch.setattr(tg.Runner, "train_step", lambda self, step, batches, **kwargs: seen.append(
        (step, [tuple(x.shape) for x, _ in batches])))
    runner = tg.Runner(tg.make_config("tiny", **FOUR_BLOCKS), torch.device("cpu"))
    runner.warmup()  # eager: nothing to compile, the first warmup_steps steps only
    assert [s for s, _ in seen] == list(range(TINY_GRID.warmup_steps))
    seen.clear()
    runner.compiled = True  # as a compiled run (on CUDA) warms up
    runner.warmup()
    assert [s for s, _ in seen] == tg.warmup_schedule(TINY_GRID)
    assert all(shapes == [(tg.slice_tokens(s, TINY_GRID),)] * 2 for s, shapes in seen)
    shapes = {shape for _, shapes in seen for shape in shapes}
    assert shapes == {(tg.slice_tokens(s, TINY_GRID),) for s in range(TINY_GRID.num_iterations)}
    # and every step a grid change starts, with its neighbours
    steps = set(range(TINY_GRID.num_iterations))
    assert all({c - 1, c, c + 1} & steps <= {s for s, _ in seen} for c in tg.grid_changes(TINY_GRID))


def test_the_warmup_visits_only_the_phases_the_grid_has():
    """One window, no batch ramp, no extension: with neither multi-token prediction nor a split no
    phase changes; with them, only their changes are visited."""
    plain = dict(num_iterations=5690, extension_steps=0, batch_schedule=(), window_schedule=(13,),
                 lr_peaks=(1.0, 2.0), warmup_steps=2)
    config = tg.make_config(**plain, multi_token_prediction=False, untie_embed_after_step=0)
    assert tg.grid_changes(config) == [] and tg.warmup_schedule(config) == [0, 1]
    config = tg.make_config(**plain)
    mtp_and_split = [475, 949, 950]  # two multi-token changes (S/12, S/6) and the step after the split
    assert tg.untie_step(config) == 949 and tg.grid_changes(config) == mtp_and_split
    assert tg.warmup_schedule(config) == [0, 1, 474, 475, 476, 948, 949, 950, 951]


def test_the_schedules_reach_the_optimizers():
    runner = tg.Runner(tg.make_config("tiny", dtype="float32"), torch.device("cpu"))
    for step in (0, 20, 120, 189):
        tg.set_schedules(runner.optimizers, step, runner.config)
        for opt in runner.optimizers:
            for group in opt.param_groups:
                assert group["lr"] == group["initial_lr"] * tg.grid_lr_multiplier(step, runner.config, 0.1)
                if isinstance(opt, tg.Muon):
                    assert group["momentum"] == tg.momentum_schedule(step, runner.config)
        assert tuple(runner.window(step).tolist()) == tg.attention_windows(step, runner.config)  # [long, short]


def test_validation_is_the_same_contiguous_chunks_with_aligned_batches_too():
    """Two evaluation steps of 1,024 tokens (the preset's 8 would show nothing more)."""
    plain = tg.Runner(tg.make_config("tiny", dtype="float32", seed=3, document_aligned_batches=False,
                                     val_tokens=2048), torch.device("cpu"))
    aligned = tg.Runner(tg.make_config("tiny", dtype="float32", seed=3, document_aligned_batches=True,
                                       val_tokens=2048), torch.device("cpu"))
    val = torch.randint(0, 500, (plain.config.val_tokens + 1,), generator=torch.Generator().manual_seed(0))
    assert plain.evaluate(0, val) == aligned.evaluate(0, val)


def grid_argv(synthetic_dir, out, *extra, N=12):
    """A 12-step grid of 10 scheduled steps in 5 slots (2 steps each) and 2 extension steps, on four
    blocks (FOUR_BLOCKS: which slices a step is fed, and that a resume is bit for bit, do not depend
    on the depth; the run still crosses the split after step 3, every batch size and window change,
    the extension)."""
    return ["--preset=tiny", *FOUR_BLOCK_FLAGS, "--device=cpu", "--dtype=float32", "--seed=0",
            f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
            f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false",
            f"--num_iterations={N}", "--extension_steps=2", "--batch_schedule=256,512,768,1024,1024",
            "--lr_peaks=1,1.52,1.73,2,2", "--window_schedule=1,2,3,3,4", "--muon_momentum_cooldown_steps=3",
            "--document_aligned_batches", "--document_cut_tokens=256", "--val_every=0", "--val_tokens=1024",
            "--warmup_steps=0", f"--log_dir={out / 'logs'}", f"--checkpoint_dir={out / 'ck'}", *extra]


@pytest.fixture(scope="module")
def grid_run(synthetic_dir, tmp_path_factory):
    """The 12-step grid run, checkpointed every 4 steps, with the slices train() fed each step:
    (its folder, the fed slices as lists)."""
    out, fed, train_step = tmp_path_factory.mktemp("grid_run"), [], tg.Runner.train_step

    def recording(self, step, batches, **kwargs):
        fed.append(as_lists(batches))
        return train_step(self, step, batches, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tg.Runner, "train_step", recording)
        assert tg.main(grid_argv(synthetic_dir, out, "--save_every=4")) == 0
    return out, fed


def test_train_feeds_each_step_the_aligned_slices_of_its_batch_size(grid_run, synthetic_dir, tmp_path):
    _, fed = grid_run
    config = tg.parse_args(grid_argv(synthetic_dir, tmp_path))
    files = tg.shard_files(config.train_files, "train_files")
    shards = [tg.read_shard(f).numpy() for f in files]
    steps = reference_steps(shards, [tg.slice_tokens(s, config) for s in range(12)], 2, 256, config.eot_token)
    assert fed == [expected(step) for step in steps]
    assert [len(step[0][0]) for step in fed] == [128, 128, 256, 256, 384, 384, 512, 512, 512, 512, 512, 512]


def test_a_run_resumed_before_a_batch_size_change_ends_bit_identical(grid_run, synthetic_dir, tmp_path):
    from test_distributed import assert_bit_identical, checkpoint_tensors
    (whole, _), resumed = grid_run, tmp_path / "resumed"
    saved = whole / "ck/tiny/step_000004"  # steps 2, 3 had 512 tokens, step 4 (the resumed run's first) has 768
    assert tg.main(grid_argv(synthetic_dir, resumed, "--save_every=4", f"--resume={saved}")) == 0
    for step in (8, 12):
        assert_bit_identical(checkpoint_tensors(resumed / f"ck/tiny/step_{step:06d}"),
                             checkpoint_tensors(whole / f"ck/tiny/step_{step:06d}"))


def test_each_rank_reads_its_own_slices_of_the_one_process_step(synthetic_dir):
    """Two ranks' document-aligned loaders give, step after step across the batch ramp, exactly the
    slices one process's loader gives those ranks (rank r: slice r of each step), so two processes
    train on the one-process run's tokens; that the rest of a step is then the same is the exchange's
    (tests/test_distributed.py, two processes against one, bit for bit)."""
    config = tg.parse_args(grid_argv(synthetic_dir, Path("unused")))
    files = tg.shard_files(config.train_files, "train_files")
    make = lambda rank, world: tg.DocumentAlignedLoader(files, config.batch_slices, config.document_cut_tokens,
                                                        config.eot_token, rank, world, "cpu")
    one, ranks = make(0, 1), [make(r, 2) for r in range(2)]
    for step in range(config.num_iterations):
        seq_len = tg.slice_tokens(step, config)
        whole = one.next_batch(seq_len)
        for r, loader in enumerate(ranks):
            got = loader.next_batch(seq_len)
            assert len(got) == 1 and all(torch.equal(a, b) for a, b in zip(got[0], whole[r])), (step, r)
    # the same position: a checkpoint resumes
    assert [tg.loader_state(loader) for loader in ranks] == [tg.loader_state(one)] * 2


def test_too_few_shards_for_the_grid_are_refused_naming_the_flag(synthetic_dir):
    config = tg.make_config("tiny", num_iterations=10_000, train_files=str(synthetic_dir / "synthetic_train_*.bin"),
                            val_files=str(synthetic_dir / "synthetic_val_*.bin"))
    with pytest.raises(tg.ShardError, match=r"--train_files: 2 shard\(s\) feed at most \d+ of the run's 10000 steps"):
        tg.load_data(config)


@pytest.mark.parametrize("flag, value, message", [
    ("batch_schedule", "256,300", "300 must be a positive multiple of batch_slices*attn_block_size = 32"),
    ("batch_schedule", "2048", "at most batch_slices*train_seq_len = 1024"),
    ("extension_steps", "190", "must be less than num_iterations=190"),
    ("window_schedule", "3,0", "each at least 1 block"),
    ("window_schedule", "", "needs at least one window"),
    ("lr_peaks", "", "needs at least one multiplier"),
    ("lr_peaks", "1,nan", "1,nan: nan is not allowed; give comma-separated finite numbers"),
])
def test_grid_flags_out_of_range_are_refused_naming_the_flag(flag, value, message):
    with pytest.raises(tg.ConfigError, match=f"--{flag}") as err:
        tg.parse_args(["--preset=tiny", f"--{flag}={value}"])
    assert message in str(err.value)


def test_grid_lists_parse_from_the_command_line_and_an_empty_batch_schedule_is_off():
    config = tg.parse_args(["--preset=tiny", "--lr_peaks=1,1.52,2", "--batch_schedule=256,1024"])
    assert config.lr_peaks == (1.0, 1.52, 2.0) and config.batch_schedule == (256, 1024)
    config = tg.parse_args(["--preset=tiny", "--batch_schedule=256", "--batch_schedule="])
    assert config.batch_schedule == () and tg.batch_tokens(0, config) == config.batch_slices * config.train_seq_len


@pytest.mark.parametrize("steps, extension, split", [(4740, 40, 785), (4620, 40, 765), (4150, 25, 689), (4600, 40, 761)])
def test_the_bulk_recipes_embedding_split_follows_its_scheduled_steps(steps, extension, split):
    """ceil(S/6) made odd, as the record computes it from S = num_iterations - extension_steps: 785 for
    the record's 4700 + 40 steps, 765 and 689 at the lengths of the later claims (4580 + 40, 4125 + 25)."""
    config = tg.make_config("medium", recipe="bulk", num_iterations=steps, extension_steps=extension)
    assert tg.untie_step(config) == split
    assert split + 1 in tg.grid_changes(config)  # the warm-up compiles the untied phase where it now starts


def test_an_explicit_split_step_is_kept_and_0_means_untied_from_the_start():
    assert tg.untie_step(tg.make_config("medium", recipe="bulk", untie_embed_after_step=101)) == 101
    assert tg.untie_step(tg.make_config("medium", recipe="bulk", untie_embed_after_step=0)) == 0
    assert tg.make_config("medium", recipe="bulk", untie_embed_after_step="auto").untie_embed_after_step is None


def test_a_split_beyond_the_runs_last_step_is_said_once():
    short = tg.make_config("tiny", recipe="bulk", untie_embed_after_step=51, num_iterations=40, extension_steps=1)
    (note,) = [n for n in tg.recipe_notes(short) if "split" in n]
    assert "after step 51" in note and "last training step 39" in note
    assert not [n for n in tg.recipe_notes(tg.make_config("tiny", recipe="bulk")) if "split" in n]


def test_an_even_split_step_with_odd_step_adam_is_refused():
    """The split copies the head's Adam state right after an Adam step: with Adam on odd steps only,
    an even split would copy it while the head still holds an unapplied gradient."""
    with pytest.raises(tg.ConfigError, match="--untie_embed_after_step: 50 is even"):
        tg.make_config("tiny", untie_embed_after_step=50)
    assert tg.make_config("tiny", untie_embed_after_step=50, adam_odd_steps_only=False).untie_embed_after_step == 50
