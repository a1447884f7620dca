"""--fp8_mlp_up (PR #306, docs/short-track-transfer.md section 4): the MLP input projection from e4m3
codes with per-tensor scales, against #306's rule written from its code's operations (exactly) and the
bf16 product (within FP8's error); the scales map each maximum to 448; the backward
is the bf16 backward at the FP8 pre (alone and with §15's --mlp_backward_from_post); training only,
validation the plain product, off builds nothing; one traced graph (no host sync); the width rule."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCKS
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


def bf16(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.bfloat16)


def pr306(x, w):
    """#306's rule, written from its code's operations with numpy's fp32 arithmetic: its eager
    quantization of the bf16 bank after each optimizer step, s_W = bf16(fp32(max|W1|) / 448) and W8 =
    e4m3(bf16(fp32(W1) / fp32(s_W))); its compiled forward, a = max|x| and x8 = e4m3(fp32(x fp32(448
    / a))); its kernel's accumulator (here the codes' products in float64, exact for integer codes)
    times dequant = fp32(fp32(s_W a) / 448), its in-place fp32 buffer, then rounded to bf16."""
    f32 = np.float32
    a = f32(x.abs().max().item())
    s_w = bf16(float(f32(w.abs().max().item()) / f32(448)))
    w8 = torch.from_numpy(w.float().numpy() / f32(s_w.item())).bfloat16().to(E4M3)
    x8 = torch.from_numpy(x.float().numpy() * (f32(448) / a)).to(E4M3)
    dequant = torch.tensor(f32(f32(s_w.item()) * a) / f32(448))
    product = (x8.double().reshape(-1, x.shape[-1]) @ w8.double().t()).float()
    return (product * dequant).bfloat16().view(*x.shape[:-1], w.shape[0]), x8, w8, dequant


def test_the_product_is_pr306s_rule_exactly():
    x, w = operands(integer_codes=True)
    pre, x8, w8, dequant = pr306(x, w)
    got_x8, got_w8, got_dequant = tg.fp8_up_codes(x, w)
    assert torch.equal(got_x8.view(torch.uint8), x8.view(torch.uint8))
    assert torch.equal(got_w8.view(torch.uint8), w8.view(torch.uint8))
    assert (x8.float().abs() >= 8).logical_or(x8.float() == 0).all()  # integer codes: an exact sum
    assert got_dequant.shape == () and got_dequant.dtype == torch.float32 and torch.equal(got_dequant, dequant)
    assert torch.equal(tg.fp8_up_product(x, w), pre)
    assert tg.fp8_up_product(x, w).dtype == torch.bfloat16


def test_the_weight_codes_round_to_bf16_first_as_pr306s_eager_quantization():
    """max|W1| = 1: s_W = bf16(1/448) = 146 x 2^-16 = 0.0022277832 (fp32's 1/448 is 0.0022321430).
    w = 0.41015625: w / s_W = 184.1 rounds to bf16 184, halfway between e4m3's 176 and 192, and ties
    to the even code 192 (from fp32's scale 183.75 would round to 176)."""
    x = torch.ones(1, 16).bfloat16()
    w = torch.zeros(16, 16).bfloat16()
    w[0, 0], w[0, 1] = 1.0, 0.41015625
    _, w8, dequant = tg.fp8_up_codes(x, w)
    assert bf16(1 / 448).item() == 146 * 2 ** -16
    assert w8[0, 0].float() == 448 and w8[0, 1].float() == 192
    assert dequant.item() == np.float32(np.float32(146 * 2 ** -16) * np.float32(1.0)) / np.float32(448)


def test_the_product_is_the_bf16_product_within_fp8s_error():
    """e4m3 keeps 3 mantissa bits: each code within 2^-4 of its value, so the product within a few
    percent of the exact one (row by row); bf16's own product is within 2^-8."""
    x, w = operands(seed=1)
    exact = F.linear(x.double(), w.double())
    fp8, bf16 = tg.fp8_up_product(x, w).double(), F.linear(x, w).double()
    error = lambda p: ((p - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    assert 0.005 < error(fp8) < 0.06
    assert error(bf16) < 0.01 and error(fp8) > 4 * error(bf16)


def test_each_maximum_maps_to_448():
    """The input's maximum maps to 448 from fp32 (to 448 (1 + 2^-23) at most: the rounding of 448 / a);
    the weight's through its bf16 scale and quotient, each within 2^-9 relative, so to at most
    448 (1 + 2^-8) before e4m3, which rounds that to 448 (480 is past e4m3's largest)."""
    for seed in range(4):
        x, w = operands(seed=seed)
        x8, w8, _ = tg.fp8_up_codes(x, w)
        s_w = (w.abs().max() / 448).float()
        for t, codes, scaled, bound in ((x, x8, x.float() * (448 / x.abs().max().float()), 448 * (1 + 2 ** -23)),
                                        (w, w8, (w / s_w.bfloat16()).float(), 448 * (1 + 2 ** -8))):
            top = t.abs().flatten().argmax()
            assert codes.float().abs().flatten()[top] == 448
            assert scaled.abs().max() <= bound
            assert torch.equal(codes.view(torch.uint8), scaled.to(E4M3).view(torch.uint8))  # the clamp changes none


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
    same bits (the backward from post at the FP8 pre). W2 starts at zero, so step 0 is the same for
    every run (the MLP adds nothing and W1 gets no gradient): step 1 is the first whose loss FP8 can
    change (the plain run needs no more) and whose backward reaches W1 through the FP8 pre; the weights
    after step 2 hold it, so 3 steps cross it (6 steps checked no more). On FOUR_BLOCKS: every block's
    MLP is the same code at any depth."""
    results = []
    for flags, steps in (({}, 2), ({"fp8_mlp_up": True}, 3), ({"fp8_mlp_up": True, "mlp_backward_from_post": True}, 3)):
        config = tg.make_config("tiny", dtype="bfloat16", seed=3, **FOUR_BLOCKS, **flags)
        runner = tg.Runner(config, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        batches = runner.random_batches(gen)
        losses = [runner.train_step(step, batches).item() for step in range(steps)]
        results.append((losses, {n: p.detach().clone() for n, p in runner.model.named_parameters()}))
    (plain, _), (fp8, weights), (both, weights_both) = results
    assert fp8[:2] != plain and fp8[-1] < fp8[0]
    assert abs(fp8[0] - plain[0]) < 0.01  # FP8's error, not a different model
    assert both == fp8 and weights.keys() == weights_both.keys()
    assert all(torch.equal(weights[n], weights_both[n]) for n in weights)
    assert weights["blocks.0.mlp.proj_w"].any()  # W2 grew: the MLP acted from step 1


def test_widths_scaled_mm_cannot_take_are_refused_in_one_line():
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args(["--preset=tiny", "--fp8_mlp_up", "--model_dim=72", "--num_heads=1", "--head_dim=72"])
    message = str(refusal.value)
    assert message.startswith("--fp8_mlp_up: ") and "multiples of 16" in message and "\n" not in message
    tg.parse_args(["--preset=tiny", "--fp8_mlp_up"])
