"""--muon_qk_group_heads (PR #253, docs/short-track-transfer.md section 2): Muon's step of the
attention bank against a reference that slices Q and K into row blocks by hand; N = num_heads
against today's step; the statistic's shapes and their accounting; a tiny run that learns and
resumes bit for bit. The tiny preset has 2 heads (one pair is the whole matrix), so these use 4
heads of 16."""
import math
import re

import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS
from test_checkpoint import log_text, run_argv
from test_distributed import assert_bit_identical, checkpoint_tensors

FOUR_HEADS = dict(num_heads=4, head_dim=16)


def tiny(**overrides):
    return tg.make_config("tiny", **{"dtype": "float32", **FOUR_HEADS, **overrides})


def muon_of(config):
    model = tg.build_model(config)
    muon = tg.build_optimizers(model, config, 0, 1)[1]
    return model, muon


def random_grads(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def attn_group(muon):
    return next(g for g in muon.param_groups if g["name"] == "muon_attn")


def hand_cut_blocks(g, rows):
    """Q's row blocks of `rows` rows, then K's, then V and O whole: [(matrix, row slice)]."""
    qk = [(m, slice(start, start + rows)) for m in (0, 1) for start in range(0, g.shape[1], rows)]
    return qk, [(m, slice(None)) for m in (2, 3)]


def reference_step(weight, grad, heads_per_block, head_dim, scalars, beta2, batched=True):
    """One first Muon step of a (4, attn_dim, d) fp32 bank from zero state, sliced by hand: Q and K
    each cut into row blocks of heads_per_block heads, each block orthogonalized (Polar Express) and
    row-normalized with one statistic per column (per row for a square block); V and O whole with one
    per row; the cautious step with the group's factors. batched: the blocks of one shape go through
    Polar Express as one stack (as Muon batches a bank's blocks); else one 2-d call per block (CPU
    batched and 2-d products can round differently)."""
    buf = torch.zeros_like(grad)
    g = tg.nesterov_momentum(grad, buf, scalars["momentum"], scalars["one_minus_momentum"])
    update = torch.empty(g.shape, dtype=torch.bfloat16)
    stats = []
    for blocks in hand_cut_blocks(g, heads_per_block * head_dim):
        stack = torch.stack([g[m, rows] for m, rows in blocks])
        ortho = tg.polar_express(stack) if batched else torch.stack([tg.polar_express(b) for b in stack])
        for (m, rows), u in zip(blocks, ortho):
            reduce = -1 if u.shape[0] >= u.shape[1] else -2
            stat = torch.zeros([1 if reduce == -2 else u.shape[0], 1 if reduce == -1 else u.shape[1]])
            update[m, rows] = tg.normuon_row_normalize(u.clone(), stat, beta2, reduce)
            stats.append(stat)
    want = weight.clone()
    tg.cautious_step(want, update, scalars["wd_factor"], scalars["lr_factor"])
    return want, stats


@pytest.mark.parametrize("heads", [1, 2])
def test_one_muon_step_equals_q_and_k_sliced_by_hand(heads):
    """On four blocks (FOUR_BLOCKS: each block's bank is stepped on its own, so the depth plays no part)."""
    config = tiny(muon_qk_group_heads=heads, muon_lr_shape="blocks", **FOUR_BLOCKS)
    model, muon = muon_of(config)
    random_grads(model)
    group = attn_group(muon)
    assert group["qk_rows"] == heads * 16
    banks = [(p.detach().clone(), p.grad.clone()) for p in group["params"]]
    muon.step()
    scalars = muon.scalars[muon.param_groups.index(group)]
    assert scalars["lr_factor"].item() == tg.kernels.fp32_product(1.0, group["lr"])  # the lr factor 1 per block
    for p, (weight, grad) in zip(group["params"], banks):
        want, stats = reference_step(weight, grad, heads, 16, scalars, config.muon_row_beta2)
        assert torch.equal(p.detach(), want)
        state = muon.state[p]
        qk = state["qk_row_mean_square"]  # the blocks in order: Q's, then K's
        assert torch.equal(qk, torch.stack(stats[:-2]))
        assert torch.equal(state["row_mean_square"], torch.stack(stats[-2:]))
        one_by_one, _ = reference_step(weight, grad, heads, 16, scalars, config.muon_row_beta2, batched=False)
        assert torch.allclose(p.detach(), one_by_one, rtol=0, atol=2 * group["lr"] * 2**-8)


@pytest.mark.parametrize("flags", [
    {},
    dict(fp32_block_weights=False, muon_lr_shape="blocks"),  # --recipe mudd's: bf16 banks with low bits
    dict(orthogonalization="newton_schulz", muon_row_normalization=False, muon_cautious_weight_decay=False),
])
def test_n_equal_to_num_heads_is_todays_step_exactly(flags):
    """On four blocks (FOUR_BLOCKS: a bit-for-bit equality of each block's own step)."""
    runs = []
    for heads in (0, 4):
        model, muon = muon_of(tiny(muon_qk_group_heads=heads, **FOUR_BLOCKS, **flags))
        for step in range(3):  # the statistic's history too
            random_grads(model, seed=step)
            muon.step()
        runs.append((model, muon))
    (plain, plain_muon), (grouped, grouped_muon) = runs
    for (name, p), q in zip(plain.named_parameters(), grouped.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(attn_group(plain_muon)["params"], attn_group(grouped_muon)["params"]):
        a, b = plain_muon.state[p], grouped_muon.state[q]
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
        if "low_bits" in a:
            assert torch.equal(a["low_bits"], b["low_bits"])
        if config_normalizes(flags):
            assert torch.equal(a["row_mean_square"], torch.cat([b["qk_row_mean_square"], b["row_mean_square"]]))
        else:
            assert "row_mean_square" not in b and "qk_row_mean_square" not in b


def config_normalizes(flags):
    return flags.get("muon_row_normalization", True)


@pytest.mark.parametrize("heads,qk_shape", [(1, (8, 1, 64)), (2, (4, 1, 64)), (4, (2, 64, 1))])
def test_the_statistics_shapes_and_their_accounting(heads, qk_shape):
    config = tiny(muon_qk_group_heads=heads)
    model, muon = muon_of(config)
    for p in attn_group(muon)["params"]:
        state = muon.state[p]
        assert state["qk_row_mean_square"].shape == qk_shape and state["row_mean_square"].shape == (2, 64, 1)
        held = sum(state[k].numel() * 4 for k in ("qk_row_mean_square", "row_mean_square"))
        parts = tg.optimizer_state_parts("muon_attn", p, config)
        assert parts["normuon row statistics float32"] == held
    # the other Muon matrices keep theirs
    mlp = next(g for g in muon.param_groups if g["name"] == "muon_mlp")
    assert all("qk_row_mean_square" not in muon.state[p] for p in mlp["params"])


def test_off_adds_no_option_and_no_state():
    model, muon = muon_of(tiny())
    group = attn_group(muon)
    assert "qk_rows" not in group
    assert all(set(muon.state[p]) == {"momentum_buffer", "row_mean_square"} for p in group["params"])


@pytest.mark.parametrize("flags,words", [
    (["--num_heads=4", "--head_dim=16", "--muon_qk_group_heads=3"], "--muon_qk_group_heads: 3 does not divide "
     "num_heads=4"),
])
def test_a_group_size_that_does_not_divide_the_heads_is_refused_in_one_line(flags, words, refusal_of):
    assert words in refusal_of(*flags)


# ---- a tiny run: it learns, and a resume continues it bit for bit

# on four blocks (FOUR_BLOCKS: every block's attention bank is stepped in groups as at sixteen; that the
# run learns and resumes bit for bit does not depend on the depth)
N = 8
FLAGS = (*FOUR_BLOCK_FLAGS, "--num_heads=4", "--head_dim=16", "--muon_qk_group_heads=2", "--save_every=4",
         "--seed=0")


@pytest.fixture(scope="module")
def uninterrupted(synthetic_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qk_groups")
    assert tg.main(run_argv(synthetic_dir, out, *FLAGS, N=N)) == 0
    return out


def test_a_tiny_run_learns(uninterrupted):
    losses = [float(m[1]) for m in re.finditer(rf"^step:\d+/{N} val_loss:(\S+)", log_text(uninterrupted), re.M)]
    assert len(losses) == N // 2 + 1 and losses[-1] < losses[0] - 0.1


def test_a_resume_continues_bit_for_bit_with_the_statistics(uninterrupted, synthetic_dir, tmp_path):
    saved = uninterrupted / "ck" / "tiny" / "step_000004"
    muon_state = checkpoint_tensors(saved)
    assert any(k.endswith("/qk_row_mean_square") for k in muon_state)  # it is saved
    assert tg.main(run_argv(synthetic_dir, tmp_path, *FLAGS, f"--resume={saved}", N=N)) == 0
    assert_bit_identical(checkpoint_tensors(tmp_path / f"ck/tiny/step_{N:06d}"),
                         checkpoint_tensors(uninterrupted / f"ck/tiny/step_{N:06d}"))
