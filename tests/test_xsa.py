"""--xsa_layers and --xsa_lr (PRs #264 and #317, docs/short-track-transfer.md section 1): zero alphas
give the plain model bit for bit, the formula against a float64 loop and against #264's form, its
gradients against autograd, which blocks it touches, its Adam group, and validation."""
import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import assert_traces_as_one_graph, fill_random, packed, train_loss_and_grads

WINDOW = torch.tensor([3, 1])
ALL = tuple(range(16))


def tiny(**overrides):
    return tg.make_config("tiny", **{"dtype": "float32", **overrides})


def pair(dtype=torch.float32, layers=ALL, seed=0):
    """(plain model, XSA model) on the same random weights, every alpha zero."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    models = []
    for config in (tiny(dtype=name), tiny(dtype=name, xsa_layers=layers)):
        model = tg.build_model(config)
        fill_random(model, seed)
        models.append(model)
    with torch.no_grad():
        for block in models[1].blocks:
            if block.attn.xsa is not None:
                block.attn.xsa.alpha.zero_()
    return models


def set_alphas(model, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.xsa is not None:
                block.attn.xsa.alpha.copy_(torch.randn(block.attn.xsa.alpha.shape, generator=gen) * scale)


def loss_and_grads(model, config):
    return train_loss_and_grads(model, config, WINDOW)


def xsa_loop(y, v, alpha):
    """The formula token by token and head by head, in float64."""
    y, v, a = y.double(), v.double(), torch.tanh(alpha.double())
    out = torch.empty_like(y)
    B, T, H, _ = y.shape
    for b in range(B):
        for t in range(T):
            for h in range(H):
                yy, vv = y[b, t, h], v[b, t, h]
                out[b, t, h] = yy - a[h] * (yy @ vv) / max(float(vv @ vv), 1e-8) * vv
    return out


def xsa_264(y, v, alpha):
    """#264's form: v_hat = v / max(|v|, 1e-4), y - a (y . v_hat) v_hat."""
    v_hat = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-4)
    a = torch.tanh(alpha).type_as(y).view(1, 1, -1, 1)
    return y - a * (y * v_hat).sum(-1, keepdim=True) * v_hat


def random_yv(dtype=torch.float64, seed=0, B=2, T=5, H=3, D=8):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    v[0, 1, 2] = 0.0  # exactly zero: the floor of |v|^2 keeps the result y
    v[1, 3] = 0.0
    v[1, 4, 0] = 1e-6  # tiny, |v|^2 below the floor
    alpha = torch.randn(H, generator=gen, dtype=dtype)
    return y, v, alpha


# ---- zero alphas are the plain model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_alphas_give_the_plain_models_loss_and_every_shared_gradient_bit_for_bit(dtype):
    plain, xsa = pair(dtype)
    config = tiny()
    loss_plain, grads_plain = loss_and_grads(plain, config)
    loss_xsa, grads_xsa = loss_and_grads(xsa, config)
    assert torch.equal(loss_plain, loss_xsa)
    assert set(grads_xsa) - set(grads_plain) == {f"blocks.{i}.attn.xsa.alpha" for i in ALL}
    for name, g in grads_plain.items():
        assert torch.equal(g, grads_xsa[name]), name
    assert all(grads_xsa[f"blocks.{i}.attn.xsa.alpha"].abs().sum() > 0 for i in ALL)  # it learns from step 0


def test_off_builds_nothing():
    with torch.device("meta"):
        model = tg.GPT(tiny())
    assert all(block.attn.xsa is None for block in model.blocks)
    assert not any("xsa" in name for name, _ in model.named_parameters())


# ---- the formula


def test_the_formula_against_a_float64_loop_with_zero_values():
    y, v, alpha = random_yv()
    out = tg.xsa(y, v, alpha)
    assert torch.allclose(out, xsa_loop(y, v, alpha), rtol=0, atol=1e-12)
    assert torch.equal(out[0, 1, 2], y[0, 1, 2]) and torch.equal(out[1, 3], y[1, 3])  # v = 0: y unchanged
    y32, v32, a32 = (t.float() for t in (y, v, alpha))
    assert torch.allclose(tg.xsa(y32, v32, a32).double(), xsa_loop(y32, v32, a32), rtol=1e-5, atol=1e-5)


def test_a_bf16_input_is_computed_in_bf16_with_tanh_alpha_rounded_to_bf16():
    y, v, alpha = (t.float() for t in random_yv())
    yb, vb = y.bfloat16(), v.bfloat16()
    out = tg.xsa(yb, vb, alpha)
    assert out.dtype == torch.bfloat16
    a = torch.tanh(alpha).bfloat16().view(1, 1, -1, 1)
    want = yb - a * ((yb * vb).sum(-1, keepdim=True) / (vb * vb).sum(-1, keepdim=True).clamp_min(1e-8)) * vb
    assert torch.equal(out, want)


def test_pr_317s_form_equals_pr_264s():
    y, v, alpha = random_yv()
    assert torch.allclose(tg.xsa(y, v, alpha), xsa_264(y, v, alpha), rtol=0, atol=1e-12)
    y, v, alpha = (t.float() for t in (y, v, alpha))
    assert torch.allclose(tg.xsa(y, v, alpha), xsa_264(y, v, alpha), rtol=1e-5, atol=1e-5)


def test_its_gradients_against_autograd_in_float64():
    y, v, alpha = (t.requires_grad_() for t in random_yv())
    assert torch.autograd.gradcheck(tg.xsa, (y, v, alpha))
    alpha0 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    y, v, _ = random_yv()
    assert torch.autograd.gradcheck(tg.xsa, (y.requires_grad_(), v.requires_grad_(), alpha0))
    # at alpha 0: dL/dalpha_h = -sum_(b,t) g . (y.v / |v|^2) v, nonzero
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (tg.xsa(y, v, alpha0) * g).sum().backward()
    want = -((g * v).sum(-1) * (y * v).sum(-1) / (v * v).sum(-1).clamp_min(1e-8)).sum(dim=(0, 1))
    assert torch.allclose(alpha0.grad, want, rtol=1e-12, atol=1e-12) and (alpha0.grad != 0).all()


# ---- where it acts


def test_only_the_listed_blocks_change(monkeypatch):
    plain, xsa = pair(layers=(3, 9))
    assert [name for name, _ in xsa.named_parameters() if "xsa" in name] == [
        "blocks.3.attn.xsa.alpha", "blocks.9.attn.xsa.alpha"]
    set_alphas(xsa)
    seen = {}
    for tag, model in (("plain", plain), ("xsa", xsa)):
        for i, block in enumerate(model.blocks):
            block.attn.register_forward_hook(lambda m, args, out, i=i, tag=tag: seen.__setitem__((tag, i), (args, out)))
        inputs, targets = packed(tiny())
        with torch.no_grad():
            model.eval()(inputs, targets, WINDOW)
    for i in range(4):  # up to block 3 both see the same inputs; block 3's attention output differs
        (args_p, out_p), (args_x, out_x) = seen["plain", i], seen["xsa", i]
        assert torch.equal(args_p[0], args_x[0])
        assert torch.equal(out_p, out_x) == (i != 3), i
    # block 9, on the XSA model's own input, against the plain attention with the formula applied by hand
    args, out = seen["xsa", 9]
    attn = xsa.blocks[9].attn
    captured = {}
    real_attend = tg.attend

    def attend(q, k, v, *rest):
        y = real_attend(q, k, v, *rest)
        captured["y"], captured["v"] = y, v
        return y

    saved = attn.xsa
    monkeypatch.setattr(attn, "xsa", None)
    monkeypatch.setattr(tg, "attend", attend)
    with torch.no_grad():
        attn(*args)
    # redo the tail of the forward with the hand-applied formula
    x, a = args
    B, T = x.shape[:2]
    y = xsa_loop(captured["y"], captured["v"], saved.alpha.detach()).float()
    y = y * torch.sigmoid(attn.output_gate(x)).view(B, T, attn.num_heads, 1)
    want = torch.nn.functional.linear(y.reshape(B, T, -1), a.lambdas[1] * attn.qkvo_w[3])
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe,layer", [("bulk", 1), ("mudd", 15)])
def test_the_alpha_sees_the_value_after_the_value_embedding_and_mudds_value_mix(monkeypatch, recipe, layer):
    """Block 1 has a value embedding, --recipe mudd's last block also MUDD's value mix: the v XSA
    projects on is the v the block attended with, everything added."""
    config = tg.make_config("tiny", recipe=recipe, dtype="float32", xsa_layers=(layer,))
    assert config.value_embed_tables[layer] is not None
    model = tg.build_model(config)
    fill_random(model)
    seen, attended, real, real_attend = [], [], tg.xsa, tg.attend
    monkeypatch.setattr(tg, "xsa", lambda y, v, alpha: seen.append(v) or real(y, v, alpha))
    monkeypatch.setattr(tg, "attend", lambda q, k, v, *rest: attended.append(v) or real_attend(q, k, v, *rest))
    inputs, targets = packed(config)
    with torch.no_grad():
        model.eval()(inputs, targets, WINDOW)
    assert len(seen) == 1 and seen[0] is attended[layer]  # that block's attention: the v it attended with
    ve = model.value_embeds(inputs)[layer]
    assert ve is not None and ve.abs().sum() > 0  # the embedding is there and not zero


@pytest.mark.parametrize("flags,words", [
    (["--xsa_layers=16"], "--xsa_layers: block 16 does not exist"),
    (["--xsa_layers=2,7", "--attention_free_layers=7"], "--xsa_layers: block 7 has no attention"),
])
def test_a_block_out_of_range_or_without_attention_is_refused_in_one_line(flags, words, refusal_of):
    assert words in refusal_of(*flags)


def test_xsa_lr_without_xsa_layers_is_noted():
    notes = tg.inert_setting_notes(tiny(xsa_lr=0.01))
    assert any("--xsa_lr=0.01 has no effect without --xsa_layers" in n for n in notes)


# ---- its optimizer


@pytest.mark.parametrize("lr", [None, 0.01])
def test_the_alphas_step_in_their_own_adam_group_with_its_lr_betas_and_no_decay(lr):
    config = tiny(xsa_layers=(0, 5), **({} if lr is None else dict(xsa_lr=lr)))
    model = tg.build_model(config)
    adam = tg.build_optimizers(model, config, 0, 1)[0]
    group = next(g for g in adam.param_groups if g["name"] == "xsa")
    alphas = [model.blocks[i].attn.xsa.alpha for i in (0, 5)]
    assert group["params"] == alphas and group["lr"] == (lr or 0.004)
    assert [(p.lr_mul, p.wd_mul, p.betas, p.dtype) for p in alphas] == [(1.0, 0.0, (0.9, 0.95), torch.float32)] * 2
    ids = {id(p) for p in alphas}
    assert not any(id(p) in ids for g in adam.param_groups if g["name"] != "xsa" for p in g["params"])
    set_alphas(model, scale=0.3)  # away from zero, so a decay would show
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = None
    wants = []
    for p in alphas:
        p.grad = torch.randn(p.shape, generator=gen)
        want, state = p.detach().clone(), dict(step=0, exp_avg=torch.zeros(p.shape), exp_avg_sq=torch.zeros(p.shape))
        tg.cautious_adam_step(want, p.grad, state, lr or 0.004, 0.9, 0.95, config.adam_eps, 0.0, 0.0)
        wants.append(want)
    adam.step()
    for p, want in zip(alphas, wants):
        assert torch.equal(p.detach(), want)
        assert adam.state[p]["step"] == 1


def test_validation_uses_it():
    config, plain_config = tiny(xsa_layers=ALL), tiny()
    gen = torch.Generator().manual_seed(5)
    val = torch.randint(0, config.vocab_size, (config.val_tokens + 1,), generator=gen)
    runners = [tg.Runner(c, torch.device("cpu")) for c in (plain_config, config)]
    for runner in runners:
        fill_random(runner.model)
    plain_loss, _ = runners[0].evaluate(0, val)
    with torch.no_grad():
        for block in runners[1].model.blocks:
            block.attn.xsa.alpha.zero_()
    assert runners[1].evaluate(0, val)[0] == plain_loss
    set_alphas(runners[1].model, scale=1.0)
    assert runners[1].evaluate(0, val)[0] != plain_loss


def test_the_mudd_recipes_dry_run_counts_one_alpha_per_head_and_block(capsys):
    import json
    assert tg.main(["--dry_run", "--recipe=mudd", "--xsa_layers=" + ",".join(map(str, range(12)))]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["params_by_group"]["xsa"] == 12 * 8
    assert summary["total_params"] == 871_110_088 + 96


def test_the_predicted_peak_adds_three_kept_head_tensors_per_xsa_block():
    """The memory model's estimate for --xsa_layers: XSA_KEPT_PER_HEAD (T, H) bf16 tensors per listed
    block at the full batch's slice (T = 65,536 tokens, H = 8): 3 MiB a block."""
    base = tg.make_config(recipe="mudd")
    parts = tg.peak_parts(base)
    with_xsa = tg.peak_parts(tg.make_config(recipe="mudd", xsa_layers=tuple(range(12))))
    assert with_xsa["training"] - parts["training"] == 12 * 3 * 65_536 * 8 * 2
    assert with_xsa["state"] - parts["state"] == 96 * 4 * 4  # alpha, its gradient, Adam's two fp32 moments


def test_the_xsa_forward_traces_into_one_graph():
    """Static shapes and no host syncs: --recipe mudd's training forward with every block's XSA (the
    plain loss) and its gradients, traced whole, equal the eager ones."""
    config = tg.make_config("tiny", recipe="mudd", dtype="float32", fused_softcap_ce=False, xsa_layers=ALL)
    model = tg.build_model(config)
    fill_random(model)
    assert_traces_as_one_graph(model, config, [block.attn.xsa.alpha for block in model.blocks], WINDOW)
