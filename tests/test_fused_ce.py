"""--fused_softcap_ce (docs/fused-ce.md): PR #252's training loss as one op. Its CPU emulation against
a float32 autograd computation of the same formula written here (exactly, or within FP8's error
sizes), its Triton kernel against the emulation under TRITON_INTERPRET=1 (skipped where triton is
not installed), the model's use of it, and a tiny run that learns."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCKS  # the loss is the head's, whatever the depth
from test_training import small_run_config

T, V, D = 48, 512, 64
SCALES = (100 / 448, 1.6 / 448, 0.75 / 448)  # the record's fp8_ranges / 448
WEIGHTS = {1: None, 2: [1.0, 0.5], 3: [1.0, 0.5, 0.25], "zero": [1.0, 0.0, 0.25]}  # None: next token only


def inputs(seed=0, rows=T, cols=V, dtype=torch.float32):
    """h: RMS-normed rows; H (V, d) ~ N(0, 0.25^2) (inside e4m3's range 1.6); targets with a few past
    V and one negative (no term)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, D, generator=gen)
    h = (h * h.square().mean(1, keepdim=True).rsqrt()).to(dtype)
    H = (torch.randn(cols, D, generator=gen) * 0.25).to(dtype)
    y = torch.randint(0, cols, (rows,), generator=gen)
    y[[3, 10, rows - 1]] = torch.tensor([cols, cols + 7, cols + 1])
    y[5] = -1
    return h, H, y


class Straight(torch.autograd.Function):
    """forward: `value`; backward: the gradient as it comes (a rounding the gradient passes through)."""

    @staticmethod
    def forward(ctx, x, value):
        return value

    @staticmethod
    def backward(ctx, g):
        return g, None


class GradCodes(torch.autograd.Function):
    """forward: identity; backward: the gradient replaced by its e5m2 code x s_g (or its bf16 value).
    seen: gets the codes; given: codes to use instead of the gradient's own."""

    @staticmethod
    def forward(ctx, x, s_g, seen, given):
        ctx.s_g, ctx.seen, ctx.given = s_g, seen, given
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.s_g is None:
            return g.bfloat16().float(), None, None, None
        codes = (g / ctx.s_g).to(torch.float8_e5m2)
        ctx.seen.append(codes)
        return (codes if ctx.given is None else ctx.given).float() * ctx.s_g, None, None, None


def reference(h, H, y, weights, rounding=None, g=1.0, seen=None, given=None):
    """(loss, dh, dH) by float32 autograd of sum_t sum_k w_k (LSE_t - z_t[y_(t+k)]), z = 23 sigmoid((l+5)/7.5),
    l = h H^T, over t+k < T, w_k > 0, 0 <= y < V. rounding: None (pure fp32), "bf16" (h, H, l and dL/dl
    rounded to bf16) or the FP8 scales (h, H replaced by codes x scale, l rounded to bf16, dL/dl by
    its e5m2 code x s_g (seen: gets the codes; given: codes to use instead)), each rounding passed
    straight through by the gradient."""
    h32 = h.detach().float().requires_grad_()
    H32 = H.detach().float().requires_grad_()
    x, W = h32, H32
    if rounding == "bf16":
        x, W = Straight.apply(x, x.bfloat16().float()), Straight.apply(W, W.bfloat16().float())
    elif rounding is not None:
        s_x, s_w, _ = rounding
        x = Straight.apply(x, (x / s_x).to(torch.float8_e4m3fn).float() * s_x)
        W = Straight.apply(W, (W / s_w).to(torch.float8_e4m3fn).float() * s_w)
    l = x @ W.t()
    if rounding is not None:
        l = GradCodes.apply(Straight.apply(l, l.bfloat16().float()), None if rounding == "bf16" else rounding[2],
                            [] if seen is None else seen, given)
    z = 23 * torch.sigmoid((l + 5) / 7.5)
    lse = torch.logsumexp(z, dim=1)
    weights = [1.0] if weights is None else weights
    loss = torch.zeros(())
    for k, w in enumerate(weights):
        for t in range(len(y) - k):
            if w > 0 and 0 <= y[t + k] < W.shape[0]:
                loss = loss + w * (lse[t] - z[t, y[t + k]])
    (loss * g).backward()
    return loss.detach(), h32.grad, H32.grad


def fused(h, H, y, weights, scales=None, transposed=False, g=1.0):
    """(loss, dh, dH) of tg.fused_softcap_ce; H given as (V, d), passed (d, V) if transposed."""
    h = h.detach().clone().requires_grad_()
    H = (H.detach().t().contiguous() if transposed else H.detach().clone()).requires_grad_()
    w = None if weights is None else torch.tensor(weights)
    loss = tg.fused_softcap_ce(h, H, y, w, transposed, scales)
    (loss * g).backward()
    return loss.detach(), h.grad, H.grad.t() if transposed else H.grad


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n", WEIGHTS)
def test_fp32_equals_the_autograd_reference(n):
    """With every term of the last n-1 rows cut off by the sequence end, and targets past V: an S_w
    that counted all weights, or a term that read a target past V, would fail here."""
    h, H, y = inputs(seed=1)
    loss, dh, dH = fused(h, H, y, WEIGHTS[n], g=0.7)
    ref_loss, ref_dh, ref_dH = reference(h, H, y, WEIGHTS[n], g=0.7)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dH, ref_dH, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh[-3:], ref_dh[-3:], rtol=1e-5, atol=1e-6)  # the rows with fewer terms


def test_targets_past_v_and_negative_add_nothing():
    h, H, y = inputs(seed=2)
    keep = (y >= 0) & (y < V)
    loss = tg.fused_softcap_ce(h, H, y)
    z = 23 * torch.sigmoid((h @ H.t() + 5) / 7.5)
    direct = (torch.logsumexp(z, 1) - z.gather(1, y.clamp(0, V - 1)[:, None])[:, 0])[keep].sum()
    torch.testing.assert_close(loss, direct, rtol=2e-6, atol=0)


def test_bf16_equals_the_reference_with_bf16_roundings():
    h, H, y = inputs(seed=3, dtype=torch.bfloat16)
    loss, dh, dH = fused(h, H, y, WEIGHTS[3])
    assert loss.dtype == torch.float32 and dh.dtype == dH.dtype == torch.bfloat16
    ref_loss, ref_dh, ref_dH = reference(h, H, y, WEIGHTS[3], rounding="bf16")
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    # the products are bf16 matmuls (the reference's fp32; the CPU's bf16 matmul may round partial
    # sums too): a bf16 step of the largest entry
    for ours, ref in ((dh, ref_dh), (dH, ref_dH)):
        torch.testing.assert_close(ours.float(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
        assert rel(ours, ref) < 2**-8


@pytest.mark.parametrize("n", [1, 3])
def test_fp8_is_within_frontiers_sizes_of_fp32(n):
    """FP8's error on random data at the record's vocabulary (50,304 columns): loss within 0.9e-4 -
    4.5e-4, gradients ~5 % (Frobenius) of the fp32 values; here 512 columns of larger logits: up to 1e-3."""
    h, H, y = inputs(seed=4)
    loss, dh, dH = fused(h, H, y, WEIGHTS[n], SCALES)
    ref_loss, ref_dh, ref_dH = reference(h, H, y, WEIGHTS[n])
    assert abs(loss / ref_loss - 1) < 1e-3
    assert rel(dh, ref_dh) < 0.1 and rel(dH, ref_dH) < 0.1
    assert rel(dh, ref_dh) > 0.01  # the e5m2 gradient's error is there: the FP8 path ran


@pytest.mark.parametrize("n", WEIGHTS)
def test_fp8_equals_the_reference_with_the_quantizations_inserted(n):
    """Forward exactly (to fp32 order); the gradient's e5m2 codes equal the codes of autograd's
    dL/dl but where the two fp32 values lie on either side of a rounding midpoint (then one code
    apart, rare); with those codes the backward's two products are the reference's."""
    h, H, y = inputs(seed=5)
    loss, dh, dH = fused(h, H, y, WEIGHTS[n], SCALES, g=1.5)
    seen = []
    ref_loss, ref_dh, ref_dH = reference(h, H, y, WEIGHTS[n], rounding=SCALES, g=1.5, seen=seen)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    assert rel(dh, ref_dh) < 2**-8 and rel(dH, ref_dH) < 1e-3  # dh: bf16
    # the emulation's codes, from its own logits
    s_x, s_w, s_g = SCALES
    logits = kernels.fp8_matmul(kernels.to_fp8(h, s_x), kernels.to_fp8(H, s_w).t(), s_x, s_w, torch.bfloat16, fast_accum=True)
    cols, wts = kernels.fused_ce_terms(y, torch.ones(1) if WEIGHTS[n] is None else torch.tensor(WEIGHTS[n]), V)
    codes = kernels._fused_ce_dlogits_torch(logits, kernels._fused_ce_rows_torch(logits, cols, wts)[1], cols, wts,
                                       torch.tensor(1.5), s_g, torch.float8_e5m2)
    ours, theirs = codes.float(), seen[0].float()
    assert ((ours - theirs).abs() <= 0.25 * theirs.abs()).all() and (ours != theirs).float().mean() < 1e-3
    _, ref_dh, ref_dH = reference(h, H, y, WEIGHTS[n], rounding=SCALES, g=1.5, given=codes)
    # dh: the emulation rounds the codes' product to bf16 (the reference keeps fp32): half a bf16 step
    torch.testing.assert_close(dh, ref_dh, rtol=2**-8, atol=1e-6)
    # dH: fp32 sums of terms up to ~1 that cancel (codes x codes, then the scales; the reference scales
    # first): an fp32 step of the terms
    torch.testing.assert_close(dH, ref_dH, rtol=1e-5, atol=1e-6)


def test_the_gradient_codes_are_e5m2_of_dl_over_s_g():
    """The codes the backward multiplies: e5m2(dL/dl / s_g) of the fp32 dL/dl."""
    h, H, y = inputs(seed=6)
    s_x, s_w, s_g = SCALES
    logits = kernels.fp8_matmul(kernels.to_fp8(h, s_x), kernels.to_fp8(H, s_w).t(), s_x, s_w, torch.bfloat16, fast_accum=True)
    cols, wts = kernels.fused_ce_terms(y, torch.tensor([1.0, 0.5]), V)
    _, lse = kernels._fused_ce_rows_torch(logits, cols, wts)
    g = torch.tensor(2.0)
    codes = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, s_g, torch.float8_e5m2)
    exact = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, 1.0, torch.float32)
    assert codes.dtype == torch.float8_e5m2
    assert torch.equal(codes.float(), (exact / s_g).to(torch.float8_e5m2).float())
    # the same dL/dl by autograd from these logits
    l = logits.float().requires_grad_()
    z = 23 * torch.sigmoid((l + 5) / 7.5)
    terms = [(torch.logsumexp(z, 1)[:T - k] - z[:T - k].gather(1, y[k:].clamp(0, V - 1)[:, None])[:, 0]) * w
             * ((y[k:] >= 0) & (y[k:] < V)) for k, w in enumerate([1.0, 0.5])]
    (2.0 * sum(t.sum() for t in terms)).backward()
    torch.testing.assert_close(exact, l.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("scales", [None, SCALES])
def test_a_transposed_head_gives_the_same_loss_and_gradients(scales):
    h, H, y = inputs(seed=7)
    a, b = fused(h, H, y, WEIGHTS[3], scales), fused(h, H, y, WEIGHTS[3], scales, transposed=True)
    for x, z in zip(a, b):
        torch.testing.assert_close(x, z, rtol=1e-6, atol=0)


def test_row_blocks_do_not_change_the_result():
    """The CPU path's bound on its fp32 temporaries (a few rows at a time) is invisible."""
    h, H, y = inputs(seed=8)
    logits = (h @ H.t()).bfloat16()
    cols, wts = kernels.fused_ce_terms(y, torch.tensor([1.0, 0.5, 0.25]), V)
    whole = kernels._fused_ce_rows_torch(logits, cols, wts, chunk=T * V)
    for chunk in (V, 5 * V):  # 1 and 5 rows (48 = 9 x 5 + 3)
        assert all(torch.equal(a, b) for a, b in zip(kernels._fused_ce_rows_torch(logits, cols, wts, chunk=chunk),
                                                      whole))
        for scale, dtype in ((1.0, torch.bfloat16), (SCALES[2], torch.float8_e5m2)):
            args = (logits, whole[1], cols, wts, torch.tensor(1.0), scale, dtype)
            assert torch.equal(kernels._fused_ce_dlogits_torch(*args, chunk=chunk).float(),
                               kernels._fused_ce_dlogits_torch(*args, chunk=T * V).float())


def test_torch_compile_traces_it_as_one_opaque_op():
    """fullgraph: no graph break; the custom ops' fake versions give the shapes."""
    h, H, y = inputs(seed=9)
    w = torch.tensor([1.0, 0.5])
    compiled = torch.compile(lambda a, b: tg.fused_softcap_ce(a, b, y, w, False, SCALES), backend="aot_eager",
                             fullgraph=True)
    outs = []
    for f in (compiled, lambda a, b: tg.fused_softcap_ce(a, b, y, w, False, SCALES)):
        a, b = h.clone().requires_grad_(), H.clone().requires_grad_()
        f(a, b).backward()
        outs.append((a.grad, b.grad))
    assert all(torch.equal(x, z) for x, z in zip(*outs))


# ---- the model

def tiny_model(**overrides):
    """The tiny model on 4 blocks (FOUR_BLOCKS): these tests compare losses and gradients through the head."""
    config = tg.make_config("tiny", dtype="float32", untie_embed_after_step=0, **FOUR_BLOCKS, **overrides)
    return tg.build_model(config)


def model_loss_and_grads(model, training, mtp=None):
    gen = torch.Generator().manual_seed(11)
    T_ = model.config.train_seq_len
    tokens = torch.randint(0, model.config.vocab_size, (T_ + 1,), generator=gen)
    model.train(training)
    model.zero_grad()
    loss = model(tokens[:-1].int(), tokens[1:], torch.tensor([3, 1]), mtp_weights=mtp)
    if training:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_model_uses_it_in_training_only(monkeypatch):
    """fp32 model: the fused loss equals the unfused one up to fp32 order; validation is the bulk code."""
    bulk, fused_model = tiny_model(), tiny_model(fused_softcap_ce=True)
    with torch.no_grad():
        for p in bulk.head.parameters():  # a head that is not zero, so the logits differ by token
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    fused_model.load_state_dict(bulk.state_dict())
    mtp = torch.tensor([1.0, 0.5, 0.25])
    a, ga = model_loss_and_grads(bulk, True, mtp)
    b, gb = model_loss_and_grads(fused_model, True, mtp)
    torch.testing.assert_close(b, a, rtol=2e-6, atol=0)
    assert ga.keys() == gb.keys()
    for name in ga:
        # entries near 0 are sums that cancel: an absolute tolerance (gradients here are up to ~6)
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(model_loss_and_grads(bulk, False)[0], model_loss_and_grads(fused_model, False)[0])
    calls = []
    monkeypatch.setattr(tg, "fused_softcap_ce", lambda *args, real=tg.fused_softcap_ce, **kw: calls.append(args) or real(*args, **kw))
    model_loss_and_grads(fused_model, True, mtp)
    model_loss_and_grads(fused_model, False)
    assert len(calls) == 1 and calls[0][-1] is None  # training only; no --fp8: no scales


def test_fp8_reaches_the_fused_loss(monkeypatch):
    model = tiny_model(fused_softcap_ce=True, fp8=True)
    calls = []
    monkeypatch.setattr(tg, "fused_softcap_ce", lambda *args, real=tg.fused_softcap_ce, **kw: calls.append(args) or real(*args, **kw))
    model_loss_and_grads(model, True)
    # the gradient's scale times the trainer's loss scale (1 / batch_slices): the records' codes
    s_x, s_w, s_g = tg.fp8_scales(model.config)
    assert tg.fp8_scales(model.config) == pytest.approx(SCALES)
    assert calls[0][-1] == tg.fp8_training_scales(model.config) == (s_x, s_w, s_g / model.config.batch_slices)


@pytest.mark.parametrize("flags, message", [
    (dict(logit_softcap_form="rational"), "--fused_softcap_ce: computes the sigmoid cap"),
    (dict(lore_output=True, untie_embed_after_step=0), "--fused_softcap_ce: needs the full head matrix")])
def test_configurations_it_cannot_serve_are_refused(flags, message):
    with pytest.raises(tg.ConfigError, match=message):
        tg.make_config("tiny", fused_softcap_ce=True, **flags)


def test_tiny_runs_with_it_learn(synthetic_dir):
    """Without FP8 it trains as the bulk loss does (fp32 model: the same function); with --fp8 too, and
    with PR #261's variant (its gradient made in the forward) as --fp8 does. On 4 blocks (FOUR_BLOCKS:
    the loss is the head's; a quarter of the 16 blocks' cost): 10 steps learn about as much as on 16
    (validation loss 6.24 -> 5.97 either way), with the same threshold."""
    runs = {name: tg.train(small_run_config(synthetic_dir, num_iterations=10, val_every=5, **FOUR_BLOCKS, **flags),
                           torch.device("cpu"))
            for name, flags in (("bulk", {}), ("fused", dict(fused_softcap_ce=True)),
                                ("fp8", dict(fused_softcap_ce=True, fp8=True)),
                                ("pr261", dict(fused_softcap_ce=True, fp8=True, fused_ce_variant="pr261")))}
    losses = {name: [h["val_loss"] for h in run["val_history"]] for name, run in runs.items()}
    for name, values in losses.items():
        assert values[-1] < values[0] - 0.2, name
    assert losses["fused"] == pytest.approx(losses["bulk"], abs=1e-3)
    assert losses["fp8"] != losses["fused"]
    assert losses["pr261"] == pytest.approx(losses["fp8"], abs=5e-3) and losses["pr261"] != losses["fp8"]


# ---- the pr261 variant (PR #261's kernel): sigma rounded to bf16, the gradient made in the forward for
# a fixed upstream gradient grad_scale, S_w over all the weights, e5m2 codes saturating

E5M2_MAX = 57344.0


def fused261(h, H, y, weights, scales=None, grad_scale=1.0, g=1.0):
    """(loss, dh, dH) of tg.fused_softcap_ce(variant="pr261"), the backward fed g."""
    h, H = h.detach().clone().requires_grad_(), H.detach().clone().requires_grad_()
    w = None if weights is None else torch.tensor(weights)
    loss = tg.fused_softcap_ce(h, H, y, w, False, scales, variant="pr261", grad_scale=grad_scale)
    (loss * g).backward()
    return loss.detach(), h.grad, H.grad


def made_in_the_forward(h, H, y, weights, scales, grad_scale):
    """(loss, dL/dl as the forward stores it: e5m2 codes with scales, else h's dtype)."""
    w = torch.ones(1) if weights is None else torch.tensor(weights)
    cols, wts = kernels.fused_ce_terms(y, w, H.shape[0])
    s_x, s_w, s_g = scales or (1.0, 1.0, 1.0)
    return kernels._fused_ce261_forward(h, H, cols, wts, w.sum(), False, scales is not None, s_x, s_w,
                                   s_g * grad_scale, grad_scale)


def reference261(h, H, y, weights, scales, grad_scale):
    """(loss, gradient codes, the dequantized h and H) of #261's kernel written out in float32:
    l = bf16 of the FP8 product; sigma = bf16(0.5 + 0.5 tanh(u/2)), z = 23 sigma; loss = sum over
    t+k < T, 0 <= y < V of w_k (LSE - z[y]) (zero weights kept); code = e5m2 of q = grad_scale (23/7.5)
    (1/grad_s) (S_w p - sum_k w_k [v = y_(t+k)]) sigma (1 - sigma), S_w = the sum of ALL the weights,
    grad_s = grad_scale s_g, saturating at e5m2's largest."""
    s_x, s_w, s_g = scales
    x = (h.float() / s_x).to(torch.float8_e4m3fn).float() * s_x
    W = (H.float() / s_w).to(torch.float8_e4m3fn).float() * s_w
    l = (x @ W.t()).bfloat16().float()
    sig = (0.5 + 0.5 * torch.tanh((l / 7.5 + 5 / 7.5) / 2)).bfloat16().float()
    z = 23 * sig
    lse = torch.logsumexp(z, 1)
    weights = [1.0] if weights is None else weights
    loss, hit = torch.zeros(()), torch.zeros_like(z)
    for k, w in enumerate(weights):
        for t in range(len(y) - k):
            if 0 <= y[t + k] < W.shape[0]:
                loss = loss + w * (lse[t] - z[t, y[t + k]])
                hit[t, y[t + k]] += w
    grad_s = grad_scale * s_g
    q = grad_scale * (23 / 7.5) / grad_s * (sum(weights) * torch.exp(z - lse[:, None]) - hit) * sig * (1 - sig)
    return loss, q.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2), x, W


@pytest.mark.parametrize("n", WEIGHTS)
def test_pr261_loss_and_codes_equal_a_float32_reference(n):
    """grad_scale 1/4 (four micro-steps): the codes are those of grad_scale 1 (the gradient's FP8 scale
    is grad_scale s_g); dh, dH are the codes' products with that scale."""
    h, H, y = inputs(seed=21)
    loss, codes = made_in_the_forward(h, H, y, WEIGHTS[n], SCALES, 0.25)
    ref_loss, ref_codes, x, W = reference261(h, H, y, WEIGHTS[n], SCALES, 0.25)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    assert codes.dtype == torch.float8_e5m2
    ours, theirs = codes.float(), ref_codes.float()
    # equal but where the two fp32 orders straddle a rounding midpoint (then one code apart)
    assert ((ours - theirs).abs() <= 0.25 * theirs.abs()).all() and (ours != theirs).float().mean() < 1e-3
    assert torch.equal(made_in_the_forward(h, H, y, WEIGHTS[n], SCALES, 1.0)[1].float(), ours)
    _, dh, dH = fused261(h, H, y, WEIGHTS[n], SCALES, grad_scale=0.25)
    grad_s = 0.25 * SCALES[2]
    torch.testing.assert_close(dh, (ours @ W) * grad_s, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(dH, (ours.t() @ x) * grad_s, rtol=1e-5, atol=1e-6)


def test_pr261s_codes_do_not_depend_on_grad_scale():
    """The gradient's FP8 scale is grad_scale s_g, so the stored codes (those the backward multiplies)
    are the same for any grad_scale: accumulation over many micro-steps keeps the codes of one (a
    scale left at s_g would shrink them by grad_scale, into e5m2's subnormals and zero)."""
    h, H, y = inputs(seed=27)
    saved = []
    for grad_scale in (1.0, 2.0**-12):
        loss = tg.fused_softcap_ce(h.clone().requires_grad_(), H.clone().requires_grad_(), y, torch.tensor([1.0, 0.5]),
                                   False, SCALES, variant="pr261", grad_scale=grad_scale)
        codes = loss.grad_fn.saved_tensors[0]
        assert codes.dtype == torch.float8_e5m2 and codes.shape == (T, V)
        saved.append(codes.float())
    assert torch.equal(saved[0], saved[1])
    assert torch.equal(saved[0], made_in_the_forward(h, H, y, [1.0, 0.5], SCALES, 1.0)[1].float())


def test_pr261_codes_saturate_where_torchs_cast_gives_inf():
    """A gradient scale so small that dL/dl / s_g passes e5m2's largest value: #261 converts with
    saturation (the largest finite code), torch's e5m2 cast (and so the pr252 path) with inf."""
    h, H, y = inputs(seed=22)
    scales = SCALES[:2] + (1e-7,)
    codes = made_in_the_forward(h, H, y, WEIGHTS[2], scales, 1.0)[1].float()
    assert codes.isfinite().all() and codes.abs().max() == E5M2_MAX
    theirs = reference261(h, H, y, WEIGHTS[2], scales, 1.0)[1].float()
    assert (codes != theirs).float().mean() < 1e-3
    lse = torch.logsumexp(23 * torch.sigmoid((h @ H.t() + 5) / 7.5), 1)
    cols, wts = kernels.fused_ce_terms(y, torch.tensor(WEIGHTS[2]), V)
    assert kernels._fused_ce_dlogits_torch((h @ H.t()).bfloat16(), lse, cols, wts, torch.tensor(1.0), 1e-7,
                                      torch.float8_e5m2).float().isinf().any()


class Bf16Sigma(torch.autograd.Function):
    """sigma(u) in #261's form rounded to bf16; its derivative taken as sigma (1 - sigma) of that value."""

    @staticmethod
    def forward(ctx, u):
        s = (0.5 + 0.5 * torch.tanh(u / 2)).bfloat16().float()
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * s * (1 - s)


@pytest.mark.parametrize("n", [2, 3, "zero"])
def test_pr261s_gradient_is_the_losss_derivative_but_on_the_last_rows(n):
    """fp32, no FP8, every target inside V: dL/dl equals autograd's derivative of the loss times
    grad_scale on every row whose K terms are all inside the sequence; on the last K-1 rows (fewer
    terms) it is not: there S_w still counts every weight, so it is the derivative plus
    grad_scale (23/7.5) (S_w - S_w(t)) p sigma (1 - sigma)."""
    h, H, y = inputs(seed=23)
    y = y.clamp(0, V - 1)
    weights, K, grad_scale = WEIGHTS[n], len(WEIGHTS[n]), 0.5
    _, dl = made_in_the_forward(h, H, y, weights, None, grad_scale)
    assert dl.dtype == torch.float32
    l = (h @ H.t()).requires_grad_()
    z = 23 * Bf16Sigma.apply(l / 7.5 + 5 / 7.5)
    lse = torch.logsumexp(z, 1)
    loss = sum(w * (lse[:T - k] - z[:T - k].gather(1, y[k:, None])[:, 0]).sum() for k, w in enumerate(weights))
    (loss * grad_scale).backward()
    torch.testing.assert_close(dl[:T - K + 1], l.grad[:T - K + 1], rtol=1e-5, atol=1e-9)
    s = Bf16Sigma.apply(l.detach() / 7.5 + 5 / 7.5)
    p = torch.exp(23 * s - lse.detach()[:, None])
    missing = torch.tensor([sum(weights[T - t:]) for t in range(T - K + 1, T)])  # the weights past the end
    extra = grad_scale * 23 / 7.5 * missing[:, None] * p[T - K + 1:] * s[T - K + 1:] * (1 - s[T - K + 1:])
    assert not torch.allclose(dl[T - K + 1:], l.grad[T - K + 1:], rtol=1e-3, atol=0)
    torch.testing.assert_close(dl[T - K + 1:], l.grad[T - K + 1:] + extra, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("scales", [None, SCALES])
def test_pr261_ignores_the_backwards_input_and_follows_grad_scale(scales):
    """The gradient is made in the forward for grad_scale: whatever multiplies the loss afterwards
    changes nothing, and grad_scale scales dh and dH (a power of two: exactly)."""
    h, H, y = inputs(seed=24)
    y = y.clamp(0, V - 1)  # (a target outside V or past the end also counts in S_w: rows compared below)
    _, dh, dH = fused261(h, H, y, WEIGHTS[3], scales, grad_scale=0.5, g=1.0)
    _, dh7, dH7 = fused261(h, H, y, WEIGHTS[3], scales, grad_scale=0.5, g=7.0)
    assert torch.equal(dh, dh7) and torch.equal(dH, dH7)
    _, dh4, dH4 = fused261(h, H, y, WEIGHTS[3], scales, grad_scale=0.25)
    assert torch.equal(dh4 * 2, dh) and torch.equal(dH4 * 2, dH)
    ref_dh = reference(h, H, y, WEIGHTS[3], g=0.5)[1]
    # the derivative (times 0.5) up to the variant's roundings, but on the last 2 rows
    assert rel(dh[:T - 2], ref_dh[:T - 2]) < (0.1 if scales else 0.01)


def test_pr261_arguments_are_checked():
    h, H, y = inputs(seed=25)
    with pytest.raises(ValueError, match="grad_scale"):
        tg.fused_softcap_ce(h, H, y, variant="pr261")
    with pytest.raises(ValueError, match="grad_scale"):
        tg.fused_softcap_ce(h, H, y, grad_scale=1.0)
    with pytest.raises(ValueError, match="variant 'pr999'"):
        tg.fused_softcap_ce(h, H, y, variant="pr999")


def test_pr261_compiles_as_opaque_ops():
    h, H, y = inputs(seed=26)
    w = torch.tensor([1.0, 0.5])
    run = lambda a, b: tg.fused_softcap_ce(a, b, y, w, False, SCALES, variant="pr261", grad_scale=0.5)
    outs = []
    for f in (torch.compile(run, backend="aot_eager", fullgraph=True), run):
        a, b = h.clone().requires_grad_(), H.clone().requires_grad_()
        f(a, b).backward()
        outs.append((a.grad, b.grad))
    assert all(torch.equal(x, z) for x, z in zip(*outs))


def test_without_the_fused_loss_the_variant_changes_nothing():
    """So `--recipe mudd --fused_softcap_ce=false` ablates the fused loss alone: the model's loss is
    bulk's, whatever --fused_ce_variant says."""
    losses = []
    for variant in ("pr252", "pr261"):
        model = tiny_model(fused_softcap_ce=False, fused_ce_variant=variant)
        losses.append(model_loss_and_grads(model, True)[0])
    assert torch.equal(*losses)


def test_pr261_two_micro_steps_equal_one_slice_each():
    """The model passes grad_scale = 1/batch_slices, the factor the trainer applies (train_loss_scale):
    two slices accumulated with it give the mean of each slice's gradient at grad_scale 1, exactly
    (the FP8 codes do not depend on it; the products scale by a power of two)."""
    overrides = dict(fused_softcap_ce=True, fused_ce_variant="pr261", fp8=True)
    two = tiny_model(batch_slices=2, **overrides)
    one = tiny_model(batch_slices=1, batch_schedule=(512,) * 12, **overrides)
    with torch.no_grad():
        for p in two.head.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    one.load_state_dict(two.state_dict())
    gen = torch.Generator().manual_seed(12)
    T_, mtp = two.config.train_seq_len, torch.tensor([1.0, 0.5, 0.25])
    slices = [torch.randint(0, 500, (T_ + 1,), generator=gen) for _ in range(2)]
    assert tg.train_loss_scale(two.config) == 0.5
    for model in (two, one):
        model.train()
    for tokens in slices:
        (two(tokens[:-1].int(), tokens[1:], torch.tensor([3, 1]), mtp_weights=mtp)
         * tg.train_loss_scale(two.config)).backward()
    each = []
    for tokens in slices:
        one.zero_grad()
        one(tokens[:-1].int(), tokens[1:], torch.tensor([3, 1]), mtp_weights=mtp).backward()
        each.append({n: p.grad.clone() for n, p in one.named_parameters() if p.grad is not None})
    got = {n: p.grad for n, p in two.named_parameters() if p.grad is not None}
    assert got.keys() == each[0].keys() and "head.weight" in got
    for name in got:
        torch.testing.assert_close(got[name], (each[0][name] + each[1][name]) / 2, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_runners_gradient_with_pr261_is_the_loss_gradient(reduction, monkeypatch):
    """Runner.train_step over two slices: the gradients it steps with under pr261 are pr252's (the
    derivative of its scaled loss) up to the bf16 sigmoid and the last rows; a grad_scale that missed
    the trainer's 1/2 or the mean's 1/T would be 2x or 512x off."""
    grads = {}
    for variant in ("pr252", "pr261"):
        config = tg.make_config("tiny", dtype="float32", untie_embed_after_step=0, fused_softcap_ce=True,
                                fused_ce_variant=variant, train_loss_reduction=reduction, **FOUR_BLOCKS)
        runner = tg.Runner(config, torch.device("cpu"))
        with torch.no_grad():
            runner.model.head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        seen = grads.setdefault(variant, {})
        for opt in runner.optimizers:
            monkeypatch.setattr(opt, "step", lambda *a, seen=seen, model=runner.model: seen.update(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        runner.train_step(1, runner.random_batches(torch.Generator().manual_seed(4)), mtp_weights=[1.0, 0.5])
    assert grads["pr252"].keys() == grads["pr261"].keys() and "head.weight" in grads["pr261"]
    flat = {v: torch.cat([g.flatten() for g in grads[v].values()]) for v in grads}
    assert rel(flat["pr261"], flat["pr252"]) < 0.01
    for name, ref in grads["pr252"].items():  # (tiny ones, e.g. the gates' ~1e-7, are sums that cancel)
        if ref.norm() > 1e-3:
            assert 0.95 < (grads["pr261"][name].norm() / ref.norm()).item() < 1.05, name


# ---- the Triton kernel, run by Triton's interpreter on the CPU (in a process of its own: triton must
# be imported with TRITON_INTERPRET=1 set)

KERNEL_SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import train_gpt_medium as tg
import triton_kernels as kernels
logits, cols, wts, lse, g, s_g, lse261, s_w_all = torch.load(sys.argv[2])
out = {"rows": kernels._fused_ce_rows_triton(logits, cols, wts, block=32),
       "rows261": kernels._fused_ce_rows_triton(logits, cols, wts, block=32, variant="pr261")}
for name, scale, dtype in (("bf16", 1.0, torch.float32), ("e5m2", s_g, torch.float32),
                           ("e5m2_rounded", s_g, torch.float8_e5m2)):
    out[name] = kernels._fused_ce_dlogits_triton(logits, lse, cols, wts, g, scale, dtype, block=32)
for name, scale, dtype in (("261", s_g, torch.float32), ("261_rounded", s_g, torch.float8_e5m2),
                           ("261_saturated", 1e-7, torch.float8_e5m2)):
    out[name] = kernels._fused_ce_dlogits_triton(logits, lse261, cols, wts, g, scale, dtype, block=32,
                                            variant="pr261", s_w_all=s_w_all)
for name, dtype in (("261_one_pass", torch.float32), ("261_one_pass_rounded", torch.float8_e5m2)):
    out[name] = kernels._fused_ce261_rows_dlogits_triton(logits, cols, wts, g, s_g, dtype, s_w_all, block=32)
    out[name + "_two_kernels"] = kernels._fused_ce_dlogits_triton(logits, out["rows261"][1], cols, wts, g, s_g,
                                                                  dtype, block=32, variant="pr261", s_w_all=s_w_all)
torch.save(out, sys.argv[3])
"""


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    """(inputs, the kernel's outputs): T = 16 rows, V = 100 columns in 32-column blocks (three whole
    blocks and a 4-column tail: the column masks, the running max and sum across blocks, the one-pass
    kernel's loop), three MTP weights (the last 2 rows with fewer terms), targets past V and one
    negative; upstream gradient 1.25. Small because the interpreter runs each program in Python: every
    path of the kernels is there at 16 x 100 as at any size (48 x 500 in 128-column blocks cost 4x)."""
    pytest.importorskip("triton")
    h, H, y = inputs(seed=12, rows=16, cols=100)
    logits = (h @ H.t() * 3).bfloat16()
    cols, wts = kernels.fused_ce_terms(y, torch.tensor([1.0, 0.5, 0.25]), 100)
    lse = kernels._fused_ce_rows_torch(logits, cols, wts)[1]
    lse261 = kernels._fused_ce_rows_torch(logits, cols, wts, variant="pr261")[1]
    given = (logits, cols, wts, lse, torch.tensor(1.25), SCALES[2], lse261, torch.tensor(1.75))
    folder = tmp_path_factory.mktemp("kernel")
    torch.save(given, folder / "in.pt")
    subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, str(Path(tg.__file__).parent), str(folder / "in.pt"),
                    str(folder / "out.pt")], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    return given, torch.load(folder / "out.pt")


def test_the_kernels_forward_equals_the_emulation(kernel_run):
    (logits, cols, wts, *_), out = kernel_run
    loss, lse = out["rows"]
    ref_loss, ref_lse = kernels._fused_ce_rows_torch(logits, cols, wts)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_the_kernels_gradient_equals_the_emulation(kernel_run):
    """Compared unrounded (the kernel's fp32 output) and after torch's casts: the interpreter's own
    fp32 -> bf16 cast truncates and its e5m2 cast errs in places (below); the GPU's conversions
    round to nearest even."""
    (logits, cols, wts, lse, g, s_g, *_), out = kernel_run
    for name, scale, dtype, step in (("bf16", 1.0, torch.bfloat16, 2**-8), ("e5m2", s_g, torch.float8_e5m2, 2**-2)):
        kernel = out[name]
        exact = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, scale, torch.float32)
        torch.testing.assert_close(kernel, exact, rtol=1e-5, atol=1e-12)
        codes = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, scale, dtype).float()
        ours = kernel.to(dtype).float()
        assert ((ours - codes).abs() <= step * codes.abs()).all()  # at most one code apart
        assert (ours != codes).float().mean() < 1e-3
    # the kernel's own e5m2 rounding: equal to torch's but where the interpreter's cast errs (measured
    # with triton 3.9: a value that rounds up to a power of two, and rounding up among the subnormals)
    rounded = out["e5m2_rounded"]
    assert rounded.dtype == torch.float8_e5m2
    codes = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, s_g, torch.float8_e5m2).float()
    wrong = rounded.float() != codes
    rounds_up = out["e5m2"].abs() < codes.abs()
    interpreter_errs = rounds_up & ((torch.frexp(codes)[0].abs() == 0.5) | (codes.abs() <= 2**-14))
    assert not (wrong & ~interpreter_errs).any() and wrong.float().mean() < 0.1


def test_the_kernels_pr261_forward_equals_the_emulation(kernel_run):
    """sigma rounded to bf16 in the kernel through its bits (the interpreter's own cast truncates); the
    kernel's sigma is tl.sigmoid, the emulation's 0.5 + 0.5 tanh(u/2): equal after the rounding here."""
    (logits, cols, wts, *_), out = kernel_run
    loss, lse = out["rows261"]
    ref_loss, ref_lse = kernels._fused_ce_rows_torch(logits, cols, wts, variant="pr261")
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lse, out["rows"][1], rtol=1e-5, atol=0)  # not the fp32 sigmoid's


def test_the_kernels_pr261_gradient_equals_the_emulation(kernel_run):
    """S_w = 1.75 on every row (the weights sum to 1.75 but the last rows have fewer terms); e5m2 codes
    as torch's cast but where the interpreter's cast errs; saturated at 57344 where torch's gives inf."""
    (logits, cols, wts, _, g, s_g, lse261, s_w_all), out = kernel_run
    emulate = lambda scale, dtype: kernels._fused_ce_dlogits_torch(logits, lse261, cols, wts, g, scale, dtype,
                                                              variant="pr261", s_w_all=s_w_all)
    exact = emulate(s_g, torch.float32)
    torch.testing.assert_close(out["261"], exact, rtol=1e-5, atol=1e-12)
    # (a kernel summing only the row's weights would be 1.5 / 1.75 of this on the rows with fewer terms)
    for name, scale in (("261_rounded", s_g), ("261_saturated", 1e-7)):
        rounded, codes = out[name], emulate(scale, torch.float8_e5m2).float()
        assert rounded.dtype == torch.float8_e5m2 and rounded.float().isfinite().all()
        unrounded = emulate(scale, torch.float32)
        wrong = rounded.float() != codes
        rounds_up = unrounded.abs() < codes.abs()
        interpreter_errs = rounds_up & ((torch.frexp(codes)[0].abs() == 0.5) | (codes.abs() <= 2**-14))
        assert not (wrong & ~interpreter_errs).any() and wrong.float().mean() < 0.1
    assert (out["261_saturated"].float().abs() == E5M2_MAX).any()


def test_the_one_pass_pr261_kernel_is_the_two_kernels_bit_for_bit(kernel_run):
    """CUDA's pr261 forward is one program per row (#261's one kernel: the logits leave memory once):
    its loss, LSE and gradient (unrounded and as e5m2 codes) are the two kernels' one after the other."""
    _, out = kernel_run
    for name in ("261_one_pass", "261_one_pass_rounded"):
        (loss, lse, dl), two_kernels = out[name], out[name + "_two_kernels"]  # the latter from rows261's LSE
        assert torch.equal(loss, out["rows261"][0]) and torch.equal(lse, out["rows261"][1])
        assert dl.dtype == two_kernels.dtype and torch.equal(dl.view(torch.uint8), two_kernels.view(torch.uint8))


INTERPRETER_CASTS = """
import torch
import triton
import triton.language as tl


@triton.jit
def cast_kernel(x_ptr, bf16_ptr, e5m2_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(bf16_ptr + i, x.to(tl.bfloat16))
    tl.store(e5m2_ptr + i, x.to(tl.float8e5, fp_downcast_rounding="rtne"))


x = torch.tensor([1 + 3 * 2**-9, -(1 + 3 * 2**-9), 1.9, 1.6 * 2**-16, 1.0, 0.875, -3.0, 0.0], dtype=torch.float32)
bf16, e5m2 = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float8_e5m2)
cast_kernel[(1,)](x, bf16, e5m2, N=8)
torch.save(dict(x=x, bf16=bf16, e5m2=e5m2), "casts.pt")
"""


def test_the_interpreters_own_casts_truncate_so_the_kernel_tests_compare_before_them(tmp_path):
    """Why the kernel tests above compare the kernels' fp32 results, and round them with torch: Triton's
    interpreter casts fp32 to bf16 by dropping the low 16 bits (1 + 3 x 2^-9 -> 1, where the GPU and
    torch round to nearest even, 1 + 2^-7), and to e5m2 with round-to-nearest-even asked for it still
    truncates among the subnormals (1.6 x 2^-16 -> 2^-16, not 2 x 2^-16). Exact values stay exact. The
    kernels' own bf16 rounding (bf16_rounded, through the bits) does not use the cast."""
    pytest.importorskip("triton")
    (tmp_path / "casts.py").write_text(INTERPRETER_CASTS)  # Triton reads a kernel's source from its file
    subprocess.run([sys.executable, "casts.py"], cwd=tmp_path, check=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                   timeout=600)
    out = torch.load(tmp_path / "casts.pt")
    x = out["x"]
    truncated = (x.view(torch.int32) & -65536).view(torch.float32)
    assert torch.equal(out["bf16"].float(), truncated)
    assert not torch.equal(out["bf16"].float(), x.bfloat16().float())  # torch (and a GPU) round to nearest
    e5m2, rne = out["e5m2"].float(), x.to(torch.float8_e5m2).float()
    assert e5m2[3] == 2**-16 and rne[3] == 2 * 2**-16
    assert torch.equal(e5m2[[0, 1, 4, 5, 6, 7]], rne[[0, 1, 4, 5, 6, 7]])
