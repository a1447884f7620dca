"""--fp8_mlp_up (PR #306, docs/short-track-transfer.md section 4): the MLP input projection from e4m3
codes with per-tensor scales, against an emulation written from the formula (exactly) and the bf16
product (within FP8's error); the scales map each maximum to 448 and nothing saturates; the backward
is the bf16 backward at the FP8 pre (alone and with §15's --mlp_backward_from_post); training only,
validation the plain product, off builds nothing; one traced graph (no host sync); the width rule."""
import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
import triton_kernels as kernels
from test_host_syncs import recorder  # noqa: F401 (a fixture)

E4M3 = torch.float8_e4m3fn


def operands(seed=0, T=48, d=64, hidden=256, integer_codes=False):
    """bf16 x (2, T/2, d) (RMS-normed, as the MLP reads it) and W1 (hidden, d). integer_codes: every
    value at least max/56 in size or 0, so each code is an integer of e4m3 (|code| >= 8) and the fp32
    sum of the codes' products is exact in any order (all integers below 2^24)."""
    gen = torch.Generator().manual_seed(seed)
    x = tg.rms_norm(torch.randn(2, T // 2, d, generator=gen)).bfloat16()
    w = (torch.randn(hidden, d, generator=gen) * 0.05).bfloat16()
    if integer_codes:
        lift = lambda t: torch.where(t.abs() < t.abs().max() / 40, torch.zeros_like(t), t)
        x, w = lift(x), lift(w)
    return x, w


def emulation(x, w):
    """The formula, written out: s_W = max|W1| / 448 and a = max|x| in fp32, the codes by one cast from
    fp32, their product in float64, then times the fp32 product (a / 448) s_W and rounded once."""
    a = torch.tensor(x.abs().max().item(), dtype=torch.float32)
    s_w = torch.tensor(w.abs().max().item(), dtype=torch.float32) / 448
    x8 = (x.float() * (torch.tensor(448.0) / a)).to(E4M3)
    w8 = (w.float() / s_w).to(E4M3)
    product = (x8.double().reshape(-1, x.shape[-1]) @ w8.double().t()).float()
    return (product * ((a / 448) * s_w)).bfloat16().view(*x.shape[:-1], w.shape[0]), x8, w8


def test_the_product_is_the_formulas_emulation_exactly():
    x, w = operands(integer_codes=True)
    pre, x8, w8 = emulation(x, w)
    got_x8, got_w8, s_x, s_w = tg.fp8_up_codes(x, w)
    assert torch.equal(got_x8.view(torch.uint8), x8.view(torch.uint8))
    assert torch.equal(got_w8.view(torch.uint8), w8.view(torch.uint8))
    assert (x8.float().abs() >= 8).logical_or(x8.float() == 0).all()  # integer codes: an exact sum
    assert s_x.shape == s_w.shape == () and s_x.dtype == s_w.dtype == torch.float32
    assert torch.equal(tg.fp8_up_product(x, w), pre)
    assert tg.fp8_up_product(x, w).dtype == torch.bfloat16


def test_the_product_is_the_bf16_product_within_fp8s_error():
    """e4m3 keeps 3 mantissa bits: each code within 2^-4 of its value, so the product within a few
    percent of the exact one (row by row); bf16's own product is within 2^-8."""
    x, w = operands(seed=1)
    exact = F.linear(x.double(), w.double())
    fp8, bf16 = tg.fp8_up_product(x, w).double(), F.linear(x, w).double()
    error = lambda p: ((p - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    assert 0.005 < error(fp8) < 0.06
    assert error(bf16) < 0.01 and error(fp8) > 4 * error(bf16)


def test_each_scale_maps_its_maximum_to_448_and_no_code_saturates():
    for seed in range(4):
        x, w = operands(seed=seed)
        x8, w8, s_x, s_w = tg.fp8_up_codes(x, w)
        assert torch.equal(s_x, x.abs().max().float() / 448) and torch.equal(s_w, w.abs().max().float() / 448)
        for t, codes, scaled in ((x, x8, x.float() * (448 / x.abs().max().float())), (w, w8, w.float() / s_w)):
            top = t.abs().flatten().argmax()
            assert codes.float().abs().flatten()[top] == 448
            # nothing beyond 448 but a rounding of the maximum itself: the clamp changes no code
            assert scaled.abs().max() <= 448 * (1 + 2 ** -23)
            assert torch.equal(codes.view(torch.uint8), scaled.to(E4M3).view(torch.uint8))


def test_a_zero_input_gives_zero_not_nan():
    x, w = operands()
    assert torch.equal(tg.fp8_up_product(torch.zeros_like(x), w), torch.zeros(*x.shape[:-1], 256).bfloat16())


class AtValue(torch.autograd.Function):
    """value in the forward, the gradient straight to `pre` in the backward: the bf16 backward
    evaluated at another forward's activations."""

    @staticmethod
    def forward(ctx, pre, value):
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mlp(from_post=False, fp8=True, seed=2, transposed=True, weights=torch.float32):
    config = tg.make_config("tiny", mlp_proj_transposed=transposed, mlp_backward_from_post=from_post,
                            fp8_mlp_up=fp8, fp32_block_weights=weights == torch.float32)
    module = tg.MLP(config, weights)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fc_w.copy_(torch.randn(module.fc_w.shape, generator=gen) * 0.125)
        module.proj_w.copy_(torch.randn(module.proj_w.shape, generator=gen) * 0.1)
    return module


def grads(module, x, grad, forward=None):
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = (module if forward is None else forward)(x)
    out.backward(grad)
    return out.detach(), x.grad, module.fc_w.grad.clone(), module.proj_w.grad.clone()


@pytest.mark.parametrize("from_post", [False, True])
@pytest.mark.parametrize("transposed,weights", [(True, torch.float32), (False, torch.bfloat16)])
def test_the_backward_is_the_bf16_backward_at_the_fp8_pre(from_post, transposed, weights):
    """dx, dW1 and dW2 of the FP8 MLP (alone, and with §15 the backward from post) equal autograd's
    through the plain bf16 MLP whose pre is replaced by the FP8 pre's value."""
    module = mlp(from_post, transposed=transposed, weights=weights)
    gen = torch.Generator().manual_seed(3)
    x = tg.rms_norm(torch.randn(2, 24, 64, generator=gen)).bfloat16()
    grad = torch.randn(2, 24, 64, generator=gen).bfloat16()

    def reference(inp):
        w1 = module.fc_w.type_as(inp)
        pre = AtValue.apply(F.linear(inp, w1), tg.fp8_up_product(inp.detach(), w1.detach()))
        proj = module.proj_w.T if transposed else module.proj_w
        hidden = F.relu(pre).square()
        return F.linear(hidden, proj.type_as(hidden))

    got, want = grads(module.train(), x, grad), grads(module, x, grad, reference)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    plain = grads(module.eval(), x, grad)
    assert not torch.equal(got[0], plain[0]) and not torch.equal(got[2], plain[2])  # the FP8 pre acts


def test_fp8_changes_training_only_and_off_is_the_plain_mlp(monkeypatch):
    fp8, plain = mlp(), mlp(fp8=False)
    x = tg.rms_norm(torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(4))).bfloat16()
    with torch.no_grad():
        assert not torch.equal(fp8.train()(x), plain.train()(x))
        assert torch.equal(fp8.train()(x), F.linear(F.relu(tg.fp8_up_product(x, fp8.fc_w.type_as(x))).square(),
                                                    fp8.proj_w.T.type_as(x)))
        assert torch.equal(fp8.eval()(x), plain.eval()(x))  # validation: the bf16 product
        monkeypatch.setattr(tg, "short_track_mlp", lambda *a: pytest.fail("nothing of §15/§17 runs"))
        assert torch.equal(fp8(x), plain(x))  # eval
        plain.train()(x)  # off


def test_only_x_and_the_weight_are_kept_for_backward():
    x, w = operands()
    x, w = x.requires_grad_(), w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tg.FP8UpProduct.apply(x, w)
    assert len(saved) == 2 and saved[0] is x and saved[1] is w


def test_the_fp8_mlp_traces_as_one_graph_with_the_same_bits():
    """fullgraph, aot_eager (as the FP8 head's test: CPU Inductor's FP8 casts are unreliable): no
    graph break, so no host sync (the scales stay 0-d tensors), in forward or backward; the eager bits."""
    for from_post in (False, True):
        module = mlp(from_post).train()
        gen = torch.Generator().manual_seed(5)
        x = tg.rms_norm(torch.randn(2, 24, 64, generator=gen)).bfloat16()
        grad = torch.randn(2, 24, 64, generator=gen).bfloat16()
        eager = grads(module, x, grad)
        traced = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=False)
        assert all(torch.equal(g, w) for g, w in zip(grads(module, x, grad, traced), eager))


def test_the_device_branch_takes_the_scales_as_the_device_tensors_they_are(recorder):
    """_scaled_mm on meta tensors (the way tests/test_host_syncs.py checks the head's): 0-d fp32 scales
    computed on the device pass through as they are, no fill, no copy, no read."""
    x8 = torch.empty(64, 32, dtype=E4M3, device="meta")
    w8 = torch.empty(96, 32, dtype=E4M3, device="meta")
    s_x, s_w = (torch.empty((), dtype=torch.float32, device="meta") for _ in range(2))
    assert kernels.fp32_scale(s_x, "meta") is s_x
    with recorder:
        pre = kernels.scaled_mm(x8, w8.t(), s_x, s_w, torch.bfloat16, False)
    assert pre.shape == (64, 96) and pre.dtype == torch.bfloat16 and recorder.calls == []


def test_a_tiny_training_run_with_both_switches_is_the_fp8_run_bit_for_bit():
    """--fp8_mlp_up trains (the loss falls) and differs from the plain run; with §15 on as well the
    same bits (the backward from post at the FP8 pre)."""
    results = []
    for flags in ({}, {"fp8_mlp_up": True}, {"fp8_mlp_up": True, "mlp_backward_from_post": True}):
        config = tg.make_config("tiny", dtype="bfloat16", seed=3, **flags)
        runner = tg.Runner(config, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        batches = runner.random_batches(gen)
        losses = [runner.train_step(step, batches).item() for step in range(6)]
        results.append((losses, [p.detach().clone() for p in runner.model.parameters()]))
    (plain, _), (fp8, weights), (both, weights_both) = results
    assert fp8 != plain and fp8[-1] < fp8[0]
    assert abs(fp8[0] - plain[0]) < 0.01  # FP8's error, not a different model
    assert both == fp8 and all(torch.equal(p, q) for p, q in zip(weights, weights_both))


def test_widths_scaled_mm_cannot_take_are_refused_in_one_line():
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args(["--preset=tiny", "--fp8_mlp_up", "--model_dim=72", "--num_heads=1", "--head_dim=72"])
    message = str(refusal.value)
    assert message.startswith("--fp8_mlp_up: ") and "multiples of 16" in message and "\n" not in message
    tg.parse_args(["--preset=tiny", "--fp8_mlp_up"])
