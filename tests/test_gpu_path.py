"""The GPU path, proven on the CPU: Muon's compiled per-matrix update (its compiled parts) against
the eager one (the CPU default), at plain Muon's settings and at the record's, FlexAttention never
run eagerly (equal to the dense SDPA mask in evaluation, refused for CPU training), the CUDA
allocator's expandable segments set before CUDA starts, and the peak memory statistics restarted
after the warm-up."""
import math
import os

import pytest
import torch

import train_gpt_medium as tg


# ---- Muon: each compiled part serves every matrix

# Muon's four switches at plain Muon's settings (Newton-Schulz in the weight's dtype, no row
# normalization, decoupled decay, the lr factor of each block); {} is the record's
PLAIN_MUON = dict(orthogonalization="newton_schulz", row_normalization=False, cautious_weight_decay=False,
                  lr_shape="blocks")


def muon_run(shapes, dtype, compile_update, steps, gradients, weight_decay=0.01, switches=PLAIN_MUON):
    """Muon over one matrix of each shape; after each (lr, momentum) step, the fp32 master values
    (the weight, or bf16 weight + low bits) and the momentum buffers of every matrix."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype)) for s in shapes]
    opt = tg.Muon([dict(params=params, wd_mul=2.0)], lr=0.0, momentum=0.0, weight_decay=weight_decay,
                  compile_update=compile_update, **switches)
    history = []
    for (lr, momentum), grads in zip(steps, gradients):
        for group in opt.param_groups:
            group.update(lr=lr, momentum=momentum)
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        opt.step()
        history.append([(master(p, opt), opt.state[p]["momentum_buffer"].clone()) for p in params])
    return history


def master(p, opt):
    state = opt.state[p]
    return tg.fp32_from_halves(p.data, state["low_bits"]) if "low_bits" in state else p.data.clone()


def dyadic_gradients(shapes, num_steps, seed=1):
    """Entries k/8 with |k| <= 4: every partial sum of squares is exact in fp32 (at most 22 bits even
    after the momentum's halvings), so the Frobenius norm is the same in any summation order."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(-4, 5, s, generator=gen).float() / 8 for s in shapes] for _ in range(num_steps)]


def normal_gradients(shapes, num_steps, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(num_steps)]


# Square shapes, one of them batched like the merged attention weight: lr_eff = lr, a power of two,
# so lr_eff * update is exact and the last step rounds once whether fused (eager) or not (compiled).
# Momentum 0 and 0.5 make both lerps exact as well (the momentum runs eagerly in both anyway). With
# these, compiled and eager plain Muon do the same arithmetic; otherwise they differ where ATen
# fuses a multiply-add (add with alpha) that Inductor's C++ does not (-ffp-contract=off), and in
# the order of the norm's sum. The matrix products are ATen's in both (Inductor calls them).
SAME_ARITHMETIC_SHAPES = [(64, 64), (4, 32, 32)]
SAME_ARITHMETIC_STEPS = [(2.0**-6, 0.0), (2.0**-7, 0.5), (2.0**-5, 0.5)]


@pytest.fixture(scope="module")
def same_arithmetic_runs():
    """Eager and compiled plain Muon on the same fp32 problem, what compiling cost in graphs, and
    what compiling the record's Muon cost on it (its eager and compiled results differ: bf16)."""
    torch._dynamo.reset()  # count this module's compilations from nothing
    grads = dyadic_gradients(SAME_ARITHMETIC_SHAPES, len(SAME_ARITHMETIC_STEPS))
    eager = muon_run(SAME_ARITHMETIC_SHAPES, torch.float32, False, SAME_ARITHMETIC_STEPS, grads)
    before = tg.compile_counts()
    compiled = muon_run(SAME_ARITHMETIC_SHAPES, torch.float32, True, SAME_ARITHMETIC_STEPS, grads)
    plain_counts = tg.compiled_since(before)
    before = tg.compile_counts()
    muon_run(SAME_ARITHMETIC_SHAPES, torch.float32, True, SAME_ARITHMETIC_STEPS, grads, switches={})
    return eager, compiled, plain_counts, tg.compiled_since(before)


@pytest.mark.slow
def test_compiled_muon_update_is_bit_exact_in_fp32_where_the_arithmetic_is_the_same(same_arithmetic_runs):
    eager, compiled, *_ = same_arithmetic_runs
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for (w_master, w_buf), (g_master, g_buf) in zip(want, got):
            assert torch.equal(g_master.view(torch.int32), w_master.view(torch.int32)), f"weights, step {step}"
            assert torch.equal(g_buf, w_buf), f"momentum, step {step}"
    assert not torch.equal(compiled[-1][0][0], compiled[0][0][0])  # the weights did move


@pytest.mark.slow
def test_compiled_muon_update_compiles_once_per_shape_not_per_lr_or_momentum(same_arithmetic_runs):
    """Two shapes, three steps with a new lr and momentum each: per compiled part two graphs, the
    second one a recompile. Plain Muon compiles two parts (orthogonalization, decoupled step), the
    record's three (Polar Express, row normalization, cautious step)."""
    *_, plain, record = same_arithmetic_runs
    for parts, added in ((2, plain), (3, record)):
        assert added["graphs"] == parts * len(SAME_ARITHMETIC_SHAPES)
        assert added["recompiles"] == parts * (len(SAME_ARITHMETIC_SHAPES) - 1)


@pytest.mark.slow
@pytest.mark.usefixtures("same_arithmetic_runs")
def test_compiled_muon_update_agrees_with_eager_to_fp32_rounding():
    """Plain Muon with the x01 record's lr and momenta (not powers of two) and normal gradients: the
    fused multiply-adds and the norm's summation order round differently. On the shapes the fixture
    above compiled (their graphs serve this test: a graph does not depend on lr or momentum; the tall
    matrix's transposed iteration is compiled by the bf16 tests below). Measured over these steps:
    weights within 1.5e-8 (|w| <= 0.25, where an fp32 ulp is at most 1.5e-8; 3e-8 on a tall matrix);
    the momentum, eager in both, equal. Asserted: weights 1e-7; momentum equal."""
    shapes = SAME_ARITHMETIC_SHAPES
    steps = [(0.025, 0.85), (0.02, 0.9), (0.01, 0.95)]
    grads = normal_gradients(shapes, len(steps))
    eager = muon_run(shapes, torch.float32, False, steps, grads)
    compiled = muon_run(shapes, torch.float32, True, steps, grads)
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for (w_master, w_buf), (g_master, g_buf) in zip(want, got):
            torch.testing.assert_close(g_master, w_master, rtol=0, atol=1e-7, msg=f"weights, step {step}")
            assert torch.equal(g_buf, w_buf), f"momentum, step {step}"


@pytest.mark.slow
def test_compiled_muon_update_agrees_with_eager_within_bf16_rounding():
    """Plain Muon, bf16 weights, one step from the same state: the compiled Newton-Schulz keeps
    fused intermediates in fp32 where eager rounds each to bf16, so the two updates differ by about
    as much as eager bf16 iteration differs from fp32 iteration (measured: ratio 0.8-1.5 over 3
    seeds and 3 shapes, a batched one among them). Asserted: at most twice that bf16 error, and the
    same momentum buffer. On a tall matrix (its iteration transposed; the batched graph's structure
    is the fixture's above, bit for bit in fp32): each shape and dtype compiles about 12 kernels,
    a second of C++ build each."""
    shape = (96, 32)
    lr, gen = 2.0**-6, torch.Generator().manual_seed(3)
    grads = [[torch.randn(shape, generator=gen).to(torch.bfloat16).float()]]
    (eager,), (compiled,) = (muon_run([shape], torch.bfloat16, c, [(lr, 0.9)], grads, weight_decay=0.0)
                             for c in (False, True))
    (w_master, w_buf), (g_master, g_buf) = eager[0], compiled[0]
    step_size = lr * math.sqrt(max(1.0, shape[-2] / shape[-1]))
    update_difference = ((g_master - w_master) / step_size).abs().max().item()
    bf16_error = (tg.orthogonalize(grads[0][0], torch.bfloat16).float()
                  - tg.orthogonalize(grads[0][0], torch.float32)).abs().max().item()
    assert update_difference <= 2 * bf16_error, (update_difference, bf16_error)
    assert torch.equal(g_buf, w_buf)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 32, 32), (96, 32), (32, 96)])
def test_compiled_record_muon_update_agrees_with_eager_within_bf16_rounding(shape):
    """The record's Muon (Polar Express in bf16, row normalization, cautious step), fp32 weights as
    the record's, one step: the compiled Polar Express keeps fused intermediates in fp32 where
    eager rounds each to bf16, so the updates differ by about as much as bf16 Polar Express differs
    from fp32 (measured: ratio 0.44-1.52 over 3 seeds and these 3 shapes; the row normalization
    from a zero statistic moves both alike). Asserted: at most twice that bf16 error (no decay: the
    weights move by lr_factor x update), and the same momentum buffer (eager in both)."""
    lr = 2.0**-6
    grads = [[torch.randn(shape, generator=torch.Generator().manual_seed(10))]]
    (eager,), (compiled,) = (muon_run([shape], torch.float32, c, [(lr, 0.9)], grads, weight_decay=0.0, switches={})
                             for c in (False, True))
    (w_master, w_buf), (g_master, g_buf) = eager[0], compiled[0]
    lr_factor = lr * math.sqrt(max(1.0, grads[0][0].numel() / shape[-1] / shape[-1]))  # stored rows / cols
    update_difference = ((g_master - w_master) / lr_factor).abs().max().item()
    bf16_error = (tg.polar_express(grads[0][0]).float() - tg.polar_express(grads[0][0], dtype=torch.float32)
                  ).abs().max().item()
    assert 0 < update_difference <= 2 * bf16_error, (update_difference, bf16_error)
    assert torch.equal(g_buf, w_buf)


def test_the_cpu_run_keeps_the_eager_update_and_a_compiled_run_compiles_it():
    eager = tg.Runner(tg.make_config("tiny"), torch.device("cpu")).optimizers[1]
    compiled = tg.Runner(tg.make_config("tiny", compile=True), torch.device("cpu")).optimizers[1]  # nothing compiles before a call
    parts = dict(orthogonalize=tg.polar_express, row_normalize=tg.normuon_row_normalize,
                 cautious_step=tg.cautious_step, decoupled_step=tg.decoupled_step)
    for name, fn in parts.items():
        assert getattr(eager, name) is fn, name
        assert getattr(compiled, name) is tg.compiled(fn, fullgraph=True), name
    plain = tg.Runner(tg.make_config("tiny", compile=True, orthogonalization="newton_schulz"),
                      torch.device("cpu")).optimizers[1]
    assert plain.orthogonalize is tg.compiled(tg.orthogonalize, fullgraph=True)


# ---- FlexAttention: compiled on its own when the model is not compiled


def per_token_losses(attention, ids, window):
    """Per-token losses of the tiny model with every matrix random (at init the attention output
    projection is zero, and the losses would not depend on attention at all); window: [long, short]."""
    config = tg.make_config("tiny", dtype="float32", attention=attention, compile=False)
    model = tg.build_model(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        return model(ids[:-1].to(torch.int32), ids[1:].to(torch.int64), torch.tensor(window), reduction="none")


def tokens_with_documents():
    ids = torch.randint(0, 499, (513,), generator=torch.Generator().manual_seed(4))
    ids[[90, 200, 333]] = 499  # documents that start inside blocks
    return ids


WINDOWS = [[1, 1], [3, 1], [7, 3]]  # [long, short] in 16-token blocks, inside a 512-token slice


@pytest.mark.parametrize("window", WINDOWS)
def test_flex_without_compile_gives_the_windowed_result_of_the_dense_mask(window):
    """--attention=flex --compile=false on the CPU, in evaluation: the same losses as SDPA with the
    dense mask (measured: within 2e-6 of losses near 6.7; asserted: 1e-5)."""
    ids = tokens_with_documents()
    torch.testing.assert_close(per_token_losses("flex", ids, window), per_token_losses("sdpa", ids, window),
                               rtol=1e-5, atol=1e-5)


def test_the_windows_of_the_test_above_change_the_losses():
    """Guards the test above: each of its windows gives other losses than the final validation's
    27/11 (measured: by 0.065 to 0.30)."""
    ids = tokens_with_documents()
    wide = per_token_losses("sdpa", ids, [27, 11])
    for window in WINDOWS:
        assert (per_token_losses("sdpa", ids, window) - wide).abs().max() > 0.03, window


def test_the_model_builds_its_flex_masks_at_the_block_of_its_device(monkeypatch):
    """GPT.attention_inputs asks flex_mask_block for its input's device: with the CUDA answer its
    BlockMasks are 128-token blocks (tests/test_bulk_model.py: such a mask is still the token rule)."""
    config = tg.make_config("tiny", dtype="float32", attention="flex", compile=False)
    model = tg.build_model(config)
    ids = tokens_with_documents()[:-1].to(torch.int32)
    (long_mask, short_mask), *_ = model.attention_inputs(ids, torch.tensor([3, 1]))
    assert long_mask.BLOCK_SIZE == short_mask.BLOCK_SIZE == (16, 16)
    asked, flex_mask_block = [], tg.flex_mask_block
    monkeypatch.setattr(tg, "flex_mask_block", lambda cfg, device_type: asked.append(device_type) or
                        flex_mask_block(cfg, "cuda"))
    (long_mask, short_mask), *_ = model.attention_inputs(ids, torch.tensor([3, 1]))
    assert long_mask.BLOCK_SIZE == short_mask.BLOCK_SIZE == (128, 128) and asked == ["cpu"]


def inductor_flex_tiles(capability, head_dim, dtype, search_space):
    """Every (forward BLOCK_M, BLOCK_N) and backward (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) tile that
    inductor's CUDA heuristics may choose for FlexAttention on a GPU of this capability."""
    from torch._inductor import config as inductor_config
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
    heuristic = CUDAConfigHeuristic()
    with pytest.MonkeyPatch.context() as mp, inductor_config.patch(
            max_autotune=search_space is not None, max_autotune_flex_search_space=search_space or "DEFAULT"):
        mp.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
        forward = [(c.block_m, c.block_n) for c in heuristic.get_flex_attn_fwd_configs(head_dim, dtype)]
        backward = [(c.block_m1, c.block_n1, c.block_m2, c.block_n2)
                    for c in heuristic.get_flex_attn_bwd_configs(head_dim, dtype)]
    return forward, backward


@pytest.mark.parametrize("preset", sorted(tg.PRESETS))
def test_the_cuda_flex_mask_block_is_a_multiple_of_every_tile_inductor_can_choose(preset):
    """Inductor refuses a FlexAttention BlockMask whose block is not a multiple of its kernel's tiles
    ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N"): the mask the model builds on
    CUDA passes that check for every recipe, on every GPU generation from the A100 on, with inductor's
    default tiles and those its autotuning tries. The tiny preset's own 16-token block would not."""
    recipes = [*tg.RECIPES, *tg.CANDIDATES]
    for recipe in recipes:
        config = tg.make_config(preset, recipe)
        # the block does not depend on the length: 8 of them
        ids = torch.randint(0, config.vocab_size, (8 * tg.flex_mask_block(config, 'cuda'),),
                            generator=torch.Generator().manual_seed(0))
        mask, _ = tg.token_window_masks(ids, torch.tensor(3), torch.tensor(1), config, "flex",
                                        tg.flex_mask_block(config, "cuda"))
        block = mask.BLOCK_SIZE
        for capability in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
            for dtype in (torch.bfloat16, torch.float32):
                for space in (None, "DEFAULT", "EXHAUSTIVE"):
                    forward, backward = inductor_flex_tiles(capability, config.head_dim, dtype, space)
                    assert forward and backward
                    for m, n in forward:
                        assert block[0] % m == 0 and block[1] % n == 0, (recipe, capability, dtype, space, m, n)
                    for m1, n1, m2, n2 in backward:
                        assert block[0] % m1 == 0 and block[0] % m2 == 0, (recipe, capability, dtype, space)
                        assert block[1] % n1 == 0 and block[1] % n2 == 0, (recipe, capability, dtype, space)
    if preset == "tiny":  # the check above can fail: the preset's own block is below inductor's tiles
        forward, _ = inductor_flex_tiles((9, 0), tg.make_config("tiny").head_dim, torch.bfloat16, None)
        assert any(tg.make_config("tiny").attn_block_size % m for m, _ in forward)


@pytest.mark.parametrize("extra", [[], ["--bench_steps=1"]])
def test_flex_training_on_the_cpu_is_refused_before_anything_is_written(extra, tmp_path, capsys):
    """FlexAttention has no backward pass on the CPU: exit 2 naming the flag to use, no log."""
    log_dir = tmp_path / "logs"
    code = tg.main(["--preset=tiny", "--attention=flex", f"--log_dir={log_dir}", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert "--attention=flex" in err and "--attention=sdpa" in err
    assert not log_dir.exists()


# ---- the CUDA caching allocator


def test_expandable_segments_are_set_under_the_name_torch_reads_first():
    environ = {}
    tg.use_expandable_segments(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_an_allocator_configuration_set_by_the_user_is_kept(name):
    environ = {name: "max_split_size_mb:512"}
    assert tg.use_expandable_segments(environ) == f"{name}=max_split_size_mb:512"
    assert environ == {name: "max_split_size_mb:512"}  # the other name would override or add to it


class CudaCalled(Exception):
    pass


def test_run_training_sets_the_allocator_before_its_first_cuda_call(monkeypatch):
    for name in tg.ALLOC_CONF_VARIABLES:
        monkeypatch.setenv(name, "")  # unset for the run, restored afterwards
    seen = {}

    def set_device(device):
        seen["PYTORCH_ALLOC_CONF"] = os.environ.get("PYTORCH_ALLOC_CONF")
        raise CudaCalled

    monkeypatch.setattr(tg, "resolve_device", lambda config, local_rank: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(CudaCalled):
        tg.run_training(tg.make_config("tiny"), 0)
    assert seen == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


# ---- peak memory


def test_peak_memory_statistics_restart_after_the_warmup_restored_the_state(monkeypatch):
    events = []
    restore = tg.restore_state
    monkeypatch.setattr(tg, "restore_state", lambda *args: (restore(*args), events.append("restore")))
    monkeypatch.setattr(tg, "reset_peak_memory", lambda device: events.append(f"reset {device.type}"))
    tg.Runner(tg.make_config("tiny", warmup_steps=1), torch.device("cpu")).warmup()
    assert events == ["restore", "reset cpu"]


def test_reset_peak_memory_resets_the_cuda_statistics_and_leaves_the_cpu_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    tg.reset_peak_memory(torch.device("cpu"))
    assert calls == []
    tg.reset_peak_memory(torch.device("cuda", 3))
    assert calls == [torch.device("cuda", 3)]
