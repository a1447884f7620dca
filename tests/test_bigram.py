"""--bigram_embed (PR #252, docs/bigram.md): the hash against the worked examples and a plain-Python
reference, the table and its per-layer weights in the block inputs' mixing, their optimizer values,
and the row-sparse gradient exchange against the dense all-reduce on two and three gloo processes."""
import random

import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCKS, fill_random, packed
from test_distributed import on_ranks, whole_adam_state
from test_training import all_state, random_batches

RECORD_ROWS = 5 * 50304  # 251,520
M = RECORD_ROWS - 1


def tiny(**overrides):
    return tg.make_config("tiny", **{"dtype": "float32", **overrides})


def hashed(seq, rows=RECORD_ROWS) -> list[int]:
    return tg.bigram_ids(torch.tensor(seq, dtype=torch.int32), rows).tolist()


# ---- the hash


@pytest.mark.parametrize("seq,want", [
    ([50256, 464, 2068, 7586, 21831], [251519, 204580, 28927, 57630, 129154]),
    ([50256, 50256, 0, 1, 0], [251519, 5862, 8169, 36313, 27191]),
    ([11, 13, 198, 50256, 464], [251519, 4763, 78264, 158884, 19030]),
    ([464, 464, 464], [251519, 204580, 37589]),
])
def test_the_hash_gives_the_worked_examples(seq, want):
    assert hashed(seq) == want


def test_the_hash_intermediates():
    # position 1 takes M as its previous token, whose product wraps in int32
    assert tg.int32_wrap(27191 * M) == -1_750_881_463
    assert 36313 * 464 == 16_849_232 and 16_849_232 ^ -1_750_881_463 == -1_767_722_471
    assert -1_767_722_471 % M == 204_580 and hashed([7, 464])[1] == 204_580  # any t_0: it is overwritten
    assert int(torch.fmod(torch.tensor(-1_767_722_471), M)) == -46_939  # what a C remainder would give
    assert 75_095_284 ^ 12_616_624 == 79_257_412 and hashed([0, 0, 464, 2068])[3] == 28_927
    assert 472_069 ^ 299_101 == 238_680 and hashed([0, 0, 11, 13])[3] == 238_680
    assert hashed([5, 5, 0, 0, 1, 0])[3:] == [0, 36_313, 27_191]
    assert hashed([9]) == [M]  # a one-token sequence: the reserved row only


def reference_hash(seq: list[int], rows: int) -> list[int]:
    """The record's hash in Python ints, its int32 wrap written as a bit mask: position 0 overwritten
    with M, then every later position hashed with the position before it."""
    def wrap(x):
        x &= 0xFFFFFFFF
        return x - 2**32 if x >= 2**31 else x
    m, s = rows - 1, list(seq)
    s[0] = m
    return [m] + [(wrap(36313 * s[i]) ^ wrap(27191 * s[i - 1])) % m for i in range(1, len(s))]


@pytest.mark.parametrize("vocab", [512, 50304, 65536])
def test_the_hash_equals_a_plain_python_reference_on_random_sequences(vocab):
    rng = random.Random(vocab)
    rows = 5 * vocab
    for length in (1, 2, 3, 200):
        # half of the ids from the top 16 of the vocabulary: 36313 x 65535 > 2^31 wraps
        seq = [rng.randrange(vocab - 16, vocab) if rng.random() < 0.5 else rng.randrange(vocab)
               for _ in range(length)]
        got = hashed(seq, rows)
        assert got == reference_hash(seq, rows)
        assert all(0 <= h < rows - 1 for h in got[1:])  # row M only at position 0
    assert hashed([65535, 65535, 65535], 5 * 65536)[2] == reference_hash([0, 65535, 65535], 5 * 65536)[2]


def test_the_hash_traces_into_one_graph_and_takes_int64_ids():
    ids = torch.randint(0, 50257, (300,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    traced = torch.compile(tg.bigram_ids, backend="eager", fullgraph=True)(ids, RECORD_ROWS)
    assert torch.equal(traced, tg.bigram_ids(ids, RECORD_ROWS))
    assert torch.equal(tg.bigram_ids(ids.long(), RECORD_ROWS), traced) and traced.dtype == torch.int64


# ---- the table and gamma in the model


def test_the_record_size_adds_the_table_and_one_weight_per_layer():
    with torch.device("meta"):
        bulk, bigram = tg.GPT(tg.make_config()), tg.GPT(tg.make_config(bigram_embed=True))
    counts = tg.parameter_counts(bigram)
    assert tg.parameter_counts(bulk)["total"] == 613_420_440
    assert counts["bigram"] == 257_556_480 == 251_520 * 1024 and counts["bigram_lambdas"] == 16
    assert counts["total"] == 613_420_440 + 257_556_480 + 16
    # the memory lines count the table's and the weights' Adam moments (in their own dtypes): on each
    # of 8 GPUs its 1/8 of the table's rows, the 16 weights whole
    held, bulk_held = (tg.state_bytes_per_gpu(m, c, 8) for m, c in
                       ((bigram, tg.make_config(bigram_embed=True)), (bulk, tg.make_config())))
    assert held["parameters"] - bulk_held["parameters"] == 257_556_480 * 2 + 16 * 4
    assert held["adam"] - bulk_held["adam"] == 2 * (257_556_480 * 2 // 8 + 16 * 4)
    assert any(line.startswith("params bigram: 257,556,480 (bfloat16)")
               for line in tg.accounting_lines(bigram, tg.make_config(bigram_embed=True)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_table_and_gamma_start_at_zero_and_005_with_their_optimizer_values(dtype):
    config = tiny(bigram_embed=True, dtype=dtype)
    runner = tg.Runner(config, torch.device("cpu"))
    table, gammas = runner.model.bigram.table, runner.model.bigram.lambdas
    assert table.shape == (5 * 512, 64) and table.dtype == getattr(torch, dtype) and not table.any()
    assert gammas.dtype == torch.float32 and torch.equal(gammas, torch.full((16,), 0.05))
    groups = {g["name"]: g for g in runner.optimizers[0].param_groups}
    assert groups["bigram"]["params"] == [table] and groups["bigram_lambdas"]["params"] == [gammas]
    assert groups["bigram"]["lr"] == groups["bigram_lambdas"]["lr"] == config.embed_lr == 0.004
    assert (table.lr_mul, table.wd_mul, table.betas) == (75.0, 5.0, (0.75, 0.95))
    assert (gammas.lr_mul, gammas.wd_mul, gammas.betas) == (1.0, 0.0, (0.9, 0.95))
    off = tg.build_model(tiny(bigram_embed=True, table_multipliers=False)).bigram.table
    assert (off.lr_mul, off.wd_mul) == (1.0, 1.0)
    # one Adam step: the first moments are (1 - beta1) g with each parameter's own beta1
    adam = runner.optimizers[0]
    gen = torch.Generator().manual_seed(0)
    away_from_0 = lambda shape: (torch.rand(shape, generator=gen) + 0.5) * torch.randn(shape, generator=gen).sign()
    g_table, g_gamma = away_from_0(table.shape).to(table.dtype), away_from_0(16)
    table.grad, gammas.grad = g_table, g_gamma
    adam.step()
    assert torch.equal(adam.state[table]["exp_avg"], torch.zeros_like(g_table).add_(g_table, alpha=0.25))
    assert torch.equal(adam.state[gammas]["exp_avg"], torch.zeros(16).add_(g_gamma, alpha=1 - 0.9))
    # the first step moves an entry by about its lr (Adam's m / sqrt(v) = sign(g)), here at the group's initial lr
    assert torch.allclose(table.float(), -0.004 * 75 * g_table.float().sign(), rtol=1e-2)
    assert torch.allclose(gammas, 0.05 - 0.004 * g_gamma.sign(), rtol=1e-4)


def same_weights(dtype="float32", **layout):
    """A bulk and a --bigram_embed tiny model with the same random values in every common parameter."""
    bulk = tg.build_model(tiny(dtype=dtype, **layout))
    bigram = tg.build_model(tiny(dtype=dtype, bigram_embed=True, **layout))
    names = {n for n, _ in bulk.named_parameters()}
    fill_random(bulk, names=names)
    fill_random(bigram, names=names)
    return bulk, bigram


def same_grad(a, b) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def loss_and_grads(model, config):
    model.zero_grad(set_to_none=True)
    inputs, targets = packed(config)
    loss = model(inputs, targets, torch.tensor([3, 1]))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_zero_table_or_zero_gammas_give_the_bulk_forward_and_gradients_exactly(dtype):
    """On four blocks (FOUR_BLOCKS: every layer pattern, a gamma per block; an exact equality that
    does not depend on the depth)."""
    bulk, bigram = same_weights(dtype, **FOUR_BLOCKS)
    config = tiny(dtype=dtype, **FOUR_BLOCKS)
    want, want_grads = loss_and_grads(bulk, config)
    # the table at zero (its start), gamma 0.05
    got, grads = loss_and_grads(bigram, config)
    assert torch.equal(got, want)
    assert all(same_grad(g, grads[n]) for n, g in want_grads.items())
    assert grads["bigram.table"].any()  # P2: it learns from step 0 ...
    assert not grads["bigram.lambdas"].any()  # ... while gamma's gradient b . dL/dx is 0 with b = 0
    # gamma at zero, a random table: the same function, and no gradient into the table (P2)
    with torch.no_grad():
        bigram.bigram.lambdas.zero_()
        bigram.bigram.table.normal_(generator=torch.Generator().manual_seed(5))
    got, grads = loss_and_grads(bigram, config)
    assert torch.equal(got, want)
    assert all(same_grad(g, grads[n]) for n, g in want_grads.items())
    assert not grads["bigram.table"].any() and grads["bigram.lambdas"].all()


def test_the_table_gradient_is_gamma_times_the_stream_gradient_on_the_hashed_rows_only():
    _, bigram = same_weights()
    config = tiny()
    inputs, _ = packed(config)
    _, grads = loss_and_grads(bigram, config)
    at_005 = grads["bigram.table"].clone()
    used = torch.zeros(5 * 512, dtype=torch.bool)
    used[tg.bigram_ids(inputs, 5 * 512)] = True
    assert torch.equal(at_005.ne(0).any(dim=1), used)  # every hashed row, row M included, and no other
    assert used[5 * 512 - 1]
    # with the table at zero the forward does not depend on gamma: the table's gradient is linear in it
    with torch.no_grad():
        bigram.bigram.lambdas.fill_(0.1)
    _, grads = loss_and_grads(bigram, config)
    assert torch.equal(grads["bigram.table"], 2 * at_005)  # 0.1 = 2 x 0.05 in fp32 (exact doubling)


def test_every_block_input_adds_gamma_i_times_the_unnormed_row_last_after_the_skip():
    """Each block's mixed input, read where its attention reads it (normed), against the mixing written
    out from what the block received: layer 0 (rho + a0) x + a1 x01 + g0 b, others rho x + a0 x00 +
    a1 x01 + gi b, x being the stream after the skip add."""
    _, model = same_weights()
    config = tiny()
    with torch.no_grad():
        model.bigram.table.normal_(generator=torch.Generator().manual_seed(1))
        model.bigram.lambdas.copy_(torch.linspace(-0.3, 0.4, 16))
    inputs, targets = packed(config)
    seen, normed = {}, {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args))
        block.attn.register_forward_pre_hook(lambda m, args, i=i: normed.__setitem__(i, args[0]))
    outputs = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: outputs.append(out))
    with torch.no_grad():
        model(inputs, targets, torch.tensor([3, 1]))
    x00, x01 = model.input_embeddings(inputs)
    b = model.bigram.table[tg.bigram_ids(inputs, 5 * 512)][None]
    rho, a = (t.detach() for t in model.mixing_weights())
    skips = config.skips
    for i in range(16):
        x, args = seen[i]  # the block's input and its BlockArgs
        x0s, weights = args.inputs, args.input_weights
        assert len(x0s) == 3 and torch.equal(x0s[2], b)  # the bigram rows, not normed, last
        assert len(weights) == 3 and torch.equal(weights[2], model.bigram.lambdas[i].detach())
        prev = x00 if i == 0 else outputs[i - 1]
        if i in skips:
            assert not torch.equal(x, prev)  # the skip was added before the block
        else:
            assert torch.equal(x, prev)
        g = model.bigram.lambdas[i].detach()
        mixed = ((rho[0] + a[0, 0]) * x + a[0, 1] * x01 if i == 0 else rho[i] * x + a[i, 0] * x00 + a[i, 1] * x01)
        assert torch.equal(normed[i], tg.rms_norm(mixed + g * b)), i


def test_the_validation_forward_reads_the_table_too():
    _, model = same_weights()
    config = tiny()
    inputs, targets = packed(config)
    model.eval()
    with torch.no_grad():
        before = model(inputs, targets, torch.tensor([3, 1]))
        model.bigram.table.normal_(generator=torch.Generator().manual_seed(2))
        assert not torch.equal(model(inputs, targets, torch.tensor([3, 1])), before)


def test_a_tiny_run_learns_and_adam_moves_rows_it_touched_before_even_when_unused_now():
    """Losses fall over 12 steps of repeated batches; Adam steps the whole table (P3): a row read at
    steps 0-1 only keeps moving on later Adam steps (its moments decay), rows never read stay zero.
    On four blocks (FOUR_BLOCKS, a gamma per block as at sixteen): the table's rows and their Adam
    steps do not depend on the depth."""
    config = tiny(bigram_embed=True, **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    first, second = random_batches(config, seed=0), random_batches(config, seed=1)
    table = runner.model.bigram.table
    rows_first = torch.unique(torch.cat([tg.bigram_ids(i, 5 * 512) for i, _ in first]))
    rows_second = torch.unique(torch.cat([tg.bigram_ids(i, 5 * 512) for i, _ in second]))
    only_first = rows_first[~torch.isin(rows_first, rows_second)]
    never = ~torch.isin(torch.arange(5 * 512), torch.cat([rows_first, rows_second]))
    assert only_first.numel() > 0 and never.any()
    losses = [runner.train_step(0, first).item(), runner.train_step(1, first).item()]
    after_first = table.detach()[only_first].clone()
    assert after_first.ne(0).any(dim=1).all()
    for step in range(2, 12):
        losses.append(runner.train_step(step, second).item())
    assert not torch.equal(table.detach()[only_first], after_first)
    assert not table.detach()[never].any()
    assert not torch.equal(runner.model.bigram.lambdas.detach(), torch.full((4,), 0.05))
    assert losses[-1] < 0.9 * losses[2]


# ---- the row-sparse gradient exchange: each rank's touched rows to the rank owning them


def exchange_cases(rank: int, world_size: int):
    """On each rank, for gradients nonzero on some rows only (bf16 normals; small integers, exact in any
    order of addition): (the rows this rank steps after the sparse exchange, the same rows of the dense
    all-reduce, this rank's own gradient, the bytes its all-to-alls sent, a reduce-scatter's)."""
    out = []
    gen = torch.Generator().manual_seed(10 + rank)
    for kind in ("normal", "integer"):
        grad = torch.randn(96, 16, generator=gen)
        if kind == "integer":
            grad = torch.randint(-8, 9, (96, 16), generator=gen).float()
        keep = torch.rand(96, generator=gen) < 0.2  # rows 0..9 on every rank, the others on some, 90.. on none
        keep[:10] = True
        keep[90:] = False
        grad[~keep] = 0
        table = torch.nn.Parameter(torch.zeros(96, 16, dtype=torch.bfloat16))
        table.grad = grad.to(torch.bfloat16)
        dense = table.grad.clone()
        torch.distributed.all_reduce(dense)
        mine = table.grad.clone()
        collectives = tg.CountedCollectives(world_size, rank)
        exchange = tg.GradientExchange([dict(params=[table], name="bigram")], [], rank, world_size, collectives,
                                       sparse_table=table, hooks=False)
        exchange.touched[:] = keep.numpy()  # the rows this rank's tokens read
        collectives.ledger = []
        exchange.wait()
        n = 96 // world_size
        sent = sum(c.sent for c in collectives.ledger)
        out.append((exchange.reduced[table], dense[rank * n:(rank + 1) * n], mine, sent, (world_size - 1) * n * 16 * 2))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sparse_exchange_gives_each_owner_the_dense_sum_of_its_rows(world_size, tmp_path, request):
    """Rank r receives every other rank's touched rows among r's (rows [r n, (r+1) n)) and adds them
    to its own: the dense all-reduce's rows, bit for bit on two ranks (a + b either way) and for
    integers (exact in any order), within 2 bf16 roundings per row on three; sending fewer bytes than
    a reduce-scatter where few rows are touched; rows nobody touched stay zero. (Two ranks: the
    module's one 2-process group, two_ranks.)"""
    if world_size == 2:
        results = [cases for cases, _ in request.getfixturevalue("two_ranks")]
    else:
        results = on_ranks(exchange_cases, world_size, tmp_path)
    n = 96 // world_size
    inputs = torch.stack([cases[0][2].double() for cases in results])
    exact, size = inputs.sum(0), inputs.abs().sum(0)
    for rank, ((normal, dense_normal, _, sent, scatter), (integer, dense_int, _, _, _)) in enumerate(results):
        assert normal.shape == (n, 16) and torch.equal(integer, dense_int)
        if world_size == 2:  # a + b either way: bit for bit
            assert torch.equal(normal.view(torch.int16), dense_normal.view(torch.int16))
        else:  # the order of the additions may differ from the all-reduce's: each within 2 bf16 roundings
            here = slice(rank * n, (rank + 1) * n)
            assert ((normal.double() - exact[here]).abs() <= 2 * 2**-8 * size[here]).all()
        assert 0 < sent < scatter
    assert not results[-1][0][0][90 - (world_size - 1) * n:].any()  # rows 90..95: touched by no rank


def run_bigram_steps(rank: int, world_size: int):
    """The tiny --bigram_embed Runner on world_size processes (each its slices of fixed random
    batches): 4 steps with Adam every step, then 2 with Adam on odd steps; also counts the sparse
    exchanges. On four blocks (FOUR_BLOCKS): the table's exchange does not depend on the depth."""
    calls = []
    real = tg.send_touched_rows
    tg.send_touched_rows = lambda exchange, table: calls.append(True) or real(exchange, table)
    states = []
    for odd_only, steps in ((False, 4), (True, 2)):
        config = tiny(bigram_embed=True, adam_odd_steps_only=odd_only, **FOUR_BLOCKS)
        runner = tg.Runner(config, torch.device("cpu"), rank, world_size)
        for step in range(steps):
            batches = random_batches(config, seed=step)
            runner.train_step(step, batches[rank * runner.micro_steps:(rank + 1) * runner.micro_steps])
        states.append(all_state(runner))
    return states, calls


def on_two_ranks(rank: int, world_size: int):
    """Both of this file's two-process jobs (exchange_cases, then run_bigram_steps) on one gloo group:
    each process's start, an import of torch, costs about as much as its job."""
    return exchange_cases(rank, world_size), run_bigram_steps(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's (exchange_cases, run_bigram_steps) of one 2-process gloo group, by rank."""
    return on_ranks(on_two_ranks, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.slow
def test_two_processes_with_the_sparse_exchange_train_as_one_process_with_two_micro_steps(two_ranks):
    """Adam every step: each step's table gradient is g0 + g1 either way, bit for bit (parameters and
    Adam's state, each rank's rows put together). Adam on odd steps: the held step-0 gradient is
    exchanged once, with step 1's (a second exchange would count it twice): the first moment equals
    up to the order of four additions."""
    results = [steps for _, steps in two_ranks]
    want, _ = run_bigram_steps(0, 1)
    for states, calls in results:
        assert calls == [True] * 5  # 4 steps with Adam every step, then the odd step
    got = [whole_adam_state([states[i] for states, _ in results], want[i]) for i in range(2)]
    for k, v in want[0].items():
        if k.startswith("opt1/"):  # Muon's state: each rank holds its own matrices' (tested elsewhere)
            continue
        assert torch.equal(torch.as_tensor(got[0][k]), torch.as_tensor(v)), k
    m1, m = got[1]["opt0/bigram.table/exp_avg"], want[1]["opt0/bigram.table/exp_avg"]
    assert m.any() and torch.allclose(m1, m, rtol=0, atol=1e-5 * m.abs().max().item())


def test_the_log_ends_with_every_layers_gamma():
    model = tg.build_model(tiny(bigram_embed=True))
    with torch.no_grad():
        model.bigram.lambdas[3] = -0.125
    assert tg.learned_scalars_lines(model)[-1] == "lambdas bigram: " + " ".join(["0.0500"] * 3 + ["-0.1250"]
                                                                                + ["0.0500"] * 12)
    assert not any("bigram" in line for line in tg.learned_scalars_lines(tg.build_model(tiny())))


def test_the_sparse_exchange_is_used_only_where_it_surely_moves_less():
    """The positions a rank reads per Adam step (a bound on the rows it touches) < the table's rows,
    and the rows shard W ways: the tiny preset on 2 processes (1,024 < 2,560) goes sparse; the record
    on 8 GPUs (2 x 65,536 < 251,520, as #261's) too, on 2 (2 x 4 x 65,536) it reduce-scatters."""
    tiny_config = tiny(bigram_embed=True)
    record = tg.make_config(recipe="bigram")
    assert tg.bigram_exchange_is_sparse(tiny_config, 2)
    assert not tg.bigram_exchange_is_sparse(tiny_config, 1)
    assert not tg.bigram_exchange_is_sparse(tiny(), 2)  # no table
    assert tg.bigram_exchange_is_sparse(record, 8) and not tg.bigram_exchange_is_sparse(record, 2)
    assert not tg.bigram_exchange_is_sparse(tiny(bigram_embed=True), 3)  # 2,560 rows do not split 3 ways
