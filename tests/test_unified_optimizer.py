"""#252's unified optimizer (docs/unified-optimizer.md) as switches of the live optimizers: the
per-parameter table at the record's size (meta device) against #252's table (its script's values) (update
kind, betas, base lr, wd_mul, NorMuon's peak lr and decay at m = 2), the defaults' table (the
bulk record, unchanged), each switch's per-parameter update against a plain loop written here,
and the bf16 block matrices with their fp32 masters kept as low bits (truncated forward weight,
exact master, zero low bits at the start and after the warm-up, kept across a checkpoint)."""
import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCKS
from test_bulk_optim import adam_loop, bf16, f32
from test_training import all_state, assert_same_state, runner_and_loader

# the fields that make the live optimizers #252's (scalar_lr: its scalars' base lr 0.004 x 5)
PR252 = dict(gates_optimizer="adam", small_params_betas="scalar", scalar_lr=0.004, adam_fp32_moments=True,
             muon_lr_shape="blocks", fp32_block_weights=False, muon_scalar_rounding="pr252")


def parameter_table(config) -> dict:
    """name -> (update, betas, base lr, wd_mul, moments dtype) from the optimizers built for the
    record-size model on the meta device. NorMuon's base lr includes its lr multiplier and shape
    factor; its "betas" are None (its momentum is the schedule's)."""
    model = tg.build_model(config, "meta")
    adam, muon = tg.build_optimizers(model, config, 0, 1)
    names = {p: n for n, p in model.named_parameters()}
    table = {}
    for g in adam.param_groups:
        for p in g["params"]:
            table[names[p]] = ("adam", getattr(p, "betas", g["betas"]), g["lr"] * p.lr_mul, p.wd_mul,
                               adam.state[p]["exp_avg"].dtype)
    for g in muon.param_groups:
        for p in g["params"]:
            lr = g["lr"] * g["lr_mul"] * tg.muon_shape_factor(p, g, muon.lr_shape)
            table[names[p]] = ("normuon", None, lr, g["wd_mul"], muon.state[p]["momentum_buffer"].dtype)
    assert len(table) == len(names)  # every parameter in exactly one optimizer
    return table


def row_of(name: str) -> str:
    """The row of #252's table (or the bulk equivalent) a parameter name belongs to."""
    for key, row in (("qkvo_w", "attn"), ("fc_w", "W_fc"), ("proj_w", "W_proj"), ("output_gate", "attn_gate"),
                     ("value_gate", "ve_gate"), ("smear_gate", "smear_gate"), ("skip_gates", "skip_gate"),
                     ("value_embeds", "value_embeds"), ("embeds.1", "embed2"), ("embeds.0", "embed"),
                     ("head", "lm_head"), ("x0_lambdas", "x0_lambdas"), ("scalars", "scalars"),
                     ("backout", "scalars")):  # the record keeps the backout weight in its scalar vector
        if key in name:
            return row
    raise AssertionError(name)


def rows(table: dict) -> dict:
    """One entry per row; every parameter of a row must agree."""
    out = {}
    for name, entry in table.items():
        row = row_of(name)
        assert out.setdefault(row, entry) == entry, (name, entry, out[row])
    return out


# #252's per-parameter table: update, betas, base lr (x m(s)), wd_mul; the bigram rows belong to the bigram items
F8_TABLE = dict(
    attn=("normuon", None, 0.015, 1.0), W_fc=("normuon", None, 0.03, 1.0), W_proj=("normuon", None, 0.06, 1.0),
    scalars=("adam", (0.9, 0.99), 0.02, 0.0), smear_gate=("adam", (0.9, 0.99), 4e-5, 0.0),
    skip_gate=("adam", (0.9, 0.99), 4e-5, 0.0), attn_gate=("adam", (0.9, 0.99), 4e-4, 1.0),
    ve_gate=("adam", (0.9, 0.99), 4e-4, 1.0), x0_lambdas=("adam", (0.9, 0.99), 0.02, 0.0),
    value_embeds=("adam", (0.8, 0.95), 0.3, 5.0), embed2=("adam", (0.8, 0.95), 0.3, 5.0),
    lm_head=("adam", (0.8, 0.95), 0.004, 150.0), embed=("adam", (0.8, 0.95), 0.004, 150.0))
# the bulk record (docs/bulk-optimizers.md): gates on NorMuon (lr 0.015 x 0.1), attention shape factor 2,
# small parameters' betas 0.8/0.95 (the scalars' 0.9/0.99), scalars' lr 0.008 x 5
BULK_TABLE = dict(
    F8_TABLE, attn=("normuon", None, 0.03, 1.0), scalars=("adam", (0.9, 0.99), 0.04, 0.0),
    smear_gate=("adam", (0.8, 0.95), 4e-5, 0.0), skip_gate=("adam", (0.8, 0.95), 4e-5, 0.0),
    attn_gate=("normuon", None, 0.0015, 1.0), ve_gate=("normuon", None, 0.0015, 1.0),
    x0_lambdas=("adam", (0.8, 0.95), 0.02, 0.0))


def assert_table(got: dict, want: dict):
    assert got.keys() == want.keys()
    for row, (kind, betas, lr, wd_mul) in want.items():
        assert got[row][:4] == (kind, betas, pytest.approx(lr, rel=1e-12), wd_mul), row


def test_the_per_parameter_table_at_the_records_size_is_frontiers_table_for_252():
    config = tg.make_config(**PR252)
    table = rows(parameter_table(config))
    assert_table({row: entry[:4] for row, entry in table.items()}, F8_TABLE)
    # F8.4: fp32 Adam moments for every weight; NorMuon's state fp32 (F9: bf16 matrices, fp32 momentum)
    assert {entry[4] for entry in table.values()} == {torch.float32}
    model = tg.build_model(config, "meta")
    assert {p.dtype for n, p in model.named_parameters() if row_of(n) in ("attn", "W_fc", "W_proj")} == {torch.bfloat16}
    # NorMuon at m = 2: peak lr and the cautious decay 1.2 * (2 * 0.015) * peak lr per step
    for row, peak, decay in (("attn", 0.03, 1.08e-3), ("W_fc", 0.06, 2.16e-3), ("W_proj", 0.12, 4.32e-3)):
        assert 2 * table[row][2] == pytest.approx(peak, rel=1e-12)
        assert config.muon_weight_decay * table[row][3] * (2 * config.muon_lr) * (2 * table[row][2]) == (
            pytest.approx(decay, rel=1e-12))
    # the momentum schedule is the record's (0.85 -> 0.95)
    assert (config.muon_momentum_start, config.muon_momentum) == (0.85, 0.95)


def test_the_defaults_are_the_bulk_records_table():
    config = tg.make_config()
    assert (config.gates_optimizer, config.small_params_betas, config.adam_fp32_moments, config.muon_lr_shape,
            config.fp32_block_weights) == ("muon", "adam", False, "stored", True)
    table = rows(parameter_table(config))
    assert_table({row: entry[:4] for row, entry in table.items()}, BULK_TABLE)
    moments = {row: entry[4] for row, entry in table.items() if entry[0] == "adam"}
    assert moments["scalars"] == moments["x0_lambdas"] == torch.float32  # the weights' own dtypes
    assert moments["lm_head"] == moments["smear_gate"] == torch.bfloat16


# ---- items 1 and 2: which Adam hyperparameters reach the gates and the x0 weights


def tiny(**overrides) -> tg.Hyperparameters:
    return tg.make_config("tiny", **{"dtype": "bfloat16", "warmup_steps": 0, **overrides})


GATES_ON_ADAM = dict(gates_optimizer="adam")
SMALL_BETAS = dict(small_params_betas="scalar")


@pytest.mark.parametrize("switches, param, lr, betas, wd_mul", [
    (GATES_ON_ADAM, lambda m: m.blocks[0].attn.output_gate.weight, 0.004 * 0.1, (0.8, 0.95), 1.0),
    (dict(GATES_ON_ADAM, **SMALL_BETAS), lambda m: m.blocks[0].attn.output_gate.weight, 0.004 * 0.1, (0.9, 0.99), 1.0),
    (dict(GATES_ON_ADAM, **SMALL_BETAS), lambda m: m.blocks[1].attn.value_gate.weight, 0.004 * 0.1, (0.9, 0.99), 1.0),
    (SMALL_BETAS, lambda m: m.smear_gate.weight, 0.004 * 0.01, (0.9, 0.99), 0.0),
    (SMALL_BETAS, lambda m: m.skip_gates[2].weight, 0.004 * 0.01, (0.9, 0.99), 0.0),
    (SMALL_BETAS, lambda m: m.x0_lambdas, 0.004 * 5, (0.9, 0.99), 0.0),
    (dict(scalar_lr=0.004), lambda m: m.scalars, 0.004 * 5, (0.9, 0.99), 0.0),
], ids=["attn_gate", "attn_gate_betas", "ve_gate_betas", "smear_gate", "skip_gate", "x0_lambdas", "scalars"])
def test_each_switch_gives_the_parameter_252s_adam_step(switches, param, lr, betas, wd_mul):
    """Two Adam steps of the one parameter (the others have no gradient) against the plain loop of
    the record's Adam with the hyperparameters of #252's table."""
    config = tiny(**switches)
    model = tg.build_model(config)
    adam, muon = tg.build_optimizers(model, config, 0, 1)
    p = param(model)
    assert not any(p is q for g in muon.param_groups for q in g["params"])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # nonzero weights of both signs, so that the cautious decay acts where it may
        p.copy_(torch.randn(p.shape, generator=gen))
    grads = [(torch.randn(p.shape, generator=gen) * 20).to(p.dtype) for _ in range(2)]
    want, _, _ = adam_loop(p.detach().clone(), grads, lr=lr, betas=betas, eps=1e-8, wd=0.005, wd_mul=wd_mul)
    for g in grads:
        p.grad = g
        adam.step()
    assert torch.equal(p.detach().double(), want)


def test_gates_on_adam_leave_muon_without_gates_and_count_in_the_adam_group():
    config = tg.make_config(gates_optimizer="adam")
    groups = tg.parameter_groups(tg.build_model(config, "meta"))
    assert "muon_gates" not in groups
    assert sum(p.numel() for p in groups["gates"]) == 16 + 3 * 16 + (16 + 10) * 8 * 16


# ---- item 3: fp32 moments, the step in fp32, one rounding of the weight


def fp32_adam_loop(p: torch.Tensor, grads, lr: float, betas, eps: float, wd: float, wd_mul: float):
    """#252's compiled Adam step element by element: fp32 moments, every operation rounded to fp32
    (scalars fp32: 1 - beta, eps; step size and decay rounded once from float64, the decay as
    lr*lr*wd*wd_mul), the weight rounded once to its dtype at the end. Square roots are torch's
    fp32 ones of the whole vector (as in adam_loop)."""
    b1, b2 = betas
    r = bf16 if p.dtype == torch.bfloat16 else f32
    weights, m, v = p.double().flatten().tolist(), [0.0] * p.numel(), [0.0] * p.numel()
    for t, grad in enumerate(grads, start=1):
        step_size = f32(lr * ((1 - b2 ** t) ** 0.5 / (1 - b1 ** t)))
        decay = f32(lr * lr * wd * wd_mul)
        for j, g in enumerate(grad.double().flatten().tolist()):
            m[j] = f32(f32(m[j] * f32(b1)) + f32(g * f32(1 - b1)))
            v[j] = f32(f32(v[j] * f32(b2)) + f32(f32(g * g) * f32(1 - b2)))
        roots = torch.tensor(v, dtype=torch.float32).sqrt().tolist()
        for j in range(len(v)):
            u = f32(f32(m[j] / f32(roots[j] + f32(eps))) * step_size)
            if f32(u * weights[j]) > 0:
                u = f32(u + f32(weights[j] * decay))
            weights[j] = r(f32(weights[j] - u))
    return torch.tensor(weights, dtype=torch.float64).reshape(p.shape), m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_moments_step_is_252s_fp32_step(dtype):
    """Three steps with lr_mul 75 and wd_mul 5 (the value embeddings), through build_optimizers'
    Adam: tiny gradients (eps decides), zero weights (the strict mask), token-sum-sized ones. A
    64-word vocabulary (a 128 x 64 table, a quarter of the preset's) keeps the element-by-element
    loop short; the step is elementwise, so the table's size plays no part."""
    config = tiny(adam_fp32_moments=True, dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                  vocab_size=64, eot_token=63)
    model = tg.build_model(config)
    adam, _ = tg.build_optimizers(model, config, 0, 1)
    p = model.value_embeds.tables[0].weight
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        p[0, :5] = 0
    p0 = p.detach().clone()
    grads = []
    for _ in range(3):
        g = torch.randn(p.shape, generator=gen) * 30
        g[1] *= 1e-9
        grads.append(g.to(dtype))
    want, m, v = fp32_adam_loop(p0, grads, lr=0.004 * 75, betas=(0.8, 0.95), eps=1e-8, wd=0.005, wd_mul=5.0)
    for g in grads:
        p.grad = g
        adam.step()
    assert p.dtype == dtype and torch.equal(p.detach().double(), want)
    state = adam.state[p]
    assert state["step"] == 3 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert state["exp_avg"].double().flatten().tolist() == m and state["exp_avg_sq"].double().flatten().tolist() == v
    if dtype == torch.bfloat16:  # the bulk step (bf16 moments, each operation rounded to bf16) is another
        bulk, _, _ = adam_loop(p0, grads, lr=0.004 * 75, betas=(0.8, 0.95), eps=1e-8, wd=0.005, wd_mul=5.0)
        assert not torch.equal(bulk, want)


def test_fp32_moments_are_counted_as_held_and_survive_the_warmup_restore():
    """On four blocks (FOUR_BLOCKS: the restore and the accounting do not depend on the depth)."""
    config = tiny(**PR252, **FOUR_BLOCKS, warmup_steps=1)
    runner = tg.Runner(config, torch.device("cpu"))
    fresh = all_state(tg.Runner(config, torch.device("cpu")))
    runner.warmup()
    assert_same_state(all_state(runner), fresh)  # low bits, momenta, moments: zero again, their dtypes kept
    adam = runner.optimizers[0]
    for group in adam.param_groups:
        for p in group["params"]:
            assert adam.state[p]["exp_avg"].dtype == torch.float32
            assert tg.optimizer_state_parts(group["name"], p, config) == {"adam moments float32": 8 * p.numel()}


# ---- item 4: NorMuon's lr factor of the attention weight


def test_blocks_shape_gives_the_attention_weight_factor_1_and_the_mlp_2():
    """The factor Muon fills in (lr_factor = f32(f32(factor * lr_mul) * f32(lr))), tiny model with
    attention 64 x 64 blocks and 256 x 64 MLP matrices: attention 2 -> 1, the MLP as before."""
    factors = {}
    for shape in ("stored", "blocks"):
        config = tiny(muon_lr_shape=shape)
        model = tg.build_model(config)
        _, muon = tg.build_optimizers(model, config, 0, 1)
        for group, scalars in zip(muon.param_groups, muon.scalars):
            group["lr"], group["momentum"] = 0.03, 0.95
            muon._fill_scalars(group, scalars)
            factors[shape, group["name"], group["lr_mul"]] = scalars["lr_factor"].item()
    assert factors["stored", "muon_attn", 1.0] == f32(f32(2.0) * f32(0.03))
    assert factors["blocks", "muon_attn", 1.0] == f32(0.03)
    for mlp in ((2.0, 1.0), (2.0 * 2.0, 2.0)):  # W_fc, W_proj (stored transposed: lr_mul 2)
        want = f32(f32(mlp[0]) * f32(0.03))
        assert factors["stored", "muon_mlp", mlp[1]] == factors["blocks", "muon_mlp", mlp[1]] == want


def test_pr252_scalar_rounding_rounds_each_factor_once_and_forms_one_minus_momentum_in_fp32():
    """#252 fills fp32(wd_mul * wd * lr) and fp32(lr_mul * lr) from float64 products and computes
    1 - m from the fp32 momentum inside its compiled step; the record's fp32 products and
    fp32(1 - m) differ from those in the last bit at most of the schedule's lrs and momenta."""
    config = tiny(muon_scalar_rounding="pr252", muon_lr_shape="blocks")
    _, muon = tg.build_optimizers(tg.build_model(config), config, 0, 1)
    _, bulk = tg.build_optimizers(tg.build_model(tiny(muon_lr_shape="blocks")), tiny(muon_lr_shape="blocks"), 0, 1)
    (group,) = [g for g in muon.param_groups if g["name"] == "muon_attn"]
    (bulk_group,) = [g for g in bulk.param_groups if g["name"] == "muon_attn"]
    scalars, bulk_scalars = muon.scalars[muon.param_groups.index(group)], bulk.scalars[bulk.param_groups.index(bulk_group)]
    differs = set()
    for mult, m in ((1.0, 0.85), (1.52, 0.87), (1.92533, 0.95), (0.74005, 0.95), (0.1, 0.852)):
        for g, s, opt in ((group, scalars, muon), (bulk_group, bulk_scalars, bulk)):
            g["lr"], g["momentum"] = 0.015 * mult, m
            opt._fill_scalars(g, s)
        lr = 0.015 * mult
        assert scalars["one_minus_momentum"].item() == f32(1.0 - f32(m))  # exact: Sterbenz
        assert scalars["wd_factor"].item() == f32(1.0 * 1.2 * lr)
        assert scalars["lr_factor"].item() == f32(1.0 * 1.0 * lr)
        assert scalars["momentum"].item() == bulk_scalars["momentum"].item() == f32(m)
        differs |= {k for k in ("one_minus_momentum", "wd_factor") if scalars[k].item() != bulk_scalars[k].item()}
    assert differs == {"one_minus_momentum", "wd_factor"}


# ---- item 5 (F9): bf16 block matrices, fp32 masters in two halves


def block_matrices(runner) -> list:
    muon = runner.optimizers[1]
    return [(p, muon.state[p]) for g in muon.param_groups if not g.get("gate") for p in g["params"]]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_the_muon_step_of_a_bf16_matrix_is_the_step_of_its_exact_fp32_master():
    """One NorMuon step (the record's settings) of a bf16 matrix with low bits equals the step of
    an fp32 matrix holding the same master, bit for bit; the bf16 weight is the master truncated."""
    gen = torch.Generator().manual_seed(4)
    master = torch.randn(32, 16, generator=gen) * 0.1
    grads = [torch.randn(32, 16, generator=gen).to(torch.bfloat16) for _ in range(3)]
    p16 = torch.nn.Parameter(torch.empty(32, 16, dtype=torch.bfloat16))
    p32 = torch.nn.Parameter(master.clone())
    opts = [tg.Muon([dict(params=[p])], lr=0.03, momentum=0.9, weight_decay=1.2) for p in (p16, p32)]
    tg.store_halves(master.clone(), p16.data, opts[0].state[p16]["low_bits"])
    for g in grads:
        for p, opt in zip((p16, p32), opts):
            p.grad = g.to(p.dtype)
            opt.step()
        low = opts[0].state[p16]["low_bits"]
        assert torch.equal(as_bits(tg.fp32_from_halves(p16.data, low)), as_bits(p32.data))
        assert torch.equal(p16.data.view(torch.int16), (as_bits(p32.data) >> 16).to(torch.int16))


def assert_truncated_masters(runner):
    """Each bf16 block matrix is its master truncated toward zero (not rounded to nearest: about
    half the entries differ by one bf16 step)."""
    differs = total = 0
    for p, state in block_matrices(runner):
        assert p.dtype == torch.bfloat16
        master = tg.fp32_from_halves(p.data, state["low_bits"])
        truncated = (as_bits(master) & ~0xFFFF).view(torch.float32)
        assert torch.equal(p.data.float(), truncated)
        differs += (master.to(torch.bfloat16) != p.data).sum().item()
        total += p.numel()
    return differs / total


def test_bf16_blocks_start_exact_are_truncated_masters_in_training_and_across_a_checkpoint(synthetic_dir, tmp_path):
    """#252's switches on the tiny model: low bits zero at the start (the master is the bf16
    init), the gradients of the block matrices bf16 (what the averager reduces), after steps the
    forward's weights are the truncated masters (about half differ from rounding), and a
    checkpoint keeps them: the resumed run's next steps are the same. On four blocks (FOUR_BLOCKS:
    none of this depends on the depth)."""
    config = tg.make_config("tiny", **PR252, **FOUR_BLOCKS, dtype="bfloat16", train_seq_len=128, batch_schedule=(),
                            warmup_steps=0, checkpoint_dir=str(tmp_path / "ck"),
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    runner, loader = runner_and_loader(config)
    assert all(not state["low_bits"].any() for _, state in block_matrices(runner))
    for step in range(4):
        runner.train_step(step, loader.next_batch())
    assert 0.3 < assert_truncated_masters(runner) < 0.7
    path = tg.save_checkpoint(runner, loader, 4, 1.0)
    resumed, resumed_loader = runner_and_loader(config)
    tg.load_checkpoint(resumed, resumed_loader, path, tg.validate_checkpoint(path))
    assert_same_state(all_state(resumed), all_state(runner))
    assert_truncated_masters(resumed)
    for step in (4, 5):
        assert torch.equal(runner.train_step(step, loader.next_batch()),
                           resumed.train_step(step, resumed_loader.next_batch()))
    assert_same_state(all_state(resumed), all_state(runner))


def test_block_gradients_are_bf16_when_the_blocks_are():
    """F8.6: the gradient the averager all-reduces is the parameter's own, so bf16 blocks are
    averaged in bf16 (the fp32 blocks of the default in fp32). On four blocks (FOUR_BLOCKS)."""
    for fp32_blocks, want in ((False, torch.bfloat16), (True, torch.float32)):
        config = tiny(fp32_block_weights=fp32_blocks, **FOUR_BLOCKS)
        runner = tg.Runner(config, torch.device("cpu"))
        inputs, targets = runner.random_batches(torch.Generator().manual_seed(0), 128)[0]
        runner.model(inputs, targets, runner.window(0)).backward()
        assert {p.grad.dtype for p, _ in block_matrices(runner)} == {want}
