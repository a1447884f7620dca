"""--attn_input_from_layer and --mudd (PR #261, docs/mudd.md) and --recipe mudd: each switch's
neutral setting against the plain model, the whole forward against a plain layer-by-layer loop
written from the description, the starting coefficients in bf16, the parameters and their Adam
settings, the recipe's values and step grid."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
from test_bulk_model import assert_traces_as_one_graph, fill_random, packed
from test_mudd_gate import SEVEN_BLOCKS

ROOT = Path(__file__).resolve().parent.parent
WINDOW = torch.tensor([3, 1])
L = 16
NO_VE_AT_LAST = (0, 1, 2, 3, 4) + (None,) * 6 + (0, 1, 2, 3, None)  # the last block without a value embedding


def tiny(recipe="mudd", **overrides):
    return tg.make_config("tiny", recipe=recipe, **{"dtype": "float32", **overrides})


def eval_losses(model, config):
    inputs, targets = packed(config)
    with torch.no_grad():
        return model.eval()(inputs, targets, WINDOW, reduction="none")


def plain_last_block(model):
    """The last block's input mixing made x itself: rho = 1, every embedding weight and gamma 0."""
    with torch.no_grad():
        model.scalar_slots()["resid"][L - 1] = 1.0
        model.x0_lambdas.view(L, -1)[L - 1] = 0.0
        if model.bigram is not None:
            model.bigram.lambdas[L - 1] = 0.0


# ---- the neutral settings give the plain model


def test_mudd_weights_that_pass_the_stream_give_the_plain_residual_stream(monkeypatch):
    """W2 = 0 and a scale of 1, biases r = p = 1 and everything else 0: the penultimate mix keeps h,
    the value mix is 0, the last block is x + Attn then x + MLP and the final mix adds nothing; the
    plain model (no MUDD, no backout) with its last block's mixing at x gives the same losses. The
    last block has no value embedding here (the MUDD gate starts at 2, the plain one at 1)."""
    monkeypatch.setattr(tg, "MUDD_SCALE", 1.0)
    with_mudd = tiny(attn_input_from_layer=None, value_embed_layout=NO_VE_AT_LAST)
    plain = tiny(attn_input_from_layer=None, value_embed_layout=NO_VE_AT_LAST, mudd=False)
    a, b = tg.build_model(with_mudd), tg.build_model(plain)
    for model in (a, b):
        fill_random(model)
        plain_last_block(model)
    with torch.no_grad():
        a.mudd.w2.zero_()
        a.mudd.bias.zero_()
        a.mudd.bias[0, :, 4:6] = 1.0
    assert torch.equal(eval_losses(a, with_mudd), eval_losses(b, plain))
    with torch.no_grad():
        a.mudd.bias[1, 1, 4] = 0.125  # the final mix's block-4 weight: no longer the plain stream
    assert not torch.equal(eval_losses(a, with_mudd), eval_losses(b, plain))


def test_the_cached_attention_input_equals_the_stream_where_they_coincide():
    """With the last block's mixing at x and no skip into it, the last block's input is block 14's
    output: attending from it (--attn_input_from_layer=14) is the plain model. From block 11 it is not."""
    losses = {}
    for source in (None, 14, 11):
        config = tiny("bigram", attn_input_from_layer=source)
        model = tg.build_model(config)
        fill_random(model)
        plain_last_block(model)
        losses[source] = eval_losses(model, config)
    assert torch.equal(losses[14], losses[None])
    assert not torch.allclose(losses[11], losses[None])


# ---- the whole forward against a plain loop


def reference_losses(model, config, inputs, targets):
    """#261's forward layer by layer (i = 0..15), in fp32 from the model's own tensors:
    skips into 9, 10, 11; input mixing except at 15; attention from norm(h_11) after block 11, at 15
    with the value mix and gate; at 15 the dynamic weights; MUDD after 14 and after 15; norm, head."""
    cfg, m = config, model
    T = inputs.numel()
    long_mask, short_mask = tg.token_window_masks(inputs, WINDOW[0], WINDOW[1], cfg, "sdpa")
    cos, sin = m.rotary.cos[:T], m.rotary.sin[:T]
    scale = m.rotary.scale_value
    x0s = m.input_embeddings(inputs)
    x00 = x0s[0]
    ves = m.value_embeds(inputs)
    b, gammas = m.bigram(inputs)
    slots = m.scalar_slots()
    rho, alphas = m.mixing_weights()
    lambdas = slots["attn_lambdas"].view(L, 2)
    W1, W2, bias, s = m.mudd.w1.float(), m.mudd.w2.float(), m.mudd.bias.float(), 0.2 / 3 ** 0.5
    H, D = cfg.num_heads, cfg.head_dim
    h, x, dyn = {}, x00, None
    for i, block in enumerate(m.blocks):
        if i in (9, 10, 11):
            x = x + m.skip_weight(i, x00, slots) * h[{9: 6, 10: 4, 11: 2}[i]]
        if i != 15:
            x = (rho[i] + alphas[i, 0]) * x if i == 0 else rho[i] * x + alphas[i, 0] * x00
            for k in range(1, len(x0s)):
                x = x + alphas[i, k] * x0s[k]
            x = x + gammas[i] * b
        attn_in = h[11] if i > 11 else x
        mask = long_mask if i in (0, 4, 11, 15) else short_mask
        attn = tg.AttentionArgs(ves[i], lambdas[i], cos, sin, mask, scale, None)
        if i == 15:
            y = block.attn(tg.rms_norm(attn_in), attn._replace(v_extra=dyn["v"].view(1, T, H, D), ve_gate=dyn["gate"]))
            x = dyn["r_a"] * x + dyn["p_a"] * y + dyn["chi"] * x00 + dyn["psi"] * b
            x = dyn["r_m"] * x + dyn["p_m"] * block.mlp(tg.rms_norm(x))
        else:
            x = x + block.attn(tg.rms_norm(attn_in), attn)
            x = x + block.mlp(tg.rms_norm(x))
        h[i] = x
        if i == 14:
            a = F.gelu(torch.einsum("btd,hd->bth", x, W1[0]))
            C = (torch.einsum("bth,hcj->btcj", a, W2[0]) + bias[0]) * s  # (1, T, 2, 8)
            col = lambda c, j: C[..., c, j, None]
            gate = torch.cat([(C[..., 0, 3, None] + 2).expand(1, T, H // 2),
                              (C[..., 1, 3, None] + 2).expand(1, T, H // 2)], dim=-1)[..., None]
            dyn = dict(v=1.15 * (col(0, 0) * x00 + col(0, 1) * h[11] + col(0, 2) * x), gate=gate,
                       r_a=col(0, 4), p_a=col(0, 5), r_m=col(1, 4), p_m=col(1, 5), chi=col(0, 6), psi=col(0, 7))
            x = (1 + col(1, 2)) * x + col(1, 0) * x00 + col(1, 1) * h[11]
    a = F.gelu(torch.einsum("btd,hd->bth", x, W1[1]))
    e = (torch.einsum("bth,hj->btj", a, W2[1, :, 1, :5]) + bias[1, 1, :5]) * s
    sources = (x00, h[11], h[14], ves[0][None], h[4])
    for j, src in enumerate(sources):
        x = x + e[..., j, None] * src
    x = tg.rms_norm(x[0])
    return F.cross_entropy(m.logits(x).float(), targets, reduction="none")


def test_the_mudd_forward_equals_a_plain_layer_by_layer_loop():
    config = tiny()
    model = tg.build_model(config)
    fill_random(model)  # every MUDD weight random too (W2 not zero, biases about 0.5)
    inputs, targets = packed(config)
    got = eval_losses(model, config)
    with torch.no_grad():
        want = reference_losses(model, config, inputs, targets)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_the_penultimate_mix_against_a_token_by_token_loop():
    """The value mix, the stream, the gate per head (first half of the heads from row 0, second from
    row 1) and the six weights, token by token in float64, on random inputs and weights."""
    config = tiny(num_heads=4, head_dim=16)
    mudd = tg.build_model(config).mudd
    fill_random(mudd)
    gen = torch.Generator().manual_seed(3)
    T, d = 7, config.model_dim
    h, x00, h_b, bigram = (torch.randn(1, T, d, generator=gen) for _ in range(4))
    x, mix = mudd.penultimate(h, x00, h_b, bigram)
    W1, W2, bias = (p.double() for p in (mudd.w1, mudd.w2, mudd.bias))
    s = 0.2 / 3 ** 0.5
    for t in range(T):
        ht = h[0, t].double()
        a = [0.5 * v * (1 + torch.erf(v / 2 ** 0.5)) for v in W1[0] @ ht]
        Dt = torch.zeros(2, 8, dtype=torch.float64)
        for c in range(2):
            for j in range(8):
                Dt[c, j] = (sum(a[k] * W2[0, k, c, j] for k in range(64)) + bias[0, c, j]) * s
        v = 1.15 * (Dt[0, 0] * x00[0, t] + Dt[0, 1] * h_b[0, t] + Dt[0, 2] * ht)
        stream = (1 + Dt[1, 2]) * ht + Dt[1, 0] * x00[0, t] + Dt[1, 1] * h_b[0, t]
        torch.testing.assert_close(mix.v[0, t].reshape(-1).double(), v, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x[0, t].double(), stream, rtol=1e-5, atol=1e-6)
        gates = [Dt[0, 3] + 2, Dt[0, 3] + 2, Dt[1, 3] + 2, Dt[1, 3] + 2]
        torch.testing.assert_close(mix.ve_gate[0, t, :, 0].double(), torch.stack(gates), rtol=1e-5, atol=1e-6)
        named = (mix.resid_attn, mix.out_attn, mix.resid_mlp, mix.out_mlp, mix.x00_weight, mix.bigram_weight)
        for got, (c, j) in zip(named, ((0, 4), (0, 5), (1, 4), (1, 5), (0, 6), (0, 7))):
            assert got[0, t, 0].item() == pytest.approx(Dt[c, j].item(), rel=1e-5, abs=1e-6)
    assert mix.x00 is x00 and mix.bigram is bigram


def test_the_final_mix_against_a_token_by_token_loop():
    config = tiny()
    mudd = tg.build_model(config).mudd
    fill_random(mudd, seed=1)
    gen = torch.Generator().manual_seed(4)
    T, d = 5, config.model_dim
    x, *sources = (torch.randn(1, T, d, generator=gen) for _ in range(6))
    got = mudd.final(x, *sources)
    W1, W2, bias = (p.double() for p in (mudd.w1, mudd.w2, mudd.bias))
    s = 0.2 / 3 ** 0.5
    for t in range(T):
        a = F.gelu(W1[1] @ x[0, t].double())
        want = x[0, t].double()
        for j, src in enumerate(sources):
            e = (a @ W2[1, :, 1, j] + bias[1, 1, j]) * s
            want = want + e * src[0, t].double()
        torch.testing.assert_close(got[0, t].double(), want, rtol=1e-5, atol=1e-6)


def test_in_bf16_each_mix_is_rounded_once_from_fp32():
    """The compiled record computes each pointwise expression in fp32 and rounds its output once."""
    config = tiny(dtype="bfloat16")
    mudd = tg.build_model(config).mudd
    fill_random(mudd)
    gen = torch.Generator().manual_seed(5)
    h, x00, h_b, b = (torch.randn(1, 9, config.model_dim, generator=gen).bfloat16() for _ in range(4))
    x, mix = mudd.penultimate(h, x00, h_b, b)
    D = mudd.coefficients(0, h).float()
    want = ((1 + D[..., 1, 2:3]) * h.float() + D[..., 1, 0:1] * x00.float() + D[..., 1, 1:2] * h_b.float()).bfloat16()
    assert x.dtype == torch.bfloat16 and torch.equal(x, want)
    assert mix.v.dtype == mix.ve_gate.dtype == torch.bfloat16


# ---- the starting values


def test_the_starting_coefficients_are_the_records_bf16_values():
    """Biases stored in bf16 (-4.34375, 9.0625, 8.6875, 0.43359375) give, in a bf16 model, the h_b
    weight -0.5 (the backout's), r = 1.046875, p = 1, psi = 0.050049, gate 2 and every other 0."""
    config = tiny(dtype="bfloat16")
    model = tg.build_model(config)
    mudd = model.mudd
    assert mudd.bias[1, 1, 1].item() == -4.34375
    assert mudd.bias[0, :, 4].tolist() == [9.0625, 9.0625] and mudd.bias[0, :, 5].tolist() == [8.6875, 8.6875]
    assert mudd.bias[0, 0, 7].item() == 0.43359375 and torch.count_nonzero(mudd.bias).item() == 6
    assert torch.count_nonzero(mudd.w2).item() == 0 and mudd.w1.dtype == torch.bfloat16
    bound = config.model_dim ** -0.5
    assert mudd.w1.float().abs().max().item() <= bound and mudd.w1.float().std().item() > 0.5 * bound / 3 ** 0.5
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(1, 6, config.model_dim, generator=gen).bfloat16()
    x, mix = mudd.penultimate(h, h, h, h)
    assert (mix.resid_attn == 1.046875).all() and (mix.resid_mlp == 1.046875).all()
    assert (mix.out_attn == 1.0).all() and (mix.out_mlp == 1.0).all()
    assert (mix.bigram_weight == 0.050048828125).all() and (mix.x00_weight == 0).all()
    assert (mix.ve_gate == 2.0).all() and (mix.v == 0).all() and torch.equal(x, h)
    e = mudd.coefficients(1, h, slice(0, 5), 1)
    assert e[..., 1].eq(-0.5).all() and torch.count_nonzero(e[..., [0, 2, 3, 4]]).item() == 0
    # in fp32 the same stored biases start at the unrounded products
    D32 = mudd.coefficients(0, h.float())
    assert D32[0, 0, 0, 4].item() == pytest.approx(1.04645, abs=1e-5)


# ---- parameters and optimizer


def test_the_recipes_dry_run_counts_pr_261s_parameters(capsys):
    assert tg.main(["--dry_run", "--recipe=mudd"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total_params"] == 871_110_088
    assert summary["params_by_group"]["mudd"] == 2 * 64 * 1024 + 2 * 64 * 16 + 32


def test_without_the_backout_the_scalars_are_52_and_4_pads():
    config = tg.make_config(recipe="mudd")
    layout = dict(tg.scalar_layout(config))
    assert sum(len(v) for v in layout.values()) == 56 and len(layout["pad"]) == 4
    with torch.device("meta"):
        model = tg.GPT(config)
    assert model.backout is None and model.mudd is not None and model.scalars.numel() == 56


def test_the_mudd_weights_step_with_adam_at_a_quarter_lr_and_their_betas():
    config = tiny()
    model = tg.build_model(config)
    adam = tg.build_optimizers(model, config, 0, 1)[0]
    group = next(g for g in adam.param_groups if g["name"] == "mudd")
    mudd = model.mudd
    assert group["params"] == [mudd.w1, mudd.w2, mudd.bias] and group["lr"] == 0.004
    assert [(p.lr_mul, p.wd_mul, p.betas) for p in group["params"]] == [
        (0.25, 1.0, (0.9, 0.99)), (0.25, 1.0, (0.9, 0.99)), (0.25, 0.0, (0.9, 0.99))]
    # one step: the fp32-moment Adam with lr 0.001 and betas 0.9/0.99
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = None
    mudd.bias.grad = torch.randn(mudd.bias.shape, generator=gen).bfloat16()
    want, state = mudd.bias.detach().clone(), dict(step=0, exp_avg=torch.zeros(2, 2, 8), exp_avg_sq=torch.zeros(2, 2, 8))
    tg.fp32_adam_step(want, mudd.bias.grad, state, 0.001, 0.9, 0.99, 1e-8, config.adam_weight_decay, 0.0)
    adam.step()
    assert torch.equal(mudd.bias.detach(), want)


@pytest.mark.parametrize("flags,words", [
    (["--mudd", "--bigram_embed"], "--mudd: replaces the backout"),
    (["--mudd", "--backout=false"], "--mudd: the last block's mix adds psi x the bigram rows: add --bigram_embed"),
    (["--recipe=mudd", "--num_heads=1", "--head_dim=64"], "num_heads must be even"),
    (["--recipe=mudd", "--attention_free_layers=15", "--value_embed_layout=0,1,2,3,4,-,-,-,-,-,-,0,1,2,3,-"],
     "that block must have one"),
    (["--recipe=mudd", "--attn_input_from_layer=15"], "--attn_input_from_layer: must name a block before the last"),
])
def test_missing_pieces_are_refused_in_one_line(flags, words, refusal_of):
    assert words in refusal_of(*flags)


# ---- the recipe


def test_the_mudd_recipe_is_bigram_plus_pr_261s_values():
    config, bigram = tg.make_config(recipe="mudd"), tg.make_config(recipe="bigram")
    assert (config.num_iterations, config.extension_steps, tg.scheduled_steps(config)) == (4150, 25, 4125)
    assert (config.attn_input_from_layer, config.mudd, config.backout, config.coordinate_descent_tuning) == (
        11, True, False, False)
    assert (config.fused_ce_variant, bigram.fused_ce_variant) == ("pr261", "pr252")
    for name, value in tg.RECIPES["bigram"].values.items():
        if name not in ("num_iterations", "coordinate_descent_tuning"):
            assert getattr(config, name) == getattr(bigram, name) == value, name
    recipe = tg.RECIPES["mudd"]
    assert (recipe.claim_pr, recipe.date, recipe.runs, recipe.p_value, recipe.mean_time_s, recipe.peak_mib) == (
        261, "2026-04-27", 6, 6.2e-5, 860.478, 59_977)
    assert recipe.folder.startswith("2026-0427-MuddFormer")


def test_the_mudd_step_grid_is_pr_261s():
    """S = 4125: untie after 689; YaRN at 344, 688, 1032; the full batch and lr 2.0 from 1032 (no
    full-batch step at 1.73); momentum cooldown from s > 4100."""
    config = tg.make_config(recipe="mudd")
    assert tg.untie_step(config) == 689
    assert [step for step, _, _ in tg.yarn_changes(config)] == [344, 688, 1032]
    assert [tg.batch_tokens(s, config) for s in (343, 344, 688, 1031, 1032)] == [
        131072, 262144, 393216, 393216, 524288]
    assert [tg.lr_schedule(s, config) for s in (1031, 1032)] == [1.73, 2.0]
    assert tg.lr_schedule(1238, config) == pytest.approx(1.99967, abs=1e-5)
    assert tg.momentum_schedule(4100, config) == 0.95 and tg.momentum_schedule(4101, config) < 0.95
    assert tg.momentum_schedule(4149, config) == pytest.approx(0.852)
    assert sum(tg.batch_tokens(s, config) for s in range(4150)) == 1_905_262_592


def test_the_tiny_mudd_recipe_keeps_every_phase():
    config = tg.make_config("tiny", recipe="mudd")
    assert (config.num_iterations, config.extension_steps, tg.scheduled_steps(config)) == (167, 2, 165)
    assert len(tg.yarn_changes(config)) == 3 and 0 < tg.untie_step(config) < 165


def test_the_mudd_forward_traces_into_one_graph():
    """Static shapes and no host syncs: the training forward (with the plain loss; the fused one is
    the fresh-process test's) and its gradients, traced whole, equal the eager ones. On SEVEN_BLOCKS
    (the recipe's layout in miniature: both mixes, their sources, the blocks attending from h_b): the
    nets act per block alike at any depth, and tracing costs by the block."""
    config = tiny(fused_softcap_ce=False, **SEVEN_BLOCKS)
    model = tg.build_model(config)
    fill_random(model)
    assert_traces_as_one_graph(model, config, list(model.mudd.parameters()), WINDOW)


FRESH_PROCESS_GRAPHS = """
import torch, train_gpt_medium as tg
from test_bulk_model import fill_random, packed
from test_mudd_gate import SEVEN_BLOCKS
graphs = []
def count(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
config = tg.make_config("tiny", recipe="mudd", dtype="float32", **SEVEN_BLOCKS)
assert config.fused_softcap_ce
model = tg.build_model(config)
fill_random(model)
inputs, targets = packed(config)
loss = torch.compile(model, backend=count, dynamic=False)(inputs, targets, torch.tensor([3, 1]))
loss.backward()
print("graphs", len(graphs), "breaks", torch._dynamo.utils.counters["graph_break"].total())
"""


def test_the_recipes_model_compiles_to_one_graph_in_a_fresh_process():
    """The fused loss's custom ops are registered when the model is built, so the first compiled
    forward of a new process (nothing registered them before) is one graph with no break; were they
    registered inside it, dynamo would meet the registration and break the graph twice. On
    SEVEN_BLOCKS: the registration is the model's, not a block's."""
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS_GRAPHS], cwd=ROOT / "tests", capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["graphs", "1", "breaks", "0"], done.stdout


# ---- --mudd_nets: each net alone


def block_outputs(model, config):
    """The eval losses and each block's output (as the block returns it), from forward hooks."""
    outputs = []
    hooks = [block.register_forward_hook(lambda mod, args, out: outputs.append(out)) for block in model.blocks]
    losses = eval_losses(model, config)
    for hook in hooks:
        hook.remove()
    return losses, outputs


def test_the_final_net_alone_is_the_plain_model_plus_the_final_mix():
    """--mudd_nets=final: every block, the last one included, gives what the model without MUDD (and
    without the backout) gives on the same weights; the losses are that model's block outputs with
    the final mix applied by hand (x + e0 x00 + e1 h_b + e2 h_14 + e3 VE_0 + e4 h_4), then the norm."""
    config, plain = tiny(mudd_nets="final"), tiny(mudd=False)
    a, b = tg.build_model(config), tg.build_model(plain)
    for model in (a, b):
        fill_random(model)  # the same values by name; a's MUDD weights random too
    got, got_outputs = block_outputs(a, config)
    plain_losses, outputs = block_outputs(b, plain)
    assert len(got_outputs) == len(outputs) == L
    for mine, theirs in zip(got_outputs, outputs):
        assert torch.equal(mine, theirs)
    inputs, targets = packed(config)
    with torch.no_grad():
        W1, W2, bias, s = a.mudd.w1.float(), a.mudd.w2.float(), a.mudd.bias.float(), 0.2 / 3 ** 0.5
        x = outputs[L - 1]
        e = (torch.einsum("bth,hj->btj", F.gelu(torch.einsum("btd,hd->bth", x, W1[1])), W2[1, :, 1, :5])
             + bias[1, 1, :5]) * s
        sources = (b.input_embeddings(inputs)[0], outputs[11], outputs[14], b.value_embeds(inputs)[0][None], outputs[4])
        for j, src in enumerate(sources):
            x = x + e[..., j, None] * src
        want = F.cross_entropy(b.logits(tg.rms_norm(x[0])).float(), targets, reduction="none")
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(got, plain_losses)  # the final mix does act
    both = tiny()  # and with the penultimate net on, the last block is not the plain one
    c = tg.build_model(both)
    fill_random(c)
    assert not torch.equal(block_outputs(c, both)[1][L - 1], outputs[L - 1])


def mudd_grads(nets, **overrides):
    config = tiny(mudd_nets=nets, **overrides)
    model = tg.build_model(config)
    fill_random(model)  # W2 not zero, so W1 gets a gradient too
    inputs, targets = packed(config)
    model.eval()(inputs, targets, WINDOW, reduction="none").sum().backward()
    return model.mudd


@pytest.mark.parametrize("nets,used", [("final", 1), ("penultimate", 0), ("both", None)])
def test_the_unused_nets_slices_get_no_gradient(nets, used):
    """The weights keep both nets' slices ([2, ...]); only the running net's get a gradient. The final
    net alone runs without the bigram table (only the penultimate net adds psi x b)."""
    mudd = mudd_grads(nets, **({"bigram_embed": False} if nets == "final" else {}))
    for p in (mudd.w1, mudd.w2, mudd.bias):
        assert p.shape[0] == 2
        for k in (0, 1):
            assert torch.count_nonzero(p.grad[k]).item() > 0 if used in (None, k) else not p.grad[k].any()


def test_the_penultimate_net_alone_is_both_without_the_final_mix_and_feeds_the_backout(monkeypatch):
    """--mudd_nets=penultimate: with the final net made to pass the stream (its W2 and biases 0), `both`
    gives the same losses; with --backout the head's input is norm(h - lambda h_b) of the last block's
    output h, as without MUDD."""
    config, both = tiny(mudd_nets="penultimate"), tiny()
    a, c = tg.build_model(config), tg.build_model(both)
    for model in (a, c):
        fill_random(model)
    with torch.no_grad():
        c.mudd.w2[1].zero_()
        c.mudd.bias[1].zero_()
    assert torch.equal(eval_losses(a, config), eval_losses(c, both))
    with torch.no_grad():
        c.mudd.bias[1, 1, 4] = 0.125  # the final mix's block-4 weight: now it acts
    assert not torch.equal(eval_losses(a, config), eval_losses(c, both))

    config = tiny(mudd_nets="penultimate", backout=True)
    model = tg.build_model(config)
    fill_random(model)
    head_inputs, loss = [], model.loss
    monkeypatch.setattr(model, "loss", lambda x, *args: head_inputs.append(x) or loss(x, *args))
    _, outputs = block_outputs(model, config)
    with torch.no_grad():
        h, h_b = outputs[L - 1][0], outputs[config.backout_layer][0]
        want = tg.rms_norm(h - model.backout.weight[0] * h_b)
        assert model.backout.weight[0].item() != 0 and not torch.equal(want, tg.rms_norm(h))
    assert len(head_inputs) == 1 and torch.equal(head_inputs[0], want)


@pytest.mark.parametrize("flags,words", [
    (["--mudd", "--mudd_nets=final", "--bigram_embed"], "--mudd: replaces the backout"),
    (["--mudd", "--mudd_nets=penultimate", "--backout=false"], "--mudd: the last block's mix adds psi x the bigram"),
    (["--mudd", "--mudd_nets=both", "--backout=false"], "--mudd: the last block's mix adds psi x the bigram"),
])
def test_each_nets_needs_are_refused_in_one_line(flags, words, refusal_of):
    assert words in refusal_of(*flags)


def test_one_net_takes_only_its_own_needs():
    """The penultimate net alone allows the backout; the final net alone needs no bigram table."""
    tg.check_config(tg.make_config("tiny", mudd=True, mudd_nets="penultimate", bigram_embed=True))
    tg.check_config(tg.make_config("tiny", mudd=True, mudd_nets="final", backout=False))


def test_one_net_keeps_the_parameter_count_and_its_own_activations():
    counts = {nets: sum(p.numel() for p in tg.build_model(tiny(mudd_nets=nets)).parameters())
              for nets in ("both", "penultimate", "final")}
    assert len(set(counts.values())) == 1
    # at the record's size one kept (T, d) bf16 tensor is 65,536 x 1024 x 2 bytes = 128 MiB
    peak = {nets: tg.predicted_peak_mib(tg.make_config(recipe="mudd", mudd_nets=nets))
            for nets in ("both", "penultimate", "final")}
    assert (peak["both"] - peak["penultimate"], peak["both"] - peak["final"]) == (128, 256)
