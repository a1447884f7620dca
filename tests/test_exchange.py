"""The exchange (docs/exchange.md): which rank receives which gradient sum, what it holds of Adam,
Muon's round-robin sharding over 4 processes (exact, bit for bit), what the collectives move (counted
from the code path by the dry run and the bench), the compiled fp32 Adam update, and Adam's sharded
state resharded on load."""
import pytest
import torch

import train_gpt_medium as tg
from reference import summation_error_bound
from test_distributed import on_ranks


def meta(*shape):
    return torch.empty(*shape, device="meta")


# ---- who holds which rows of Adam


def test_adam_shards_tensors_of_1024_elements_whose_rows_split_w_ways():
    assert tg.adam_rows(meta(512, 64), 3, 8) == (192, 256)
    assert tg.adam_rows(meta(512, 64), 0, 1) is None  # one rank holds everything
    assert tg.adam_rows(meta(2, 64, 1024), 0, 8) is None  # 2 rows do not split 8 ways: all-reduced (#261's MUDD nets)
    assert tg.adam_rows(meta(1023), 0, 1) is None and tg.adam_rows(meta(1016), 0, 8) is None  # small: whole
    assert tg.adam_rows(meta(1024), 1, 8) == (128, 256)


def test_each_rank_holds_its_rows_of_the_sharded_moments_and_the_small_ones_whole():
    config = tg.make_config("tiny")
    with torch.device("meta"):
        model = tg.GPT(config, torch.float32)
        adam, _ = tg.build_optimizers(model, config, 1, 2, collectives=tg.CountedCollectives(2, 1, counting=True))
    for p, state in adam.state.items():
        rows = tg.adam_rows(p, 1, 2)
        want = p.shape if rows is None else (p.shape[0] // 2, *p.shape[1:])
        assert state["exp_avg"].shape == want and state["exp_avg_sq"].shape == want
    assert any(tg.adam_rows(p, 1, 2) for p in adam.state) and any(not tg.adam_rows(p, 1, 2) for p in adam.state)
    whole = tg.adam_bytes_per_rank(model, config, 1)
    assert tg.adam_bytes_per_rank(model, config, 2) == sum(
        tg.optimizer_state_bytes(n, p, config) // (2 if tg.adam_rows(p, 0, 2) else 1)
        for n, ps in tg.parameter_groups(model).items() if not n.startswith("muon") for p in ps) < whole


# ---- the sums each rank receives and Muon sharded over them (one group of 4 gloo processes)

MATRIX, ROWS, SMALL = (3, 16, 8), (64, 32), (7,)


def exchanged(rank: int, world_size: int):
    """On each rank, random gradients for 3 Muon matrices of one shape group (a padded bucket on 4
    ranks), one sharded Adam tensor and one small one, handed over by the hooks of a real backward;
    returns this rank's gradients and what the exchange left."""
    gen = torch.Generator().manual_seed(rank)
    matrices = [torch.nn.Parameter(torch.zeros(MATRIX[1:])) for _ in range(MATRIX[0])]
    table, small = torch.nn.Parameter(torch.zeros(ROWS)), torch.nn.Parameter(torch.zeros(SMALL))
    grads = [torch.randn(p.shape, generator=gen) for p in (*matrices, table, small)]
    collectives = tg.CountedCollectives(world_size, rank)
    exchange = tg.GradientExchange([dict(params=[table, small], name="adam")], [dict(params=matrices, name="muon")],
                                   rank, world_size, collectives)
    collectives.ledger, exchange.armed = [], True
    loss = sum((p * g).sum() for p, g in zip((*matrices, table, small), grads))
    loss.backward()
    exchange.wait()
    kinds = sorted((c.kind, c.group) for c in collectives.ledger)
    return (grads, [None if p.grad is None else p.grad.clone() for p in matrices], exchange.reduced[table].clone(),
            exchange.reduced[small].clone(), kinds)


# Muon's round-robin sharding: groups of 1, 3 and 6 matrices (one shape each): with 4 processes, two
# groups have fewer matrices than processes and none is a multiple of 4, so every padding path of
# the all-gather runs.
MUON_SHAPES = [(16, 32)] + [(24, 8)] * 3 + [(8, 8)] * 6


def run_muon(rank: int = 0, world_size: int = 1):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16)) for s in MUON_SHAPES]
    opt = tg.Muon([dict(params=params)], lr=0.02, momentum=0.9, weight_decay=0.01, rank=rank, world_size=world_size)
    for step in range(3):
        grads = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads).to(torch.bfloat16)
        opt.step()
    index = {p: i for i, p in enumerate(params)}
    return [p.detach().clone() for p in params], {index[p]: s for p, s in opt.state.items()}


def on_four_ranks(rank: int, world_size: int):
    """Both of this file's jobs for a gloo group (exchanged, then run_muon): one group of processes
    serves both tests (each process's start, an import of torch, costs more than its job)."""
    return exchanged(rank, world_size), run_muon(rank, world_size)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Each rank's (exchanged, run_muon) of one 4-process gloo group, by rank."""
    return on_ranks(on_four_ranks, 4, tmp_path_factory.mktemp("four_ranks"))


@pytest.mark.slow
def test_four_ranks_receive_the_sums_they_step_with_to_the_rounding_of_a_sums_order(four_ranks):
    """The owner of Muon matrix i (rank i: the bucket of 4 holds 3 and a zero pad) alone holds its sum;
    each rank holds the sum of its 16 rows of the sharded tensor and all of the small one: each the
    float64 sum within what an fp32 sum of 4 terms may round by in any order (gloo's ring adds them
    in its own order)."""
    W = 4
    results = [exchange for exchange, _ in four_ranks]
    per_tensor = [torch.stack([r[0][i].double() for r in results]) for i in range(MATRIX[0] + 2)]  # (W, ...)

    def close(got, terms):
        error = (got.double() - terms.sum(0)).abs()
        return (error <= summation_error_bound(terms.abs().sum(0), torch.tensor(W))).all()
    for rank, (_, matrices, rows, small, kinds) in enumerate(results):
        for i, g in enumerate(matrices):
            assert (g is not None) == (i == rank), (rank, i)  # the owner only; the others' are freed
            if g is not None:
                assert close(g, per_tensor[i])
        assert rows.shape == (16, 32) and close(rows, per_tensor[3][:, 16 * rank:16 * (rank + 1)])
        assert close(small, per_tensor[4])
        assert kinds == [("all_reduce", "adam"), ("reduce_scatter", "adam"), ("reduce_scatter", "muon")]


@pytest.mark.slow
def test_muon_sharded_over_four_processes_equals_one_process_bit_for_bit(four_ranks):
    results = [muon for _, muon in four_ranks]
    want_params, want_state = run_muon()
    owners: dict[int, list[int]] = {}
    for rank, (params, state) in enumerate(results):
        for i, (got, want) in enumerate(zip(params, want_params)):
            assert torch.equal(got, want), f"rank {rank}, matrix {i}"
        for i, s in state.items():
            owners.setdefault(i, []).append(rank)
            assert s.keys() == want_state[i].keys() == {"momentum_buffer", "low_bits", "row_mean_square"}
            for k in s:
                assert torch.equal(s[k], want_state[i][k]), f"rank {rank}, matrix {i}, {k}"
    # every matrix has exactly one owner, dealt round-robin within its shape group
    assert owners == {0: [0], 1: [0], 2: [1], 3: [2], 4: [0], 5: [1], 6: [2], 7: [3], 8: [0], 9: [1]}
    initial = (torch.randn(MUON_SHAPES[0], generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
    assert not torch.equal(want_params[0], initial)  # the steps did update the matrices


# ---- what the collectives move, counted from the code path


def test_the_records_even_step_sends_twice_seven_eighths_of_its_padded_muon_gradients():
    """Bulk at 8 ranks, an even step (Adam holds): Muon's gradients reduce-scattered and its weights
    all-gathered, each (W-1)/W of the stacked buckets (the shape groups padded to multiples of 8), in
    fp32: 1,344 MiB per rank, as the record's reduce-scatter and all-gather of its banks."""
    config = tg.make_config()
    with torch.device("meta"):
        model = tg.GPT(config, torch.bfloat16)
        _, muon = tg.build_optimizers(model, config, 0, 8, collectives=tg.CountedCollectives(8, 0, counting=True))
    padded = sum(-(-len(g["params"]) // 8) * 8 * g["params"][0].numel() * g["params"][0].element_size()
                 for g in muon.param_groups)
    ledger = tg.step_collectives(config, 8, odd=False)
    assert sum(c.sent for c in ledger) == 2 * 7 * padded // 8
    assert {c.kind for c in ledger} == {"reduce_scatter", "all_gather"}
    assert round(sum(c.sent for c in ledger) / 2**20) == 1344


def test_the_odd_step_adds_adams_reduce_scatters_gathers_and_small_all_reduces():
    config = tg.make_config()
    even, odd = (tg.ledger_summary(tg.step_collectives(config, 8, odd=o)) for o in (False, True))
    assert odd["sent_bytes"] > even["sent_bytes"]
    assert odd["groups"]["head"]["kinds"] == {"reduce_scatter": 1, "all_gather": 1}
    assert set(odd["groups"]["scalar"]["kinds"]) == {"all_reduce"}
    assert round(odd["sent_bytes"] / 2**20) == 2720  # the record's 2,720 MiB


def test_the_dry_run_prints_the_collectives_of_an_even_and_an_odd_step(capsys):
    assert tg.main(["--dry_run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("collectives")]
    assert len(lines) == 2 and "even step (Adam holds its gradients): 20 calls" in lines[0]
    assert "sent 1,344.0 MiB per rank" in lines[0] and "odd step (Adam steps)" in lines[1]
    assert tg.main(["--dry_run", "--gpu_count=1"]) == 0
    assert "collectives: none on one process (--gpu_count=1)" in capsys.readouterr().out


def test_the_bigram_rows_go_sparse_on_the_records_eight_ranks():
    ledger = tg.step_collectives(tg.make_config(recipe="bigram"), 8, odd=True)
    table = [c for c in ledger if c.group == "bigram"]
    assert [c.kind for c in table] == ["all_to_all"] * 3 + ["all_gather"]
    rows = 251_520 * 1024 * 2
    assert table[-1].sent == 7 * rows // 8  # the updated rows gathered
    assert 0 < table[2].sent < 7 * rows // 8  # the touched rows sent: fewer than a reduce-scatter's


# ---- the compiled fp32 Adam update


def test_the_compiled_fp32_update_keeps_one_graph_over_steps_with_new_factors():
    """#252 compiles its step; here fp32_adam_update (its factors 0-d tensors refilled in place, so a
    new lr or step count does not recompile). With the CPU compiler: the moments are the eager ones
    exactly; the weight may differ where a multiply-add is fused (one rounding fewer): within two fp32
    roundings of |w| + |update| (derived, not measured)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    w0, g = torch.randn(64, 48, generator=gen), torch.randn(64, 48, generator=gen)
    runs = []
    for update in (tg.fp32_adam_update, torch.compile(tg.fp32_adam_update, fullgraph=True, dynamic=False)):
        w, state, factors = w0.clone(), dict(step=0, exp_avg=torch.zeros(64, 48), exp_avg_sq=torch.zeros(64, 48)), \
            torch.zeros(2)
        for i in range(4):
            before = w.clone()
            tg.fp32_adam_step(w, g * (i + 1), state, 0.01 * (i + 1), 0.8, 0.95, 1e-8, 0.005, 1.0, factors=factors,
                              update=update)
        runs.append((w, state["exp_avg"], state["exp_avg_sq"], (w - before).abs()))
    (eager, m, v, step), (compiled, m_c, v_c, _) = runs
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(m, m_c) and torch.equal(v, v_c)
    assert ((compiled - eager).abs() <= 2 * 2**-24 * (eager.abs() + step) * 2).all()
    assert not torch.equal(eager, w0)


# ---- resharded on load


def test_a_checkpoints_adam_rows_are_resharded_for_any_world_size(tmp_path):
    """Saved by 4 ranks (rows of 8 each, in their files), read as 2 ranks' rows of 16, one rank's
    whole tensor, and from a whole (format 1) state cut to rows."""
    full = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)
    pieces = []
    for r in range(4):
        name = f"rank_{r:03d}.pt"
        torch.save(dict(adam={"t": dict(rows=(8 * r, 8 * r + 8), state=dict(step=5, exp_avg=full[8 * r:8 * r + 8],
                                                                                exp_avg_sq=-full[8 * r:8 * r + 8]))}),
                   tmp_path / name)
        pieces.append([name, 8 * r, 8 * r + 8])
    meta_ = dict(adam_shards={"t": pieces})
    for rows in ((0, 16), (16, 32), None):
        got = tg.adam_state_from_checkpoint(tmp_path, meta_, {}, {"t": rows})["t"]
        a, b = rows or (0, 32)
        assert got["step"] == 5 and torch.equal(got["exp_avg"], full[a:b]) and torch.equal(got["exp_avg_sq"], -full[a:b])
    whole = {"t": dict(step=5, exp_avg=full, exp_avg_sq=-full)}
    assert torch.equal(tg.adam_state_from_checkpoint(tmp_path, {}, whole, {"t": (8, 16)})["t"]["exp_avg"], full[8:16])
    with pytest.raises(tg.CheckpointError, match="no Adam state recorded for u"):
        tg.adam_state_from_checkpoint(tmp_path, meta_, {}, {"u": None})
