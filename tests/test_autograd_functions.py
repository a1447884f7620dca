"""The project's custom autograd Functions, compiled, give eager's gradients: FP8HeadProduct (--fp8's
head product) and FusedSoftcapCE (--fused_softcap_ce, both variants, with and without FP8), traced
whole (fullgraph) in float32. torch 2.11 gives zero gradients to every input of a Function whose
forward returns a no-op cast (.to() of a tensor already in that dtype, a float32 CPU run's case) under
compile, where torch 2.13 does not: each Function must return a fresh tensor. Traced with aot_eager
(torch's own autograd of the traced graph, no Inductor code: torch 2.13's CPU Inductor FP8 code is
unreliable, tests/test_fp8_head.py)."""
import pytest
import torch

import train_gpt_medium as tg

SCALES = (32 / 448, 2.25 / 448, 1.5 / 448)


def grads(fn, inputs, upstream=None):
    """(output, gradients of every input) of fn(*inputs), fresh leaves each call."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(upstream if upstream is not None else torch.ones_like(out))
    return out.detach(), [x.grad for x in leaves]


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_fp8_head_product_compiled_gives_eagers_gradients_in_float32(transposed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=gen) * 0.5
    W = torch.randn(16, 48, generator=gen) * 0.1 if transposed else torch.randn(48, 16, generator=gen) * 0.1
    G = torch.randn(32, 48, generator=gen) * 1e-3
    product = lambda a, b: tg.FP8HeadProduct.apply(a, b, transposed, SCALES)
    want, want_grads = grads(product, (x, W), G)
    got, got_grads = grads(compiled(product), (x, W), G)
    assert torch.equal(got, want)
    assert all(g.abs().sum() > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


@pytest.mark.parametrize("variant,fp8", [("pr252", False), ("pr252", True), ("pr261", False), ("pr261", True)])
def test_the_fused_loss_compiled_gives_eagers_gradients_in_float32(variant, fp8):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=gen)
    H = torch.randn(64, 16, generator=gen) * 0.05
    targets = torch.randint(0, 64, (40,), generator=gen)
    weights = torch.tensor([1.0, 0.5])
    grad_scale = 0.125 if variant == "pr261" else None
    loss = lambda a, b: tg.fused_softcap_ce(a, b, targets, weights, False, SCALES if fp8 else None, variant=variant,
                                            grad_scale=grad_scale)
    upstream = torch.tensor(grad_scale or 1.0)
    want, want_grads = grads(loss, (h, H), upstream)
    got, got_grads = grads(compiled(loss), (h, H), upstream)
    assert torch.equal(got, want)
    assert all(g.abs().sum() > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
