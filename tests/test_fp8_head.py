"""PR #248's head (docs/fp8-yarn.md): --fp8's training product FP8HeadProduct against its
emulation from to_fp8/fp8_matmul (exactly) and against a float32 product (within FP8's error);
its quantizers pass gradients straight through and only the codes are kept for backward;
--head_transposed as an exact layout switch (init, training, the split and its Adam state); the
fp8_yarn recipe: marked as PR #248's unmerged claim, its parameter count and predicted peak, its
refusals, and its tiny form visits every phase (its runs: tests/test_frontier_recipes.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
import triton_kernels as kernels
from records import published
from test_bulk_model import FOUR_BLOCKS

SCALES = (32 / 448, 2.25 / 448, 1.5 / 448)  # fp8_yarn's fp8_ranges (32, 2.25, 1.5) / 448
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def head_inputs(T=48, d=32, V=96, seed=0, std=0.05):
    """bf16 h (RMS-normed, as the head reads it), a bf16 head W (V, d) and a bf16 upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = tg.rms_norm(torch.randn(T, d, generator=gen)).bfloat16()
    W = (torch.randn(V, d, generator=gen) * std).bfloat16()
    G = (torch.randn(T, V, generator=gen) * 0.05).bfloat16()
    return x, W, G


def product(x, weight, transposed, G, scales=SCALES):
    """FP8HeadProduct's logits and the gradients of x and the weight for upstream gradient G."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = tg.FP8HeadProduct.apply(x, weight, transposed, scales)
    logits.backward(G)
    return logits.detach(), x.grad, weight.grad


# ---- F1: the FP8 product


@pytest.mark.parametrize("transposed", [False, True])
def test_the_fp8_product_is_its_emulation_exactly(transposed):
    """Forward x8 = e4m3(h/s_x), w8 = e4m3(H/s_w), logits = s_x s_w (x8 @ w8) in bf16; backward
    g8 = e5m2(G/s_g), dh = bf16(s_g s_w (g8 @ w8^T)), dH = fp32(s_x s_g (x8^T @ g8)) as H's dtype;
    each written here from to_fp8 and fp8_matmul, for the head stored either way."""
    x, W, G = head_inputs()
    H = W.t().contiguous() if transposed else W  # (d, V) or (V, d) as stored
    s_x, s_w, s_g = SCALES
    x8, h8, g8 = kernels.to_fp8(x, s_x), kernels.to_fp8(H, s_w), kernels.to_fp8(G, s_g, E5M2)
    k8 = h8 if transposed else h8.t()  # the (d, V) operand
    want_logits = kernels.fp8_matmul(x8, k8, s_x, s_w, torch.bfloat16, fast_accum=True)
    want_dx = kernels.fp8_matmul(g8, k8.t(), s_g, s_w, torch.bfloat16)
    want_dH = (kernels.fp8_matmul(x8.t(), g8, s_x, s_g, torch.float32) if transposed
               else kernels.fp8_matmul(g8.t(), x8, s_g, s_x, torch.float32)).bfloat16()
    logits, dx, dH = product(x, H, transposed, G)
    assert logits.dtype == dx.dtype == dH.dtype == torch.bfloat16 and dH.shape == H.shape
    assert torch.equal(logits, want_logits) and torch.equal(dx, want_dx) and torch.equal(dH, want_dH)
    # the records' codes: one rounding from fp32; a bf16 quotient first would change some
    assert not torch.equal(x8.float(), (x / s_x).to(E4M3).float())


def test_the_two_layouts_give_the_same_product():
    x, W, G = head_inputs(seed=1)
    logits, dx, dW = product(x, W, False, G)
    logits_t, dx_t, dH = product(x, W.t().contiguous(), True, G)
    assert torch.equal(logits, logits_t) and torch.equal(dx, dx_t) and torch.equal(dW, dH.t())


def test_the_fp8_product_is_the_float32_product_within_fp8s_error():
    """FP8's error sizes: with the bulk cap and a summed cross-entropy after the head, the loss
    within ~1e-3 relative of a float32 autograd reference of x @ H, the gradients of h and H within
    8% relative Frobenius error (the e5m2 gradient codes' 2-bit mantissa dominates: ~5%)."""
    x, W, _ = head_inputs(T=128, d=256, V=2048, seed=2)
    targets = torch.randint(0, 2048, (128,), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(head_product):
        xr, Wr = x.float().requires_grad_(), W.float().requires_grad_()
        loss = F.cross_entropy(tg.sigmoid_softcap(head_product(xr, Wr).float()), targets, reduction="sum")
        loss.backward()
        return loss.item(), xr.grad, Wr.grad

    ref_loss, ref_dx, ref_dW = loss_and_grads(lambda a, b: a @ b.t())
    loss, dx, dW = loss_and_grads(lambda a, b: tg.FP8HeadProduct.apply(a.bfloat16(), b.bfloat16(), False, SCALES))
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    assert abs(loss - ref_loss) / ref_loss < 1e-3
    assert 0 < rel(dx, ref_dx) < 0.08 and 0 < rel(dW, ref_dW) < 0.08


@pytest.mark.parametrize("transposed", [False, True])
def test_the_quantizers_pass_gradients_straight_through(transposed):
    """An input or a weight past e4m3's range saturates in the forward, yet its gradient is the one
    of an entry in range (a clamp's derivative would make it 0): dh does not read h, dH not H."""
    x, W, G = head_inputs(seed=4)
    H = W.t().contiguous() if transposed else W
    logits, dx, dH = product(x, H, transposed, G)
    big_x, big_H = x.clone(), H.clone()
    big_x[0, 0], big_H[0, 0] = 1000.0, -50.0  # |h| > 32, |H| > 2.25: the codes saturate at +-448
    assert kernels.to_fp8(big_x, SCALES[0])[0, 0].float() == 448 and kernels.to_fp8(big_H, SCALES[1])[0, 0].float() == -448
    logits_x, dx_x, dH_x = product(big_x, H, transposed, G)
    assert not torch.equal(logits_x, logits) and torch.equal(dx_x, dx) and dx_x[0, 0] != 0
    logits_H, dx_H, dH_H = product(x, big_H, transposed, G)
    assert not torch.equal(logits_H, logits) and torch.equal(dH_H, dH) and dH_H[0, 0] != 0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_quantizer_saturates_past_the_range_on_every_torch(dtype):
    """Codes past the format's largest value are that value, never NaN (torch 2.11's eager e4m3fn
    cast past ~464) or inf (every torch's eager e5m2 cast past 57344); values in range are the plain
    cast's; NaN stays NaN."""
    top = torch.finfo(dtype).max
    values = torch.tensor([0.0, 1.0, -3.5, top, 1.04 * top, 470.0, -500.0, 1e4, 6e4, -1e9, 1e30])
    codes = kernels.to_fp8(values, 1.0, dtype).float()
    expected = torch.where(values.abs() > top, values.sign() * top, values.to(dtype).float())
    assert torch.equal(codes, expected) and torch.isfinite(codes).all()
    assert kernels.to_fp8(torch.tensor([float("nan")]), 1.0, dtype).float().isnan().all()
    assert kernels.to_fp8(values, 0.5, dtype).float()[-1] == top  # the scale divides first: 2e30 saturates too


def test_the_product_traces_as_one_graph_with_the_same_bits():
    """fullgraph: no graph break (no host sync) in forward or backward, and the traced graph
    computes the eager bits. Traced with aot_eager, not Inductor: torch 2.13's CPU Inductor code for
    FP8 conversions is unreliable (all NaN under AVX2, heap corruption on an AVX512 Xeon in a
    quantize-then-cast kernel), so a CPU test cannot check Inductor's own rounding; on a GPU the
    product compiles to Triton (tools/gpu_check.sh)."""
    x, W, G = head_inputs(seed=5)
    H = W.t().contiguous()
    compiled = torch.compile(lambda a, b: tg.FP8HeadProduct.apply(a, b, True, SCALES), backend="aot_eager",
                             fullgraph=True, dynamic=False)
    eager = product(x, H, True, G)
    a, b = x.clone().requires_grad_(), H.clone().requires_grad_()
    compiled(a, b).backward(G)
    logits = compiled(x, H)
    assert all(torch.equal(p, q) for p, q in zip((logits, a.grad, b.grad), eager))


def test_only_the_fp8_codes_are_kept_for_backward():
    x, W, _ = head_inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tg.FP8HeadProduct.apply(x.requires_grad_(), W.requires_grad_(), False, SCALES)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(E4M3, tuple(x.shape)), (E4M3, tuple(W.shape))]


def test_fp8_changes_training_only_and_off_is_the_plain_product():
    """The model's head: --fp8 changes the training loss, not the validation loss; without it the
    head is the plain product (bulk's F.linear)."""
    config = tg.make_config("tiny", dtype="bfloat16", seed=5)
    plain, fp8 = tg.build_model(config), tg.build_model(tg.make_config("tiny", dtype="bfloat16", seed=5, fp8=True))
    assert plain.head.fp8_scales is None and fp8.head.fp8_scales == tg.fp8_training_scales(fp8.config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (257,), generator=gen)
    args = (ids[:-1].int(), ids[1:], torch.tensor([3, 1], dtype=torch.int32), "none")  # per-token losses
    assert not torch.equal(plain(*args), fp8(*args))
    plain.eval(), fp8.eval()
    assert torch.equal(plain(*args), fp8(*args))
    x = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(plain.head(x), F.linear(x, plain.head.weight))


# ---- F2: the transposed head


def test_a_transposed_head_starts_as_the_exact_transpose_and_the_rest_is_unchanged():
    usual = dict(tg.build_model(tg.make_config("tiny", seed=6)).named_parameters())
    transposed = dict(tg.build_model(tg.make_config("tiny", seed=6, head_transposed=True)).named_parameters())
    assert transposed["head.weight"].shape == (64, 512) and transposed["head.weight"].is_contiguous()
    assert torch.equal(transposed.pop("head.weight"), usual.pop("head.weight").t())
    assert usual.keys() == transposed.keys() and all(torch.equal(usual[k], transposed[k]) for k in usual)


def train(steps: int, **overrides) -> tg.Runner:
    """The tiny model on FOUR_BLOCKS trained steps steps, the split after step 3: the head, the input
    table and the split act at the ends of the stack, alike at any depth."""
    config = tg.make_config("tiny", warmup_steps=0, seed=7, untie_embed_after_step=3, **FOUR_BLOCKS, **overrides)
    runner = tg.Runner(config, torch.device("cpu"))
    runner.losses = [runner.train_step(s, runner.random_batches(torch.Generator().manual_seed(s),
                                                                tg.slice_tokens(s, config))).item()
                     for s in range(steps)]
    return runner


def layouts_multiply_alike(config: tg.Hyperparameters) -> bool:
    """Whether this CPU's float32 products give the same bits for the head stored (V, d) and (d, V):
    the forward and both backward products at the tiny run's shapes. BLAS picks its summation order
    by layout and instruction set: equal on the AVX512 Xeon the golden files were made on, not
    under AVX2."""
    gen = torch.Generator().manual_seed(0)
    T, d, V = config.train_seq_len, config.model_dim, config.padded_vocab_size
    x, W, g = (torch.randn(*shape, generator=gen) for shape in ((T, d), (V, d), (T, V)))
    H = W.t().contiguous()
    return (torch.equal(F.linear(x, W), x @ H) and torch.equal(g @ W, g @ H.t())
            and torch.equal(g.t() @ x, (x.t() @ g).t()))


@pytest.mark.parametrize("extra", [dict(dtype="float32"), dict(dtype="bfloat16", fp8=True)],
                         ids=["float32", "bf16-fp8"])
def test_a_transposed_head_trains_like_the_usual_one_across_the_split(extra):
    """Six tiny steps, the split after step 3: the same losses, weights and Adam state, bit for bit,
    with --fp8 (the codes' products are exact in fp32) and, in float32, where this CPU's products
    accumulate both layouts in the same order (layouts_multiply_alike). Where they do not, the
    float32 losses agree to 1e-5 relative; the weights do not agree entry by entry there (Adam's
    first steps move a weight by about lr whatever its tiny gradient's size, so a rounding that
    flips a sign moves it by a whole step). The split copies H^T into the input table and transposes
    H's moments into its state (step count copied): the table then trains as before."""
    usual, transposed = train(6, **extra), train(6, head_transposed=True, **extra)
    (adam, _), (adam_t, _) = usual.optimizers, transposed.optimizers
    head, head_t = usual.model.head.weight, transposed.model.head.weight
    table, table_t = usual.model.embeds[0].weight, transposed.model.embeds[0].weight
    # the table's step count went on from the head's 2 (Adam's steps 1 and 3) with its own at step 5
    assert adam_t.state[table_t]["step"] == adam.state[table]["step"] == adam_t.state[head_t]["step"] == 3
    if "fp8" not in extra and not layouts_multiply_alike(usual.config):
        assert torch.allclose(torch.tensor(usual.losses), torch.tensor(transposed.losses), rtol=1e-5, atol=0)
        return
    assert usual.losses == transposed.losses
    assert torch.equal(head, head_t.t()) and torch.equal(table, table_t)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(adam.state[head][k], adam_t.state[head_t][k].t())
        assert torch.equal(adam.state[table][k], adam_t.state[table_t][k]) and adam_t.state[table_t][k].is_contiguous()


def test_the_split_transposes_the_heads_adam_state_into_the_tables_layout():
    runner = train(4, head_transposed=True, dtype="float32")  # the split after step 3 (the 2nd Adam step)
    adam = runner.optimizers[0]
    head, table = runner.model.head.weight, runner.model.embeds[0].weight
    assert not runner.model.embed_tied and torch.equal(table, head.t())
    assert adam.state[table]["step"] == adam.state[head]["step"] == 2
    for k in ("exp_avg", "exp_avg_sq"):
        assert adam.state[table][k].shape == table.shape and torch.equal(adam.state[table][k], adam.state[head][k].t())
        assert adam.state[table][k].data_ptr() != adam.state[head][k].data_ptr()


# ---- refusals


@pytest.mark.parametrize("argv, flag", [
    (["--fp8", "--lore_output", "--untie_embed_after_step=0"], "--fp8"),
    (["--head_transposed", "--lore_output", "--untie_embed_after_step=0"], "--head_transposed"),
    (["--fp8_ranges=32,2.25"], "--fp8_ranges"),
    (["--fp8_ranges=32,0,1.5"], "--fp8_ranges"),
])
def test_what_cannot_apply_is_refused_in_one_line_naming_the_flag(argv, flag, capsys):
    assert tg.main(["--preset=tiny", "--dry_run", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {flag}:") or f"{flag}:" in line


# ---- the fp8_yarn recipe (PR #248)


def test_the_recipe_is_pr_248_and_says_it_is_an_unmerged_claim():
    recipe, record = tg.RECIPES["fp8_yarn"], published.find("fp8_yarn")
    assert recipe.values == dict(fp8=True, fp8_ranges=(32.0, 2.25, 1.5), head_transposed=True, yarn_window_limit=23,
                                 muon_lr=0.012)
    assert recipe.claim_pr == record.pr == 248 and record.is_claim and tg.RECIPES["bulk"].claim_pr is None
    assert (recipe.runs, recipe.p_value, recipe.peak_mib) == (record.log_stats.n, record.log_stats.p, 63_702)
    config = tg.make_config(recipe="fp8_yarn")
    assert (config.num_iterations, config.extension_steps) == (4740, 40)
    assert "unmerged claim PR #248" in tg.recipe_summary(config)
    assert "unmerged claim PR #248" in " ".join(tg.help_text().split())
    assert "unmerged claim" not in tg.recipe_facts("bulk")


def dry_run(argv, capsys) -> tuple[str, dict]:
    assert tg.main(["--dry_run", *argv]) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def predicted_peak(out: str) -> int:
    line = next(line for line in out.splitlines() if line.startswith("predicted peak memory allocated:"))
    return int(line.split(": ")[1].split(" MiB")[0].replace(",", ""))


def test_the_recipes_dry_run_counts_bulks_parameters_and_predicts_the_fp8_codes(capsys):
    """613,420,440 parameters as bulk; the predicted peak is bulk's plus the e4m3 codes kept for
    backward, one byte each of a rank's 65,536 x 1024 input and the 1024 x 50,304 head: 113 MiB.
    (PR #248's log: 63,702 MiB, 6,305 more than bulk's; the rest is not modelled.)"""
    bulk_out, bulk = dry_run([], capsys)
    out, summary = dry_run(["--recipe=fp8_yarn"], capsys)
    assert summary["total_params"] == bulk["total_params"] == 613_420_440
    assert summary["params_in_use_before_split"] == 561_909_144
    assert predicted_peak(out) - predicted_peak(bulk_out) == round((65_536 + 50_304) * 1024 / 2**20) == 113
    assert ("2026-03-28_FP8YaRNTuning record logged 63,702 MiB on 8 GPUs; the prediction starts from bulk's "
            "57,397 MiB") in out


TINY_STEPS = 24


def tiny_recipe() -> tg.Hyperparameters:
    return tg.with_num_iterations(tg.make_config("tiny", recipe="fp8_yarn"), TINY_STEPS)


def test_the_tiny_recipe_visits_every_phase():
    """The tiny preset keeps the recipe's switches; at 24 steps YaRN still rescales at all eight
    window changes, the head is tied and then split, and the last step is an extension step."""
    config = tiny_recipe()
    assert (config.fp8, config.fp8_ranges, config.head_transposed, config.muon_lr) == (True, (32.0, 2.25, 1.5),
                                                                                      True, 0.012)
    assert [(old, new) for _, old, new in tg.yarn_changes(config)] == [
        (3, 7), (7, 11), (11, 13), (13, 15), (15, 17), (17, 19), (19, 21), (21, 23)]
    assert 0 < tg.untie_step(config) < tg.yarn_changes(config)[-1][0] and config.extension_steps >= 1
    assert len({tg.batch_tokens(s, config) for s in range(TINY_STEPS)}) == 4


# the tiny recipe learning: tests/test_frontier_recipes.py (a recipe resumed and on 2 processes: mudd there)


def test_the_gradient_codes_follow_the_loss_scale_so_they_are_the_records_at_any_world_size():
    """The records backpropagate each rank's loss unscaled; this trainer scales it by 1/batch_slices
    first. With s_g scaled by the same factor (fp8_training_scales) every gradient code is the
    records' and the results are exactly that factor times theirs; with s_g alone the small
    gradients sink three binades deeper and more of them flush to zero."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(64, 96, generator=gen) * 0.02).bfloat16().requires_grad_()
    G = (torch.randn(16, 96, generator=gen) * 1e-7).bfloat16()  # near e5m2's smallest codes x s_g
    s_x, s_w, s_g = 32 / 448, 2.25 / 448, 1.5 / 448
    c = 1 / 8  # the trainer's loss scale at the record's 8 slices

    def grads(scales, upstream):
        x.grad = w.grad = None
        tg.FP8HeadProduct.apply(x, w, True, scales).backward(upstream)
        return x.grad.float(), w.grad.float()

    records = grads((s_x, s_w, s_g), G)
    scaled = grads((s_x, s_w, s_g * c), G * c)
    unscaled = grads((s_x, s_w, s_g), G * c)
    for ours, theirs in zip(scaled, records):
        assert torch.equal(ours, theirs * c)
    assert not torch.equal(unscaled[1], records[1] * c)
    config = tg.make_config("tiny", recipe="fp8_yarn")
    head = tg.build_model(config).head
    assert head.fp8_scales == tg.fp8_training_scales(config) == (s_x, s_w, s_g / config.batch_slices)


TRANSPOSE_SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import train_gpt_medium as tg
import triton_kernels as kernels
kernel, tile = kernels.fp8_transpose_kernel(), kernels.TRANSPOSE_TILE
gen = torch.Generator().manual_seed(0)
for m, n in ((1, 1), (3, 200), (64, 64), (70, 130), (129, 63)):
    codes = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=gen).view(torch.float8_e5m2)
    out = torch.empty((n, m), dtype=torch.uint8)
    kernel[(-(-m // tile), -(-n // tile))](codes.view(torch.uint8), out, m, n, TILE=tile)
    assert torch.equal(out, codes.t().contiguous().view(torch.uint8)), (m, n)
print("equal")
"""


class ModelBuilt(Exception):
    pass


@pytest.mark.parametrize("recipe,device,made", [("fp8_yarn", "cuda", True), ("bulk", "cuda", False),
                                                ("fp8_yarn", "cpu", False)])
def test_a_runner_for_cuda_with_fp8_makes_the_transpose_kernel_before_its_model(recipe, device, made, monkeypatch):
    """The compiled step traces the head's backward, which reaches fp8_transpose's Triton kernel: made
    there on first use, triton.jit breaks the graph. A Runner for CUDA makes it first, before its
    model (the test stops the Runner there: this machine has no CUDA); only --fp8 needs it."""
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "_TRANSPOSE_KERNEL", None)

    def stop(*args):
        raise ModelBuilt
    monkeypatch.setattr(tg, "build_model", stop)
    with pytest.raises(ModelBuilt):
        tg.Runner(tg.make_config("tiny", recipe), torch.device(device))
    assert (kernels._TRANSPOSE_KERNEL is not None) == made
    if made:
        assert kernels.fp8_transpose_kernel() is kernels._TRANSPOSE_KERNEL  # made once


def test_the_tiled_transpose_kernel_gives_the_transposed_codes_bit_for_bit():
    """fp8_transpose's Triton kernel (run by Triton's interpreter), against torch's copy of the
    transposed view, on shapes that are not multiples of the tile and smaller than one."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", TRANSPOSE_SCRIPT, str(Path(tg.__file__).parent)], capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["equal"], done.stderr[-3000:]
