"""--mlp_backward_from_post (PR #322, docs/short-track-transfer.md section 6): MLPFromPost against the
plain MLP (autograd through relu and the square): the forward bit for bit, the backward bit for bit
on inputs whose pre squares exactly and on random ones (correctly rounded sqrt(fl(r^2)) = r), in
bf16 and fp32, both output-weight layouts and fp32 block weights; what it keeps for backward; its
float64 gradcheck; one traced graph; a tiny training run equal to the plain one."""
import pytest
import torch
import torch.nn.functional as F
from test_bulk_model import FOUR_BLOCKS

import train_gpt_medium as tg


def mlps(dtype=torch.bfloat16, transposed=True, weights=None, dyadic=False, seed=0):
    """(plain MLP, the same weights with --mlp_backward_from_post) of the tiny preset (64 -> 256 -> 64).
    dyadic: W1 with 16 entries +-1/8 per row, so with x in {-1/4, 0, 1/4} pre is k/32 with |k| <= 16,
    whose square bf16 holds exactly; else normal weights."""
    made = []
    for from_post in (False, True):
        config = tg.make_config("tiny", mlp_proj_transposed=transposed, mlp_backward_from_post=from_post,
                                fp32_block_weights=weights == torch.float32)
        mlp = tg.MLP(config, weights or dtype)
        assert mlp.fc_w.dtype == (weights or dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            if dyadic:  # 16 entries of +-1/8 per row, the rest 0: |pre| <= 16/32, its square 8 bits at most
                keep = torch.rand(mlp.fc_w.shape, generator=gen).argsort(dim=1) < 16
                w1 = torch.where(keep, torch.randint(0, 2, mlp.fc_w.shape, generator=gen) * 2 - 1, 0) / 8
            else:
                w1 = torch.randn(mlp.fc_w.shape, generator=gen) * 0.125
            mlp.fc_w.copy_(w1)
            mlp.proj_w.copy_(torch.randn(mlp.proj_w.shape, generator=gen) * 0.1)
        made.append(mlp)
    assert not made[0].from_post and made[1].from_post
    return made


def inputs(dtype, dyadic=False, seed=1, shape=(2, 24, 64)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, shape, generator=gen) / 4 if dyadic else torch.randn(shape, generator=gen)
    return x.to(dtype), torch.randn(shape, generator=gen).to(dtype)


def run(mlp, x, grad):
    """The MLP's output and the gradients of x, W1 and W2 for upstream gradient `grad`."""
    mlp.zero_grad()
    x = x.clone().requires_grad_()
    out = mlp(x)
    out.backward(grad)
    return out.detach(), x.grad, mlp.fc_w.grad.clone(), mlp.proj_w.grad.clone()


CASES = [(torch.bfloat16, True, None), (torch.bfloat16, False, None), (torch.float32, True, None),
         (torch.float32, False, None), (torch.bfloat16, True, torch.float32)]  # the last: --fp32_block_weights


@pytest.mark.parametrize("dtype,transposed,weights", CASES)
def test_the_forward_is_the_plain_mlps_bit_for_bit(dtype, transposed, weights):
    plain, from_post = mlps(dtype, transposed, weights)
    x, _ = inputs(dtype)
    with torch.no_grad():
        assert torch.equal(from_post(x), plain(x))


@pytest.mark.parametrize("dtype,transposed,weights", CASES)
def test_the_backward_is_the_plain_mlps_bit_for_bit_where_pre_squares_exactly(dtype, transposed, weights):
    """Small dyadic inputs and weights: pre, its square and its gradients are exact, and zeros and
    negative pre (relu's masked side) are common."""
    plain, from_post = mlps(dtype, transposed, weights, dyadic=True)
    x, grad = inputs(dtype, dyadic=True)
    pre = F.linear(x, plain.fc_w.type_as(x))
    assert torch.equal(F.relu(pre).square().double(), F.relu(pre).double().square())  # squares exactly
    assert (pre == 0).any() and (pre < 0).any() and (pre > 0).any()
    got, want = run(from_post, x, grad), run(plain, x, grad)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(g.dtype == w.dtype for g, w in zip(got, want))


@pytest.mark.parametrize("dtype,transposed,weights", CASES)
def test_the_backward_on_random_inputs_is_the_plain_one_within_one_rounding_here_bit_for_bit(dtype, transposed,
                                                                                            weights):
    """post = fl(r^2) is r^2 (1 + e), |e| <= u, so sqrt(post) is r within one rounding; with a
    correctly rounded sqrt in the same dtype it is r itself (sqrt(fl(r^2)) = r in binary floating
    point without under- or overflow), so eager gives the plain bits. Compiled code that takes the
    square root in fp32 from bf16 can differ by one rounding of dpre."""
    plain, from_post = mlps(dtype, transposed, weights, seed=4)
    x, grad = inputs(dtype, seed=5)
    post = F.relu(F.linear(x, plain.fc_w.type_as(x))).square()
    r = F.relu(F.linear(x, plain.fc_w.type_as(x)))
    assert not torch.equal(post.double().sqrt(), r.double())  # the square was rounded: not exact here
    assert torch.equal(post.sqrt(), r)
    relative = ((post.double().sqrt() - r.double()).abs() / r.double().clamp_min(1e-30)).max()
    assert relative <= torch.finfo(dtype).eps / 2  # one rounding of the square, halved by the root
    got, want = run(from_post, x, grad), run(plain, x, grad)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_only_x_post_and_the_weights_are_kept_for_backward():
    """The plain MLP keeps pre's relu and post (or the pre) as well: MLPFromPost one (T, hidden) tensor."""
    x, _ = inputs(torch.bfloat16)
    x = x.requires_grad_()
    w1 = (torch.randn(256, 64) * 0.1).bfloat16().requires_grad_()
    w2 = (torch.randn(64, 256) * 0.1).bfloat16().requires_grad_()

    def saved_by(f):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            f()
        return saved

    saved = saved_by(lambda: tg.MLPFromPost.apply(x, w1, w2, False, None))
    post = F.relu(F.linear(x, w1)).square()
    assert len(saved) == 4
    assert saved[0] is x and saved[2] is w1 and saved[3] is w2 and torch.equal(saved[1], post)
    plain = saved_by(lambda: F.linear(F.relu(F.linear(x, w1)).square(), w2))
    assert sum(t.shape[-1] == 256 and t.shape[:-1] == x.shape[:-1] for t in plain) == 2  # relu(pre) and post


def test_the_gradients_pass_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(16, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(8, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    assert (F.linear(x, w1).abs() > 1e-3).all()  # no pre at relu's kink, where finite differences straddle it
    assert torch.autograd.gradcheck(lambda a, b, c: tg.MLPFromPost.apply(a, b, c, False, None), (x, w1, w2))


def test_the_mlp_traces_as_one_graph_with_the_same_bits():
    """fullgraph: no break in forward or backward; the traced graph computes the eager bits."""
    plain, from_post = mlps(seed=8)
    x, grad = inputs(torch.bfloat16, seed=9)
    eager = run(from_post, x, grad)
    traced = torch.compile(from_post, backend="aot_eager", fullgraph=True, dynamic=False)
    from_post.zero_grad()
    a = x.clone().requires_grad_()
    out = traced(a)
    out.backward(grad)
    assert all(torch.equal(g, w) for g, w in zip((out.detach(), a.grad, from_post.fc_w.grad, from_post.proj_w.grad),
                                                 eager))


def test_a_tiny_training_run_is_the_plain_one_bit_for_bit():
    """Two optimizer steps of the tiny model (bf16; the record's layout in 4 blocks, each kind of
    block once: the switch acts in every MLP alike) from the same init: the same losses and the
    same weights. W2 starts at zero, so step 0's backward gives W1 and x no gradient; step 1's is
    the first to reach them through sqrt(post), and the weights after it hold that (a third step
    checked no more)."""
    results = []
    for from_post in (False, True):
        config = tg.make_config("tiny", dtype="bfloat16", seed=3, mlp_backward_from_post=from_post, **FOUR_BLOCKS)
        runner = tg.Runner(config, torch.device("cpu"))
        assert all(block.mlp.from_post == from_post for block in runner.model.blocks)
        gen = torch.Generator().manual_seed(0)
        losses = [runner.train_step(step, runner.random_batches(gen)).item() for step in range(2)]
        results.append((losses, {n: p.detach().clone() for n, p in runner.model.named_parameters()}))
    (losses, weights), (losses_post, weights_post) = results
    assert losses == losses_post
    assert weights.keys() == weights_post.keys()
    assert all(torch.equal(weights[n], weights_post[n]) for n in weights)
    assert not torch.equal(weights["blocks.0.mlp.proj_w"], torch.zeros_like(weights["blocks.0.mlp.proj_w"]))


def test_off_builds_nothing_and_the_plain_forward_runs(monkeypatch):
    monkeypatch.setattr(tg, "short_track_mlp", lambda *a: pytest.fail("the switch is off"))
    plain, _ = mlps()
    x, _ = inputs(torch.bfloat16)
    hidden = F.relu(F.linear(x, plain.fc_w)).square()
    assert torch.equal(plain(x), F.linear(hidden, plain.proj_w.T))
    assert [n for n, _ in plain.named_parameters()] == ["fc_w", "proj_w"]
