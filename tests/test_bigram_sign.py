"""--bigram_sign_rows (PR #299, docs/short-track-transfer.md section 3) and the float
--bigram_table_multiple (#315's 7.5): the sign index against a plain-Python loop, the sign table
(+-1, a buffer from its own seed stream, the same on every build, rank and resume), the signed rows
against the signless model (equal with a zero table; the table's gradient the signless one times s_t),
the table's row count, the dry run's counts and memory, a tiny run that learns, and (slow) two
processes against accumulation and a resume after SIGKILL."""
import random

import pytest
import torch

import train_gpt_medium as tg
from reference import summation_error_bound
from test_bulk_model import FOUR_BLOCKS, fill_random, packed
from test_distributed import on_ranks, whole_adam_state
from test_training import all_state, assert_same_state, random_batches

SIGN_ROWS = 64  # the tiny tests' sign table (the record's 8192 where its size matters)
TINY_ROWS = 5 * 512


def tiny(**overrides):
    return tg.make_config("tiny", **{"dtype": "float32", "bigram_embed": True, **overrides})


def signed(**overrides):
    return tiny(bigram_sign_rows=SIGN_ROWS, **overrides)


# ---- the sign index


def reference_sign_ids(seq: list[int], rows: int) -> list[int]:
    """s_0 = row 0; s_t = (x_(t-1) XOR x_t) mod rows, in Python ints."""
    return [0] + [(seq[t - 1] ^ seq[t]) % rows for t in range(1, len(seq))]


@pytest.mark.parametrize("rows", [8192, 1000, 7])
def test_the_sign_index_equals_a_plain_python_loop(rows):
    rng = random.Random(rows)
    for vocab in (512, 50304, 65536):
        for length in (1, 2, 3, 300):
            seq = [rng.randrange(vocab) for _ in range(length)]
            got = tg.bigram_sign_ids(torch.tensor(seq, dtype=torch.int32), rows)
            assert got.dtype == torch.int64 and got.tolist() == reference_sign_ids(seq, rows)


def test_the_sign_index_at_hand_computed_positions():
    # 464 XOR 2068 = 0b111010000 XOR 0b100000010100 = 0b100111000100; mod 8192 keeps the low 13 bits
    assert 464 ^ 2068 == 2500 and 50256 ^ 464 == 50560 and 50560 - 6 * 8192 == 1408
    assert tg.bigram_sign_ids(torch.tensor([50256, 464, 2068, 2068]), 8192).tolist() == [0, 1408, 2500, 0]
    assert tg.bigram_sign_ids(torch.tensor([9]), 8192).tolist() == [0]  # position 0 alone: row 0
    # across a document boundary (eot 50256) the previous token is the eot, as in the bigram hash
    assert 5 ^ 50256 == 50261 and 50261 - 6 * 8192 == 1109
    assert tg.bigram_sign_ids(torch.tensor([5, 50256, 5]), 8192).tolist() == [0, 1109, 1109]


def test_the_sign_index_traces_into_one_graph():
    ids = torch.randint(0, 50257, (300,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    traced = torch.compile(tg.bigram_sign_ids, backend="eager", fullgraph=True)(ids, 8192)
    assert torch.equal(traced, tg.bigram_sign_ids(ids, 8192))


def test_the_signed_rows_trace_into_one_graph():
    model = tg.build_model(signed())
    with torch.no_grad():
        model.bigram.table.normal_(generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 500, (512,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    rows, _ = torch.compile(model.bigram, backend="eager", fullgraph=True)(ids)
    assert torch.equal(rows, model.bigram(ids)[0])


# ---- the sign table


def signs_of(model) -> torch.Tensor:
    return model.bigram.signs.table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_sign_is_plus_or_minus_one_from_its_own_normal_stream(dtype):
    model = tg.build_model(tiny(bigram_sign_rows=8192, dtype=dtype))
    table = signs_of(model)
    assert table.shape == (8192, 64) and table.dtype == getattr(torch, dtype)
    assert torch.equal(table.abs(), torch.ones_like(table))
    assert abs(table.float().mean().item()) < 0.01  # about half of each sign
    draw = torch.randn((8192, 64), generator=tg._param_generator(0, "bigram.signs.table"))
    assert torch.equal(table.float(), draw.sign())  # the sign of a standard normal draw (no draw is 0 here)


def test_the_table_is_a_buffer_not_a_parameter_nor_saved():
    model = tg.build_model(signed())
    plain = tg.build_model(tiny())
    assert tg.parameter_counts(model) == tg.parameter_counts(plain)
    assert not signs_of(model).requires_grad
    assert all(p is not signs_of(model) for p in model.parameters())
    assert model.state_dict().keys() == plain.state_dict().keys()  # not saved: drawn again from the seed
    assert "bigram.signs.table" in dict(model.named_buffers())
    # its optimizer groups are the plain model's
    runner = tg.Runner(signed(), torch.device("cpu"))
    assert {g["name"] for opt in runner.optimizers for g in opt.param_groups} == {
        g["name"] for opt in tg.Runner(tiny(), torch.device("cpu")).optimizers for g in opt.param_groups}


def test_the_same_seed_builds_the_same_table_and_another_seed_another():
    a, b = tg.build_model(signed(seed=3)), tg.build_model(signed(seed=3))
    assert torch.equal(signs_of(a), signs_of(b))
    assert not torch.equal(signs_of(a), signs_of(tg.build_model(signed(seed=4))))
    # the other parameters' streams do not move with the sign table (matched initialization)
    plain = tg.build_model(tiny(seed=3))
    assert all(torch.equal(p, dict(a.named_parameters())[n]) for n, p in plain.named_parameters())


# ---- the signed rows in the model


def same_weights(dtype="float32", **layout):
    """A --bigram_embed model without and with signs, random values in every parameter but the
    table (zero, its start)."""
    plain, with_signs = tg.build_model(tiny(dtype=dtype, **layout)), tg.build_model(signed(dtype=dtype, **layout))
    names = {n for n, _ in plain.named_parameters() if n != "bigram.table"}
    fill_random(plain, names=names)
    fill_random(with_signs, names=names)
    return plain, with_signs


def loss_and_grads(model, config, keep_rows=False):
    """The loss and every parameter's gradient; with keep_rows also the gradient that reaches the
    bigram rows (1, T, d) as the blocks receive them."""
    model.zero_grad(set_to_none=True)
    seen = []

    def keep(module, args, out):
        out[0].retain_grad()
        seen.append(out[0])

    if keep_rows:
        handle = model.bigram.register_forward_hook(keep)
    inputs, targets = packed(config)
    loss = model(inputs, targets, torch.tensor([3, 1]))
    loss.backward()
    if keep_rows:
        handle.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, (seen[0].grad if keep_rows else None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_zero_table_gives_the_signless_losses_and_gradients_bit_for_bit(dtype):
    """On four blocks (FOUR_BLOCKS: every layer pattern; an exact equality that does not depend on
    the depth)."""
    plain, with_signs = same_weights(dtype, **FOUR_BLOCKS)
    config = tiny(dtype=dtype, **FOUR_BLOCKS)
    want, want_grads, _ = loss_and_grads(plain, config)
    got, grads, _ = loss_and_grads(with_signs, config)
    assert torch.equal(got, want)
    for n, g in want_grads.items():
        if n != "bigram.table":
            assert (g is None and grads[n] is None) or torch.equal(g, grads[n]), n
    assert grads["bigram.table"].any() and not torch.equal(grads["bigram.table"], want_grads["bigram.table"])


def test_the_table_gradient_is_the_signless_one_times_s_t_row_by_row():
    """Zero table: both models see the same rows' gradient g_t; the signless table's gradient is
    sum_t g_t at row h_t, the signed one's sum_t g_t * s_t. A row read at one position only is the
    signless row times that position's signs exactly; every row against a float64 sum, to the
    bound of an fp32 sum of that row's terms in any order (the kernel's order differs by CPU kind)."""
    plain, with_signs = same_weights()
    config = tiny()
    inputs, _ = packed(config)
    _, want_grads, g_rows = loss_and_grads(plain, config, keep_rows=True)
    _, grads, g_rows_signed = loss_and_grads(with_signs, config, keep_rows=True)
    assert torch.equal(g_rows, g_rows_signed)
    h = tg.bigram_ids(inputs, TINY_ROWS)
    s = signs_of(with_signs)[tg.bigram_sign_ids(inputs, SIGN_ROWS)]
    counts = torch.bincount(h, minlength=TINY_ROWS)
    once = torch.nonzero(counts == 1).squeeze(1)
    position = {int(r): t for t, r in enumerate(h.tolist()) if counts[r] == 1}
    assert once.numel() > 100 and (counts > 1).any()
    for r in once.tolist():
        assert torch.equal(grads["bigram.table"][r], want_grads["bigram.table"][r] * s[position[r]]), r
    # every row against a float64 sum, to what an fp32 sum of that row's terms may round by in any order
    terms = (g_rows[0] * s).double()  # s = +-1: each term is exact
    reference = torch.zeros(TINY_ROWS, 64, dtype=torch.float64).index_add_(0, h, terms)
    magnitude = torch.zeros(TINY_ROWS, 64, dtype=torch.float64).index_add_(0, h, terms.abs())
    error = (grads["bigram.table"].double() - reference).abs()
    assert (error <= summation_error_bound(magnitude, counts[:, None])).all()
    assert torch.equal(grads["bigram.table"].ne(0).any(dim=1), want_grads["bigram.table"].ne(0).any(dim=1))


def test_each_block_receives_the_row_times_its_signs():
    """A random table: the rows every block mixes in are table[h_t] * S[(x_(t-1) XOR x_t) mod N],
    index from the plain-Python loop; the validation forward reads them too."""
    _, model = same_weights()
    config = tiny()
    with torch.no_grad():
        model.bigram.table.normal_(generator=torch.Generator().manual_seed(1))
    inputs, targets = packed(config)
    seen = {}
    model.blocks[3].register_forward_pre_hook(lambda m, args: seen.__setitem__("rows", args[1].inputs[-1]))
    with torch.no_grad():
        model(inputs, targets, torch.tensor([3, 1]))
    index = torch.tensor(reference_sign_ids(inputs.tolist(), SIGN_ROWS))
    want = model.bigram.table[tg.bigram_ids(inputs, TINY_ROWS)] * signs_of(model)[index]
    assert torch.equal(seen["rows"], want[None])
    assert not torch.equal(want, model.bigram.table[tg.bigram_ids(inputs, TINY_ROWS)])
    model.eval()
    with torch.no_grad():
        before = model(inputs, targets, torch.tensor([3, 1]))
        signs_of(model)[1:].neg_()  # every row but 0
        assert not torch.equal(model(inputs, targets, torch.tensor([3, 1])), before)


def test_a_tiny_run_learns():
    """On four blocks (FOUR_BLOCKS: the signed rows reach every block's input as at sixteen; that they
    learn does not depend on the depth)."""
    config = signed(**FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    first, second = random_batches(config, seed=0), random_batches(config, seed=1)
    signs = signs_of(runner.model).clone()
    losses = [runner.train_step(step, first if step < 2 else second).item() for step in range(12)]
    assert losses[-1] < 0.9 * losses[2]
    assert runner.model.bigram.table.detach().any()
    assert torch.equal(signs_of(runner.model), signs)  # not trained


def test_a_checkpoint_round_trip_resumes_with_the_same_table_and_steps(synthetic_dir, tmp_path):
    """On four blocks (FOUR_BLOCKS: a bit-for-bit resume does not depend on the depth)."""
    config = signed(**FOUR_BLOCKS, warmup_steps=0, checkpoint_dir=str(tmp_path / "ck"),
                    train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    files = tg.shard_files(config.train_files, "train_files")
    loader_of = lambda: tg.train_loader(config, files, 0, 1, torch.device("cpu"))
    batch = lambda loader, step: loader.next_batch(tg.slice_tokens(step, config))
    runner, loader = tg.Runner(config, torch.device("cpu")), loader_of()
    for step in range(4):
        runner.train_step(step, batch(loader, step))
    path = tg.save_checkpoint(runner, loader, 4, 1.0)
    resumed, resumed_loader = tg.Runner(config, torch.device("cpu")), loader_of()
    tg.load_checkpoint(resumed, resumed_loader, path, tg.validate_checkpoint(path))
    assert torch.equal(signs_of(resumed.model), signs_of(runner.model))
    assert_same_state(all_state(resumed), all_state(runner))
    for step in (4, 5):
        assert torch.equal(runner.train_step(step, batch(loader, step)),
                           resumed.train_step(step, batch(resumed_loader, step)))
    assert_same_state(all_state(resumed), all_state(runner))


# ---- the table's rows: a float multiple


@pytest.mark.parametrize("multiple,preset,rows", [(5, "medium", 251_520), (5.0, "medium", 251_520),
                                                  (7.5, "medium", 377_280), (7.5, "tiny", 3_840),
                                                  (0.5, "tiny", 256), (1.3, "tiny", 665)])
def test_the_table_has_floor_of_the_multiple_times_the_vocabulary_rows(multiple, preset, rows):
    config = tg.make_config(preset, bigram_embed=True, bigram_table_multiple=multiple)
    assert tg.bigram_table_rows(config) == rows
    with torch.device("meta"):
        assert tg.GPT(config).bigram.table.shape == (rows, config.model_dim)


def test_5_and_5_0_are_one_value_for_flags_and_checkpoints():
    assert tg.parse_args(["--bigram_embed", "--bigram_table_multiple=5"]).bigram_table_multiple == 5.0
    now = tg.config_record(tg.make_config(bigram_embed=True), torch.bfloat16)
    saved = {**now, "bigram_table_multiple": 5}  # a checkpoint written while the field was an int
    assert tg.config_differences(saved, now) == {}
    assert tg.parameter_layout(saved) == tg.parameter_layout(now)


@pytest.mark.parametrize("flags,words", [
    (["--bigram_table_multiple=0.003"], "--bigram_table_multiple: 0.003 x 512 rows gives 1: the hash needs 2 rows"),
    (["--bigram_table_multiple=0"], "--bigram_table_multiple: 0.0 is not allowed"),
    (["--bigram_sign_rows=-1"], "--bigram_sign_rows: -1 is not allowed"),
])
def test_bad_values_are_refused_in_one_line(flags, words):
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args(["--preset=tiny", "--bigram_embed", *flags])
    assert str(refusal.value).startswith(words) and "\n" not in str(refusal.value)


def test_sign_rows_without_the_bigram_table_build_nothing_and_say_so():
    config = tg.make_config("tiny", bigram_sign_rows=64)
    assert tg.build_model(config).bigram is None
    assert any("--bigram_sign_rows=64 has no effect without" in n for n in tg.inert_setting_notes(config))


# ---- the record's size: counts and memory


def test_the_dry_run_counts_and_memory_at_mudds_size():
    """The sign table adds no parameter and 8192 x 1024 x 2 B = 16 MiB held per GPU, and one (T, d)
    bf16 tensor of kept activations (T = 65,536: 128 MiB); the 7.5 table adds 125,760 x 1024
    parameters with their gradients and fp32 Adam moments (1/8 of its rows' on each of 8 GPUs)."""
    mudd = tg.make_config(recipe="mudd")
    both = tg.make_config(recipe="mudd", bigram_sign_rows=8192, bigram_table_multiple=7.5)
    signs = tg.make_config(recipe="mudd", bigram_sign_rows=8192)
    with torch.device("meta"):
        models = {name: tg.GPT(c, torch.bfloat16) for name, c in (("mudd", mudd), ("both", both), ("signs", signs))}
    counts = {name: tg.parameter_counts(m)["total"] for name, m in models.items()}
    assert counts == {"mudd": 871_110_088, "both": 871_110_088 + 128_778_240, "signs": 871_110_088}
    held = {name: tg.state_bytes_per_gpu(m, c, 8) for (name, m), c in zip(models.items(), (mudd, both, signs))}
    assert "sign table" not in held["mudd"] and held["signs"]["sign table"] == held["both"]["sign table"] == 16 * 2**20
    assert {k: v for k, v in held["signs"].items() if k != "sign table"} == held["mudd"]
    extra = 128_778_240
    assert held["both"]["parameters"] - held["mudd"]["parameters"] == 2 * extra
    assert held["both"]["adam"] - held["mudd"]["adam"] == 8 * extra // 8  # fp32 moments, sharded by rows
    parts = {name: tg.peak_parts(c) for name, c in (("mudd", mudd), ("both", both), ("signs", signs))}
    assert parts["signs"]["training"] - parts["mudd"]["training"] == 65_536 * 1024 * 2
    assert parts["signs"]["state"] - parts["mudd"]["state"] == 16 * 2**20
    assert parts["both"]["state"] - parts["signs"]["state"] == (2 + 2 + 1) * extra
    assert tg.predicted_peak_mib(both) - tg.predicted_peak_mib(mudd) == round((5 * extra + 16 * 2**20 + 128 * 2**20)
                                                                               / 2**20)  # table, signs, kept signs


# ---- several processes and a killed run (slow)


def run_signed_steps(rank: int, world_size: int):
    """The tiny signed Runner on world_size processes (each its slices of fixed random batches), 4
    steps with Adam every step; its sign table, its state, and whether each exchange went sparse. On
    four blocks (FOUR_BLOCKS): the table's exchange does not depend on the depth."""
    calls = []
    real = tg.send_touched_rows
    tg.send_touched_rows = lambda exchange, table: calls.append(True) or real(exchange, table)
    config = signed(adam_odd_steps_only=False, **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"), rank, world_size)
    for step in range(4):
        batches = random_batches(config, seed=step)
        runner.train_step(step, batches[rank * runner.micro_steps:(rank + 1) * runner.micro_steps])
    return signs_of(runner.model).clone(), all_state(runner), calls


@pytest.mark.slow
def test_two_processes_with_the_sparse_exchange_train_as_one_process_with_two_micro_steps(tmp_path):
    results = on_ranks(run_signed_steps, 2, tmp_path)
    want_signs, want, _ = run_signed_steps(0, 1)
    for signs, state, calls in results:
        assert torch.equal(signs, want_signs)  # every rank draws the same table
        assert calls == [True] * 4
    state = whole_adam_state([state for _, state, _ in results], want)  # Adam's sharded rows put together
    for k, v in want.items():
        if not k.startswith("opt1/"):  # Muon's state: each rank holds its own matrices'
            assert torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)), k


# A run killed with SIGKILL resumes bit for bit with the sign rows on: tests/test_transfer_recipe.py's
# whole-candidate run, which has every section 12-18 idea on at once.
