"""The bulk record's model switches (docs/bulk-model.md): each against a computation done another
way (a literal mask, a float64 formula or loop, the switch's neutral value), and the whole bulk
forward against a float64 loop-by-loop forward written from the description of the model (tests/reference.py)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
import triton_kernels as kernels
from reference import reference_loss as reference_bulk_loss  # the live model's float64 forward

# every model switch of the bulk record at the record's value (the defaults; token windows, pre-norm
# attention and separate x0 weights are always on), and the fields whose x01 value differed
BULK = dict(yarn_window_limit=13, rotary_bf16=True, key_offset=True, qkv_init_std=1.0, attn_output_gate=True,
            value_embed_gate=True, value_embed_zero_init=True, residual_scale_init=1.05, gated_skips=True,
            untie_embed_after_step=785, smear_embed=True, mlp_proj_transposed=True, logit_softcap_form="sigmoid",
            train_loss_reduction="sum", pad_vocab_tables=True, scalar_pad_multiple=8, attention_free_layers=(),
            attn_scale=0.1)


# The bulk model in 4 blocks instead of 16 with each of its layer patterns still there: a value-embedding
# table read by the first and the last block with blocks without one between them, a U-net skip,
# long- and short-window blocks (key offset on the long ones), backout from a block before the last.
# For tests whose property does not depend on the depth (a bit-for-bit equality, a failure path, the
# split): a 4-block training step costs about half a 16-block one on the CPU.
FOUR_BLOCKS = dict(num_layers=4, value_embed_layout=(0, None, None, 0), skip_connections=((2, 1),),
                   long_window_layers=(0, 3), backout_layer=2)


def as_flags(fields: dict) -> tuple[str, ...]:
    """Hyperparameters fields as the command line's flags (--name=value)."""
    return tuple(f"--{name}={tg.to_text(value)}" for name, value in fields.items())


FOUR_BLOCK_FLAGS = as_flags(FOUR_BLOCKS)


def tiny(**overrides):
    return tg.make_config("tiny", dtype="float32", **overrides)


def tiny_bulk(**overrides):
    return tiny(**{**BULK, "untie_embed_after_step": 3, "attn_block_size": 32, "max_window_tokens": 27 * 32,
                   **overrides})


WINDOW = torch.tensor([3, 1])  # [long, short] in blocks: the tiny grid's first slot


def packed(config, seed=0, docs_per_block=1.5):
    """(inputs, targets) of one packed training slice with documents of random lengths."""
    rng = np.random.default_rng(seed)
    T = config.train_seq_len
    ids = rng.integers(0, config.vocab_size - 1, T + 1)
    ids[rng.random(T + 1) < docs_per_block / 128] = config.eot_token
    ids = torch.from_numpy(ids)
    return ids[:-1].to(torch.int32), ids[1:].to(torch.int64)


def fill_random(model, seed=0, names=None):
    """Random values for every parameter (or those named): the same values for the same name in
    any model, so two configurations can be compared on equal weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is None or name in names:
                gen = tg._param_generator(1000 + seed, name)
                scale = 0.5 if p.ndim == 1 else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale + (0.5 if p.ndim == 1 else 0.0))


def loss_of(model, config, window, **kwargs):
    inputs, targets = packed(config)
    return model(inputs, targets, window, **kwargs)


def train_loss_and_grads(model, config, window=torch.tensor([3, 1])):
    """The training loss of packed(config) and every parameter's gradient that it reaches, by name."""
    inputs, targets = packed(config)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets, window)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_traces_as_one_graph(model, config, params, window=torch.tensor([3, 1])):
    """Static shapes and no host syncs: the training forward and backward traced whole (fullgraph,
    the eager backend) give the eager loss and the same gradients of `params`, bit for bit."""
    inputs, targets = packed(config)
    traced = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    got = traced(inputs, targets, window)
    got.backward()
    grads = [p.grad.clone() for p in params]
    model.zero_grad()
    want = model(inputs, targets, window)
    want.backward()
    assert torch.equal(got, want)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))


# ---- B5 token-level windows: the masks

BS, EOT = 64, 99
MASK_CONFIG = tg.make_config("tiny", vocab_size=100, eot_token=EOT, attn_block_size=BS, max_window_tokens=27 * BS)
# the bulk record's long windows (the final validation's 27 included); short = min(11, long // 2)
BULK_LONG_WINDOWS = [3, 7, 11, 13, 15, 17, 19, 21, 23, 27]
LAYOUTS = [(0, 0.05), (1, 0.6), (2, 3.0), (3, 40.0)]  # (seed, expected documents per block)
NUM_BLOCKS = 32
# The every-window tests below in the tiny preset's 16-token blocks: the rule counts tokens and the
# masks count blocks whatever their size, and the (T, T) masks and rules cost 16x less than at 64.
# The densest layout keeps its share of end-of-text tokens (40 of 64 would be every token of 16).
SMALL_BS = 16
SMALL_MASK_CONFIG = tg.make_config("tiny", vocab_size=100, eot_token=EOT)
assert (SMALL_MASK_CONFIG.attn_block_size, SMALL_MASK_CONFIG.max_window_tokens) == (SMALL_BS, 27 * SMALL_BS)
SMALL_LAYOUTS = [(0, 0.05), (1, 0.6), (2, 3.0), (3, 10.0)]


def random_ids(seed, docs_per_block, num_blocks=NUM_BLOCKS, block_size=BS):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, EOT, size=num_blocks * block_size)
    ids[rng.random(ids.size) < docs_per_block / block_size] = EOT
    return ids


def rule(ids, window_tokens):
    """The token rule, literally: key k is visible to query q iff k <= q, both in the same
    document (a new one at every end-of-text token) and q - k <= W."""
    docs = np.cumsum(ids == EOT)
    q, k = np.arange(ids.size)[:, None], np.arange(ids.size)[None, :]
    return (k <= q) & (docs[:, None] == docs[None, :]) & (q - k <= window_tokens)


def expand_block_mask(block_mask, ids):
    """A BlockMask's own lists made dense by hand: full blocks entirely, partial blocks through the
    mask's mask_mod evaluated on every (q, k) of the block (a last block may end past the sequence)."""
    n, bs = ids.size, block_mask.BLOCK_SIZE[0]
    assert block_mask.seq_lengths == (n, n)
    dense = np.zeros((n, n), dtype=bool)
    pos = torch.arange(n)
    for i in range(-(-n // bs)):
        rows = slice(i * bs, min((i + 1) * bs, n))
        for j in block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]].tolist():
            dense[rows, j * bs:(j + 1) * bs] = True
        for j in block_mask.kv_indices[0, 0, i, :block_mask.kv_num_blocks[0, 0, i]].tolist():
            q, k = pos[rows][:, None], pos[j * bs:min((j + 1) * bs, n)][None, :]
            dense[rows, j * bs:(j + 1) * bs] = block_mask.mask_mod(None, None, q, k).numpy()
    return dense


@pytest.mark.parametrize("seed,density", SMALL_LAYOUTS)
def test_token_window_dense_masks_equal_the_rule_at_every_bulk_window(seed, density):
    ids = random_ids(seed, density, block_size=SMALL_BS)
    ids_t = torch.from_numpy(ids)
    for long_w in BULK_LONG_WINDOWS:
        short_w = min(11, long_w // 2)
        long_mask, short_mask = tg.token_window_masks(ids_t, torch.tensor(long_w), torch.tensor(short_w),
                                                      SMALL_MASK_CONFIG, "sdpa")
        np.testing.assert_array_equal(long_mask.numpy(), rule(ids, long_w * SMALL_BS), err_msg=f"long {long_w}")
        np.testing.assert_array_equal(short_mask.numpy(), rule(ids, short_w * SMALL_BS),
                                      err_msg=f"short {short_w}")


@pytest.mark.parametrize("seed,density", SMALL_LAYOUTS)
def test_token_window_block_masks_materialize_to_the_rule_at_every_bulk_window(seed, density):
    ids = random_ids(seed, density, block_size=SMALL_BS)
    ids_t = torch.from_numpy(ids)
    for long_w in BULK_LONG_WINDOWS:
        short_w = min(11, long_w // 2)
        long_bm, short_bm = tg.token_window_masks(ids_t, torch.tensor(long_w), torch.tensor(short_w),
                                                  SMALL_MASK_CONFIG, "flex")
        np.testing.assert_array_equal(expand_block_mask(long_bm, ids), rule(ids, long_w * SMALL_BS),
                                      f"long {long_w}")
        np.testing.assert_array_equal(expand_block_mask(short_bm, ids), rule(ids, short_w * SMALL_BS),
                                      f"short {short_w}")


@pytest.mark.parametrize("num_blocks", [20, 13])  # 13 blocks of 64: the last group of 128 ends past them
def test_the_cuda_mask_groups_blocks_into_128_tokens_and_still_materializes_to_the_rule(num_blocks):
    """On CUDA the BlockMask's blocks are multiples of 128 tokens (flex_mask_block): here 64-token
    blocks in pairs. Its lists and mask_mod still give the token rule exactly, at every bulk window."""
    cuda_block = tg.flex_mask_block(MASK_CONFIG, "cuda")
    assert (cuda_block, tg.flex_mask_block(MASK_CONFIG, "cpu")) == (128, BS)
    for seed, density in LAYOUTS:
        ids = random_ids(seed, density, num_blocks=num_blocks)
        for long_w in BULK_LONG_WINDOWS:
            bm, _ = tg.token_window_masks(torch.from_numpy(ids), torch.tensor(long_w), torch.tensor(1), MASK_CONFIG,
                                          "flex", cuda_block)
            assert bm.BLOCK_SIZE == (128, 128)
            np.testing.assert_array_equal(expand_block_mask(bm, ids), rule(ids, long_w * BS), f"{seed} {long_w}")


def test_grouped_blocks_are_full_only_where_every_block_is_and_skipped_where_none_is():
    full = torch.tensor([[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]],
                        dtype=torch.bool)
    partial = torch.eye(5, dtype=torch.bool) & ~torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool)
    grouped_full, grouped_partial = tg.grouped_blocks(full, partial, 2)
    # groups of rows/cols {0,1}, {2,3}, {4 and one past the end}
    assert grouped_full.tolist() == [[False, False, False], [True, False, False], [False, False, False]]
    assert grouped_partial.tolist() == [[True, False, False], [False, True, False], [False, False, False]]


def test_one_document_keeps_the_window_edge_block_as_a_partial_block():
    """Far from the start of a single document, query block i keeps blocks i-w+1..i-1 full and the
    diagonal and the edge block i-w partial: w+1 blocks, one more than x01's block windows."""
    ids = np.arange(NUM_BLOCKS * BS) % (EOT - 1)  # no end-of-text: one document
    w = 7
    bm, _ = tg.token_window_masks(torch.from_numpy(ids), torch.tensor(w), torch.tensor(3), MASK_CONFIG, "flex")
    for i in range(w, NUM_BLOCKS):
        full = sorted(bm.full_kv_indices[0, 0, i, :bm.full_kv_num_blocks[0, 0, i]].tolist())
        partial = sorted(bm.kv_indices[0, 0, i, :bm.kv_num_blocks[0, 0, i]].tolist())
        assert full == list(range(i - w + 1, i)) and partial == [i - w, i], i
    edge = rule(ids, w * BS)[w * BS:(w + 1) * BS, 0:BS]  # query block w against key block 0
    assert edge.any() and not edge.all()  # only part of the edge block is in reach


def test_every_query_keeps_its_own_token_down_to_a_window_of_0():
    """The diagonal block is always kept, as a partial block: no row is empty (no NaN), even for the
    short window 0 of a long window of 1 block (min(11, 1 // 2)), which sees the query alone."""
    ids = torch.from_numpy(random_ids(9, 2.0, num_blocks=8))
    for window in (0, 1, 2):
        dense, short = tg.token_window_masks(ids, torch.tensor(window), torch.tensor(0), MASK_CONFIG, "sdpa")
        block_mask, _ = tg.token_window_masks(ids, torch.tensor(window), torch.tensor(0), MASK_CONFIG, "flex")
        assert dense.diagonal().all() and torch.equal(short, torch.eye(ids.numel(), dtype=torch.bool))
        np.testing.assert_array_equal(expand_block_mask(block_mask, ids.numpy()), dense.numpy(), f"W={window}")


def test_a_token_window_gives_every_query_far_from_the_start_w_blocks_and_one_key():
    """Inside one document, past the first w blocks: exactly BS*w + 1 keys per query, for the long
    and the short window alike."""
    ids = np.arange(NUM_BLOCKS * BS) % (EOT - 1)
    w = 5
    long_mask, short_mask = tg.token_window_masks(torch.from_numpy(ids), torch.tensor(w), torch.tensor(2),
                                                  MASK_CONFIG, "sdpa")
    far = slice(w * BS, None)
    assert set(long_mask[far].sum(1).tolist()) == {w * BS + 1}
    assert set(short_mask[far].sum(1).tolist()) == {2 * BS + 1}


@pytest.mark.slow
def test_compiled_flex_with_token_windows_and_a_scale_tensor_equals_sdpa_with_the_dense_mask():
    """Compiled FlexAttention reads the token-window BlockMask (edge blocks included) as the dense
    mask says, and multiplies the scores by the 0-d scale tensor as SDPA does by its float; a new
    scale value is read without compiling again."""
    rng = np.random.default_rng(5)
    flex = torch.compile(tg.flex_attention, dynamic=False)
    scale = torch.tensor(0.1)
    before = tg.compile_counts()
    for density in (0.3, 4.0):
        ids = torch.from_numpy(random_ids(int(rng.integers(100)), density, num_blocks=12))
        q, k, v = torch.randn(3, 1, 2, ids.numel(), 32).unbind(0)
        for long_w, value in ((3, 0.1), (7, 0.116946), (11, 0.131778)):
            scale.fill_(value)
            block_mask, _ = tg.token_window_masks(ids, torch.tensor(long_w), torch.tensor(1), MASK_CONFIG, "flex")
            dense, _ = tg.token_window_masks(ids, torch.tensor(long_w), torch.tensor(1), MASK_CONFIG, "sdpa")
            got = flex(q, k, v, block_mask=block_mask, score_mod=lambda s, b, h, qi, ki: s * scale, scale=1.0)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=float(scale))
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"density {density}, W={long_w}")
    assert tg.compiled_since(before)["graphs"] == 1


@pytest.mark.slow
def test_past_the_recompile_limit_flex_raises_instead_of_ignoring_the_window(monkeypatch):
    """Past dynamo's recompile limit torch runs flex_attention eagerly, which ignores the BlockMask's
    block lists and evaluates the mask_mod on every (q, k): far slower (the token windows' mask_mod
    holds the window itself, so the result stays right). Runs with flex make the limit an error;
    below it the window acts."""
    torch._dynamo.reset()  # count this test's compilations from nothing
    monkeypatch.setattr(tg, "RECOMPILE_LIMIT", 1)
    ids = torch.from_numpy(random_ids(6, 0.05, num_blocks=6))

    def inputs(n):
        q, k, v = torch.randn(3, 1, n, 2, 32, generator=torch.Generator().manual_seed(n)).unbind(0)
        block_mask, dense = (tg.token_window_masks(ids[:n], torch.tensor(2), torch.tensor(1), MASK_CONFIG, b)[0]
                             for b in ("flex", "sdpa"))
        return q, k, v, block_mask, dense

    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
        q, k, v, block_mask, dense = inputs(6 * BS)
        torch.testing.assert_close(tg.attend(q, k, v, block_mask, 0.12), tg.attend(q, k, v, dense, 0.12),
                                   atol=2e-5, rtol=1e-4)  # compiled: the window acts
        assert torch._dynamo.config.fail_on_recompile_limit_hit
        q, k, v, block_mask, dense = inputs(4 * BS)
        with pytest.raises(Exception, match="(?i)recompile"):
            tg.attend(q, k, v, block_mask, 0.12)  # a second shape is past the limit of 1
        torch._dynamo.config.fail_on_recompile_limit_hit = False  # what torch does by default:
        eager = tg.compiled(tg.flex_attention)(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask,
                                               scale=0.12).transpose(1, 2)
        torch.testing.assert_close(eager, tg.attend(q, k, v, dense, 0.12), atol=2e-5, rtol=1e-4)
    torch._dynamo.reset()


def test_the_token_window_mask_mod_holds_the_window_itself():
    """Unlike x01's, the token-window mask_mod tests q - k <= W on its own: the block lists only
    skip work (so even an eager FlexAttention would attend within the window)."""
    ids = random_ids(7, 0.05)
    bm, _ = tg.token_window_masks(torch.from_numpy(ids), torch.tensor(3), torch.tensor(1), MASK_CONFIG, "flex")
    pos = torch.arange(ids.size)
    np.testing.assert_array_equal(bm.mask_mod(None, None, pos[:, None], pos[None, :]).numpy(), rule(ids, 3 * BS))


# ---- B6 YaRN and the rotary tables

# the bulk record's frequency multipliers after its three changes (3->7, 7->11, 11->13 blocks of
# 128), by frequency index, to 4 decimals, and its attention scale after each change
PUBLISHED_MULTIPLIERS = [1, 1, 1, .9862, .8707, .7785, .6573, .5320, .4405, .3801, .3384, .3088, .2871, .2710,
                         .2588, .2495, .2422, .2366, .2322] + [3 / 13] * 13
PUBLISHED_SCALES = [0.1, 0.116946, 0.127518, 0.131778]
CHANGES = [(3, 7), (7, 11), (11, 13)]


def yarn_by_hand(changes, head_dim=128, block=128, base=1024.0, scale=0.1):
    """The formula, one frequency at a time, in float64: per change old -> new, turns
    r = block*old*w/(2 pi), g = clamp((r - 1)/31, 0, 1), w *= ratio + g (1 - ratio) with
    ratio = old/new; the scale times 1 + 0.2 ln(new/old)."""
    q = head_dim // 4
    freqs = [(1 / base) ** (j / (q - 1)) for j in range(q)] + [0.0] * q
    history = [(list(freqs), scale)]
    for old, new in changes:
        ratio = old / new
        for j, w in enumerate(freqs):
            g = min(max((block * old * w / (2 * math.pi) - 1) / 31, 0.0), 1.0)
            freqs[j] = w * (ratio + g * (1 - ratio))
        scale *= 1 + 0.2 * math.log(new / old)
        history.append((list(freqs), scale))
    return history


def medium_rotary():
    config = tg.make_config(**BULK, train_seq_len=1024, val_seq_len=2048, batch_schedule=())  # short tables, medium heads
    rotary = tg.RotaryTables(config)
    rotary.set_changes(())
    return rotary


def test_yarn_multipliers_and_scales_equal_the_formula_at_each_change():
    rotary = medium_rotary()
    base = rotary.freqs.double()
    for n, (freqs, scale) in enumerate(yarn_by_hand(CHANGES)):
        rotary.set_changes(tuple(CHANGES[:n]))
        torch.testing.assert_close(rotary.freqs.double(), torch.tensor(freqs, dtype=torch.float64), rtol=2e-6, atol=0)
        assert rotary.scale_value == pytest.approx(scale, rel=1e-12)
        assert rotary.scale.item() == pytest.approx(scale, rel=1e-7)  # fp32
        assert rotary.scale_value == pytest.approx(PUBLISHED_SCALES[n], abs=5e-7)
    multipliers = (rotary.freqs.double()[:32] / base[:32]).tolist()
    assert multipliers == pytest.approx(PUBLISHED_MULTIPLIERS, abs=5e-5)
    assert rotary.freqs[32:].eq(0).all()  # the non-rotating half stays at frequency 0


# the claimed record of PR #248 (2026-03-28, FP8YaRNTuning) applies YaRN at all eight changes of the
# long window; its attention scale after the fourth to the eighth and its final multipliers
PR248_SCALES = [0.135549, 0.138943, 0.142033, 0.144876, 0.147512]
PR248_MULTIPLIERS = [1, 1, 1, .9862, .8707, .7785, .6573, .5261, .3744, .2798, .2285, .1972, .1766, .1624, .1522,
                     .1447, .1391, .1348, .1315] + [3 / 23] * 13


def test_a_yarn_limit_of_23_blocks_applies_yarn_at_all_eight_changes_of_the_window():
    """--yarn_window_limit=23: the changes at steps 392, 784, 1175, 1567, 1959, 2350, 2742, 3134 (3 -> 7 ->
    ... -> 23 blocks) and none at the final validation's 27; the scales and multipliers PR #248 computes."""
    config = tg.make_config(yarn_window_limit=23)
    changes = tg.yarn_changes(config)
    assert [s for s, _, _ in changes] == [392, 784, 1175, 1567, 1959, 2350, 2742, 3134]
    assert [(old, new) for _, old, new in changes][3:] == [(13, 15), (15, 17), (17, 19), (19, 21), (21, 23)]
    rotary = medium_rotary()
    base = rotary.freqs.double()
    rotary.set_changes(tuple((old, new) for _, old, new in changes))
    scales = [scale for _, scale in yarn_by_hand([(old, new) for _, old, new in changes])]
    assert scales[4:] == pytest.approx(PR248_SCALES, abs=5e-7)
    assert rotary.scale_value == pytest.approx(PR248_SCALES[-1], abs=5e-7)
    assert (rotary.freqs.double()[:32] / base[:32]).tolist() == pytest.approx(PR248_MULTIPLIERS, abs=5e-5)


def test_yarn_tables_are_cos_and_sin_of_position_times_frequency_in_bf16():
    rotary = medium_rotary()
    rotary.set_changes(tuple(CHANGES))
    assert rotary.cos.dtype == torch.bfloat16 and rotary.cos.shape == (2048, 64)
    freqs, _ = yarn_by_hand(CHANGES)[-1]
    theta = torch.arange(2048, dtype=torch.float64)[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]
    bf16_ulp = 2.0**-8  # values in [0.5, 1); fp32 angles may round the other way at a bf16 tie
    torch.testing.assert_close(rotary.cos.double(), theta.cos(), atol=bf16_ulp, rtol=0)
    torch.testing.assert_close(rotary.sin.double(), theta.sin(), atol=bf16_ulp, rtol=0)


def test_rebuilding_the_tables_for_a_step_gives_the_same_bits():
    """The tables are a function of the changes so far: going back (a restored or resumed run) and
    forward again rebuilds them bit for bit."""
    rotary = medium_rotary()
    rotary.set_changes(tuple(CHANGES[:2]))
    first = rotary.cos.clone(), rotary.sin.clone(), rotary.scale.clone()
    rotary.set_changes(tuple(CHANGES))
    rotary.set_changes(())
    rotary.set_changes(tuple(CHANGES[:2]))
    assert all(torch.equal(a, b) for a, b in zip(first, (rotary.cos, rotary.sin, rotary.scale)))


def test_the_runner_applies_yarn_when_the_long_window_changes_up_to_the_limit():
    config = tiny(yarn_window_limit=7)  # the tiny grid's long window grows 3 -> 7 -> 11 blocks
    runner = tg.Runner(config, torch.device("cpu"))
    windows = [tg.attention_windows(s, config)[0] for s in range(config.num_iterations)]
    first_7, first_11 = windows.index(7), windows.index(11)
    assert runner.yarn_steps == [(first_7, 3, 7)]  # 7 -> 11 is past the limit
    runner.window(first_7 - 1)
    assert runner.model.rotary.changes == () and runner.model.rotary.scale_value == config.attn_scale
    runner.window(first_11)
    assert runner.model.rotary.changes == ((3, 7),)
    assert runner.model.rotary.scale_value == pytest.approx(config.attn_scale * (1 + 0.2 * math.log(7 / 3)))


def test_bf16_rotation_rounds_like_the_bf16_formula():
    """--rotary_bf16 rotates in the activations' dtype: (x1 c + x2 s, x1 (-s) + x2 c), each op in bf16."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 2, 8, generator=gen).bfloat16()
    cos, sin = (torch.randn(5, 4, generator=gen).bfloat16() for _ in range(2))
    got = tg.apply_rotary_in_dtype(x, cos, sin)
    x1, x2 = x[..., :4], x[..., 4:]
    c, s = cos[None, :, None], sin[None, :, None]
    want = torch.cat([(x1 * c) + (x2 * s), (x1 * -s) + (x2 * c)], dim=-1)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, tg.apply_rotary(x, cos.float(), sin.float()))  # fp32 rotation rounds once


# ---- B7 key offset

def test_key_offset_takes_the_non_rotating_dims_from_the_previous_original_key():
    k = torch.randn(1, 6, 2, 16)
    got = tg.shift_stationary_keys(k)
    want = k.clone()
    for t in range(1, 6):
        for d in list(range(4, 8)) + list(range(12, 16)):
            want[0, t, :, d] = k[0, t - 1, :, d]
    assert torch.equal(got, want)


def test_key_offset_is_on_the_long_window_layers_only():
    model = tg.build_model(tiny(key_offset=True), "meta")
    assert [b.attn.key_offset for b in model.blocks] == [i in (0, 4, 11, 15) for i in range(16)]
    assert not any(b.attn.key_offset for b in tg.build_model(tiny(key_offset=False), "meta").blocks)


# ---- B8 attention rewrite and gates

def gated_pair(**switches):
    """(gated model, ungated model) with equal weights everywhere except the gates (at init)."""
    ungated = {k: False for k in switches if k.endswith("gate")}
    gated, plain = tg.build_model(tiny(**switches)), tg.build_model(tiny(**{**switches, **ungated}))
    shared = [n for n, _ in plain.named_parameters()]
    fill_random(gated, names=shared)
    fill_random(plain, names=shared)
    return gated, plain


def test_the_output_gate_at_init_halves_the_attention_output():
    gated, plain = gated_pair(attn_output_gate=True)
    with torch.no_grad():  # lambda1 scales the output weights
        plain.scalar_slots()["attn_lambdas"].view(16, 2)[:, 1] *= 0.5
    assert torch.equal(loss_of(gated, gated.config, WINDOW), loss_of(plain, plain.config, WINDOW))


def test_the_value_gate_at_init_adds_the_value_embedding_with_weight_one():
    gated, plain = gated_pair(value_embed_gate=True)
    assert torch.equal(loss_of(gated, gated.config, WINDOW), loss_of(plain, plain.config, WINDOW))
    assert [b.attn.value_gate is not None for b in gated.blocks] == \
        [t is not None for t in gated.config.value_embed_layout]


def test_gates_read_the_first_16_features_of_the_normed_input():
    gate = tg.Gate(3, torch.float32, lr_mul=0.1, wd_mul=1.0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(3, 16))
    x = torch.randn(5, 40)
    assert torch.equal(gate(x), x[:, :16] @ gate.weight.T)
    assert gate.weight.lr_mul == 0.1


def test_attention_lambdas_start_at_half_and_one_and_qkv_init_std_1_doubles_x01s():
    model = tg.build_model(tiny(qkv_init_std=1.0, model_dim=128, head_dim=64))
    assert model.scalar_slots()["attn_lambdas"].view(16, 2)[0].tolist() == [0.5, 1.0]
    qkvo = model.blocks[0].attn.qkvo_w
    bound = 3**0.5 / 128**0.5
    assert qkvo[:3].abs().max() <= bound and qkvo[:3].abs().max() > 0.98 * bound
    assert torch.count_nonzero(qkvo[3]) == 0
    x01 = tg.build_model(tiny(qkv_init_std=0.5, model_dim=128, head_dim=64))  # the same stream, half the bound
    torch.testing.assert_close(qkvo[:3], 2 * x01.blocks[0].attn.qkvo_w[:3], rtol=1e-6, atol=0)


def test_attention_on_every_layer_and_zero_value_embeddings():
    model = tg.build_model(tiny(attention_free_layers=(), value_embed_zero_init=True))
    assert all(b.attn is not None for b in model.blocks)
    assert all(torch.count_nonzero(t.weight) == 0 for t in model.value_embeds.tables)


# ---- B9 residual, x0 and skip gating

def test_gated_skips_at_init_weigh_the_skip_by_sigmoid_of_the_gain():
    gated, plain = (tg.build_model(tiny(gated_skips=g)) for g in (True, False))
    shared = [n for n, _ in plain.named_parameters() if n != "scalars"]
    fill_random(gated, names=shared)
    fill_random(plain, names=shared)
    with torch.no_grad():
        plain.scalar_slots()["skip_w"][[6, 4, 2]] = torch.sigmoid(torch.tensor(-1.5))
    assert gated.scalar_slots()["skip_gain"].tolist() == [-1.5] * 3
    assert torch.equal(loss_of(gated, gated.config, WINDOW), loss_of(plain, plain.config, WINDOW))


def test_the_x0_weights_are_their_own_parameter_from_zero_with_the_records_multipliers():
    """(Their use in the forward: the float64 reference forward below.)"""
    model = tg.build_model(tiny(residual_scale_init=1.05))
    resid, x0 = model.mixing_weights()
    assert resid.tolist() == pytest.approx([1.05] * 16) and x0.shape == (16, 2) and not x0.any()
    assert model.x0_lambdas.lr_mul == 5.0 and model.x0_lambdas.wd_mul == 0.0
    assert tg.parameter_groups(model)["x0_lambdas"] == [model.x0_lambdas]
    assert tg.build_model(tiny(residual_scale_init=0.75)).mixing_weights()[0].tolist() == [0.75] * 16


# ---- B10 tied, then untied embedding

def test_before_the_split_the_head_is_the_input_table_and_the_input_table_gets_no_gradient():
    config = tiny_bulk()
    model = tg.build_model(config)
    fill_random(model)
    assert model.embed_tied
    loss = loss_of(model, config, torch.tensor([2, 1]))
    loss.backward()
    assert model.embeds[0].weight.grad is None and model.head.weight.grad is not None
    untied = tg.build_model(config)
    untied.load_state_dict(model.state_dict())
    with torch.no_grad():
        untied.embeds[0].weight.copy_(model.head.weight)
    untied.embed_tied = False
    assert torch.equal(loss_of(untied, config, torch.tensor([2, 1])), loss.detach())


def test_the_tied_head_starts_normal_with_std_0005_in_the_model_dtype():
    model = tg.build_model(tg.make_config("tiny", dtype="bfloat16", model_dim=256, head_dim=128,
                                          untie_embed_after_step=5, pad_vocab_tables=True))
    head = model.head.weight
    assert head.dtype == torch.bfloat16 and head.shape == (512, 256)
    assert head.float().std().item() == pytest.approx(0.005, rel=0.02)


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95)),
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
])
def test_tied_then_untied_goes_on_as_untied_from_the_start_with_the_copied_values_and_state(make_optimizer):
    """Train tied for two steps and split: the input table and its optimizer state are copies of
    the head's. The next step equals that of a model untied from the start that was given those
    values and that state. (On 4 blocks: the split is the tables' and the head's, not the blocks'.)"""
    config = tiny_bulk(untie_embed_after_step=1, **FOUR_BLOCKS)
    inputs, targets = packed(config)
    window = torch.tensor([2, 1])
    model = tg.build_model(config)
    opt = make_optimizer(list(model.parameters()))
    for _ in range(2):
        model(inputs, targets, window).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.untie_embedding([opt])
    head, table = model.head.weight, model.embeds[0].weight
    assert torch.equal(table, head) and not model.embed_tied
    for key, value in opt.state[head].items():
        assert torch.equal(opt.state[table][key], value) and opt.state[table][key] is not value
    # the same state in a model untied from the start
    twin = tg.build_model(config)
    twin.load_state_dict(model.state_dict())
    twin.embed_tied = False
    twin_opt = make_optimizer(list(twin.parameters()))
    names = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        if names[name] in opt.state:
            twin_opt.state[p] = {k: v.clone() for k, v in opt.state[names[name]].items()}
    for m, o in ((model, opt), (twin, twin_opt)):
        m(inputs, targets, window).backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(table, head)  # they now train apart


def test_the_runner_splits_right_after_the_update_of_the_split_step():
    """At the odd step 1 (Adam's step): the table becomes the head as updated, its Adam state a
    copy of the head's; until then its state is the untouched initial one. (On 4 blocks: the split
    is the tables' and the head's, not the blocks'.)"""
    config = tiny_bulk(untie_embed_after_step=1, warmup_steps=0, **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    adam = runner.optimizers[0]
    head, table = runner.model.head.weight, runner.model.embeds[0].weight
    for step in range(4):
        runner.train_step(step, runner.random_batches(gen), mtp_weights=[1.0, 0.5])
        assert runner.model.embed_tied == (step < 1)
        state = adam.state[table]
        if step == 0:
            assert state["step"] == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        if step == 1:
            assert torch.equal(table, head) and state["step"] == adam.state[head]["step"] == 1
            assert all(torch.equal(state[k], adam.state[head][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert state["step"] == 2 and not torch.equal(table, head)  # Adam's next step (3) trains them apart
    runner.set_embedding_tie(1)  # a restored earlier step reads the head again
    assert runner.model.embed_tied


def test_untying_needs_padded_tables():
    with pytest.raises(tg.ConfigError, match="pad_vocab_tables"):
        tg.make_config("tiny", untie_embed_after_step=3, pad_vocab_tables=False)
    tg.make_config("tiny", untie_embed_after_step=0, pad_vocab_tables=False)


# ---- B11 smear on the input embedding

def test_smear_with_weight_0_is_no_smear():
    smeared, plain = (tg.build_model(tiny(smear_embed=s)) for s in (True, False))
    fill_random(smeared, names=[n for n, _ in plain.named_parameters() if n != "scalars"] + ["smear_gate.weight"])
    fill_random(plain, names=[n for n, _ in plain.named_parameters() if n != "scalars"])
    assert smeared.scalar_slots()["smear"].item() == 0.0
    assert torch.equal(loss_of(smeared, smeared.config, WINDOW), loss_of(plain, plain.config, WINDOW))


def test_smear_adds_the_gated_previous_row_across_documents():
    gate = tg.Gate(1, torch.float32, lr_mul=0.01, wd_mul=0.0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(1, 16))
    e, lam = torch.randn(7, 24), torch.tensor(0.7)
    got = tg.smear_embedding(e, gate, lam).double()
    e64, g64 = e.double(), gate.weight.double()
    want = e64.clone()
    for t in range(1, 7):
        want[t] = e64[t] + 0.7 * torch.sigmoid(e64[t, :16] @ g64[0]) * e64[t - 1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- B13 the MLP's stored shape

def test_the_transposed_mlp_output_weight_computes_the_same_mlp():
    plain, transposed = tg.MLP(tiny(mlp_proj_transposed=False), torch.float32), tg.MLP(tiny(), torch.float32)
    assert transposed.proj_w.shape == (256, 64) and plain.proj_w.shape == (64, 256)
    assert transposed.proj_w.lr_mul == 2.0 and plain.proj_w.lr_mul == 1.0
    with torch.no_grad():
        plain.fc_w.copy_(torch.randn(256, 64) / 8)
        transposed.fc_w.copy_(plain.fc_w)
        plain.proj_w.copy_(torch.randn(64, 256) / 16)
        transposed.proj_w.copy_(plain.proj_w.T)
    x = torch.randn(3, 10, 64)
    torch.testing.assert_close(transposed(x), plain(x), rtol=1e-6, atol=1e-6)


# ---- B14 the sigmoid softcap

def test_sigmoid_softcap_is_bf16_in_training_and_fp32_in_evaluation():
    model = tg.build_model(tg.make_config("tiny", dtype="bfloat16", logit_softcap_form="sigmoid"))
    fill_random(model, names=["head.weight"])
    x = tg.rms_norm(torch.randn(6, 64)).bfloat16()
    train_logits = model.logits(x)
    z = F.linear(x, model.head.weight.bfloat16())
    assert train_logits.dtype == torch.bfloat16
    assert torch.equal(train_logits, 23 * torch.sigmoid((z + 5) / 7.5))  # every op in bf16
    model.eval()
    eval_logits = model.logits(x)
    want = 23 * torch.sigmoid((z.double() + 5) / 7.5)
    assert eval_logits.dtype == torch.float32
    torch.testing.assert_close(eval_logits.double(), want, rtol=1e-6, atol=0)
    assert not torch.equal(eval_logits, train_logits.float())


# ---- B15 multi-token prediction, B3 the token sum

def test_mtp_with_weights_one_is_the_next_token_loss_sum():
    logits, targets = torch.randn(20, 50), torch.randint(0, 50, (20,))
    ahead, inside = tg.multi_token_targets(targets, 1)
    got = tg.multi_token_loss(logits, ahead, inside, torch.tensor([1.0]))
    assert got.item() == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item(), rel=1e-6)


def test_mtp_loss_is_the_weighted_sum_over_positions_and_offsets_inside_the_sequence():
    logits, targets = torch.randn(9, 30).double(), torch.randint(0, 30, (9,))
    weights = [1.0, 0.5, 0.125]
    ahead, inside = tg.multi_token_targets(targets, 3)
    got = tg.multi_token_loss(logits, ahead, inside, torch.tensor(weights, dtype=torch.float64)).item()
    want = sum(w * (torch.logsumexp(logits[t], 0) - logits[t, targets[t + k]]).item()
               for t in range(9) for k, w in enumerate(weights) if t + k < 9)
    assert got == pytest.approx(want, rel=1e-12)


def test_the_training_loss_is_a_sum_over_tokens_and_evaluation_stays_a_mean():
    summed, mean = (tg.build_model(tiny(train_loss_reduction=r)) for r in ("sum", "mean"))
    fill_random(summed)
    fill_random(mean)
    T = summed.config.train_seq_len
    got, want = (loss_of(m, m.config, WINDOW) for m in (summed, mean))
    assert got.item() == pytest.approx(T * want.item(), rel=1e-6)
    summed.eval()
    assert loss_of(summed, summed.config, WINDOW).item() == pytest.approx(want.item(), rel=1e-6)


def test_mtp_weights_one_and_zero_are_the_next_token_loss_in_the_model():
    model = tg.build_model(tiny(train_loss_reduction="sum"))
    fill_random(model)
    plain = loss_of(model, model.config, WINDOW)
    mtp = loss_of(model, model.config, WINDOW, mtp_weights=torch.tensor([1.0, 0.0, 0.0]))
    assert mtp.item() == pytest.approx(plain.item(), rel=1e-6)
    model.eval()  # evaluation ignores the weights
    assert torch.equal(loss_of(model, model.config, WINDOW, mtp_weights=torch.tensor([1.0, 0.5])),
                       loss_of(model, model.config, WINDOW))


def test_the_runner_fills_one_mtp_buffer_in_place():
    runner = tg.Runner(tiny(), torch.device("cpu"))
    assert runner.mtp_input(None) is None and runner.mtp_input([1.0]) is None
    three = runner.mtp_input([1.0, 0.5, 0.25])
    two = runner.mtp_input([1.0, 0.375])
    assert two.tolist() == [1.0, 0.375] and two.data_ptr() == three.data_ptr()


# ---- B18 the scalar vector, B20 padded tables, parameter counts

def test_the_bulk_scalar_vector_is_the_records_layout_without_the_backout_slot():
    """The record's 56 scalars: the backout's weight (its own parameter here) counts in the padding."""
    model = tg.build_model(tg.make_config(**BULK), "meta")
    layout = [(name, len(values)) for name, values in model.scalar_layout]
    assert layout == [("resid", 16), ("attn_lambdas", 32), ("smear", 1), ("skip_gain", 3), ("pad", 3)]
    values = torch.tensor([v for _, vs in model.scalar_layout for v in vs])
    assert values[:16].tolist() == pytest.approx([1.05] * 16)
    assert values[16:48].tolist() == [0.5, 1.0] * 16 and values[48] == 0 and values[49:52].tolist() == [-1.5] * 3
    assert model.scalars.numel() + model.backout.weight.numel() == 56 and model.x0_lambdas.numel() == 32
    no_backout = tg.build_model(tg.make_config(**BULK, backout=False), "meta")
    assert no_backout.backout is None and no_backout.scalars.numel() == 56


def test_without_gated_skips_a_skip_weight_per_layer_comes_first():
    model = tg.build_model(tiny(gated_skips=False, smear_embed=False))
    assert [(n, len(v)) for n, v in model.scalar_layout] == [("skip_w", 16), ("resid", 16), ("attn_lambdas", 32),
                                                             ("pad", 7)]
    slots = model.scalar_slots()
    assert slots["skip_w"].eq(1).all() and slots["attn_lambdas"].view(16, 2).tolist() == [[0.5, 1.0]] * 16


def test_padded_tables_start_with_the_unpadded_tables_rows():
    padded, plain = (tg.build_model(tiny(pad_vocab_tables=p, untie_embed_after_step=0)) for p in (True, False))
    for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
        if p.shape != q.shape:
            assert p.shape[0] == 512 and q.shape[0] == 500 and torch.equal(p[:500], q), name


def test_medium_bulk_parameter_counts():
    model = tg.build_model(tg.make_config(**BULK), "meta")
    counts = tg.parameter_counts(model)
    assert counts["total"] == 613_420_440 and counts["in_use_before_split"] == 561_909_144
    assert counts["head"] == 50304 * 1024 and counts["embed"] == 2 * 50304 * 1024
    assert counts["value_embed"] == 5 * 50304 * 1024
    assert counts["muon_attn"] == 16 * 4 * 1024**2 and counts["muon_mlp"] == 16 * 2 * 4096 * 1024
    assert counts["muon_gates"] == 16 * 8 * 16 + 10 * 8 * 16
    assert counts["gates"] == 16 + 3 * 16 and counts["x0_lambdas"] == 32 and counts["scalar"] == 56


def test_bulk_parameters_carry_the_records_multipliers_and_groups():
    model = tg.build_model(tg.make_config(**BULK), "meta")
    groups = tg.parameter_groups(model)
    assert {(p.lr_mul, p.wd_mul) for p in groups["muon_gates"]} == {(0.1, 1.0)}
    assert {(p.lr_mul, p.wd_mul) for p in groups["gates"]} == {(0.01, 0.0)}
    assert all(b.mlp.proj_w.lr_mul == 2.0 and b.mlp.proj_w.shape == (4096, 1024) for b in model.blocks)


def test_dry_run_reports_the_bulk_counts_and_flops_per_window(capsys):
    assert tg.main(["--dry_run", *as_flags(BULK)]) == 0
    report = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["total_params"] == 613_420_440 and report["params_in_use_before_split"] == 561_909_144
    model = tg.build_model(tg.make_config(**BULK), "meta")
    matmul = sum(p.numel() for n, ps in tg.parameter_groups(model).items() if n == "head" or n.startswith("muon")
                 for p in ps)
    assert list(report["flops_per_token_by_window"]) == [  # the record's table's windows, in order
        "3/1", "7/3", "11/5", "13/6", "15/7", "17/8", "19/9", "21/10", "23/11"]
    long_w, short_w = 23, 11  # the last training window (the extension's: 23 and its half)
    want = 6 * matmul + 12 * 1024 * (4 * (long_w * 128 + 1) + 12 * (short_w * 128 + 1))
    assert report["flops_per_token_by_window"]["23/11"] == want


# ---- every switch off: nothing of theirs is built

def test_with_every_bulk_model_switch_off_nothing_of_theirs_is_built():
    """What stays is always on: the rotary tables (YaRN off: never rescaled) and the x0 weights."""
    off = dict(attn_output_gate=False, value_embed_gate=False, smear_embed=False, gated_skips=False,
               untie_embed_after_step=0, backout=False, key_offset=False, yarn_window_limit=0)
    model = tg.build_model(tiny(**off))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert not [n for n in names if "gate" in n or "backout" in n]
    assert not model.embed_tied and model.head.weight.dtype == torch.float32 and not model.head.weight.any()
    assert model.smear_gate is None and model.skip_gates is None and model.backout is None
    assert not any(b.attn.key_offset or b.attn.output_gate or b.attn.value_gate for b in model.blocks)
    assert "smear" not in model.scalar_slots() and "skip_gain" not in model.scalar_slots()
    assert tg.Runner(tiny(**off), torch.device("cpu")).yarn_steps == []
    full = tg.build_model(tiny())
    assert full.smear_gate is not None and full.backout is not None and full.embed_tied


# ---- the whole bulk forward against a float64 loop-by-loop forward

@pytest.mark.parametrize("tied,mtp", [(True, [1.0, 0.5, 0.25]), (False, None)])
def test_bulk_forward_matches_the_float64_reference(tied, mtp):
    config = tiny_bulk(rotary_bf16=False)  # fp32 everywhere, to compare at fp32 rounding
    model = tg.build_model(config)
    fill_random(model)
    model.embed_tied = tied
    model.rotary.set_changes(((2, 5), (5, 6)))  # YaRN as after two window changes
    inputs, targets = packed(config, seed=3, docs_per_block=0.8)
    window = torch.tensor([6, 2])  # blocks of 32 tokens: the edge blocks fall inside documents
    weights = None if mtp is None else torch.tensor(mtp)
    got = model(inputs, targets, window, mtp_weights=weights).item()
    want = reference_bulk_loss(model, inputs, targets, 6, 2, mtp)
    assert got == pytest.approx(want, rel=2e-5), (got, want)
    model.eval()
    got = model(inputs, targets, window).item()
    assert got == pytest.approx(reference_bulk_loss(model, inputs, targets, 6, 2), rel=2e-5)


def test_bulk_bf16_forward_is_close_to_the_fp32_one():
    """The bf16 path (bf16 tables, rotation, logits and cap) runs and stays within bf16 error."""
    losses = []
    for dtype, rotary_bf16 in (("float32", False), ("bfloat16", True)):
        config = tg.make_config("tiny", dtype=dtype, **{**BULK, "untie_embed_after_step": 3,
                                                         "rotary_bf16": rotary_bf16})
        model = tg.build_model(config)
        fill_random(model)
        losses.append(loss_of(model, config, torch.tensor([3, 1]), mtp_weights=torch.tensor([1.0, 0.5])).item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


@pytest.mark.slow
def test_bulk_runner_trains_through_the_split_and_the_yarn_change():
    """A few steps of the tiny model with every bulk switch, the record's optimizers, a YaRN change
    and the split inside: finite, decreasing losses; after the warm-up's restore, tied again, the
    input table's Adam state its initial one. On 4 blocks (FOUR_BLOCKS): long- and short-window
    blocks, the value embeddings, the skip and backout are all there, and a step costs half."""
    config = tiny_bulk(untie_embed_after_step=3, yarn_window_limit=13, num_iterations=20, warmup_steps=4,
                       train_loss_reduction="mean", **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    runner.warmup()
    table_state = runner.optimizers[0].state[runner.model.embeds[0].weight]
    assert runner.model.embed_tied and table_state["step"] == 0 and not table_state["exp_avg"].any()
    gen = torch.Generator().manual_seed(1)
    batches = runner.random_batches(gen)
    losses = [runner.train_step(s, batches, mtp_weights=[1.0, 0.5] if s < 2 else None).item() for s in range(8)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[2]
    assert not runner.model.embed_tied
    assert runner.yarn_steps and runner.model.rotary.changes == tuple(
        (old, new) for step, old, new in runner.yarn_steps if step <= 7)


@pytest.mark.slow
def test_bulk_model_on_flex_equals_sdpa_in_evaluation():
    """The whole bulk model on FlexAttention (compiled on its own: token-window BlockMasks, the
    YaRN scale as a tensor) gives the per-token losses of the dense SDPA path."""
    losses = []
    for attention in ("flex", "sdpa"):
        config = tiny_bulk(attention=attention, compile=False, rotary_bf16=False)
        model = tg.build_model(config).eval()
        fill_random(model)
        model.rotary.set_changes(((2, 5), (5, 6)))
        inputs, targets = packed(config, seed=4, docs_per_block=0.8)
        with torch.no_grad():
            losses.append(model(inputs, targets, torch.tensor([6, 2]), reduction="none"))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)


# ---- FP8 primitives (--fp8)

def test_fp8_codes_round_once_from_fp32_not_through_bf16():
    # a bf16 h divided in bf16 is rounded twice; the records divide in fp32 inside compiled code
    torch.manual_seed(0)
    h = torch.randn(4096).bfloat16()
    scale = 100 / 448
    codes = kernels.to_fp8(h, scale)
    once = (h.double() / scale).float().to(torch.float8_e4m3fn)  # fp64 quotient: one rounding in effect
    assert torch.equal(codes.float(), once.float())
    twice = (h / scale).to(torch.float8_e4m3fn)
    assert not torch.equal(codes.float(), twice.float())  # the difference this guards against exists here


def test_fp8_matmul_on_the_cpu_is_the_scaled_mm_product():
    gen = torch.Generator().manual_seed(1)
    a8 = kernels.to_fp8(torch.randn(32, 64, generator=gen), 32 / 448)
    b8 = kernels.to_fp8(torch.randn(64, 48, generator=gen) * 0.01, 2.25 / 448)
    ours = kernels.fp8_matmul(a8, b8, 32 / 448, 2.25 / 448, torch.bfloat16)
    theirs = torch._scaled_mm(a8, b8.t().contiguous().t(), scale_a=torch.tensor(32 / 448),
                              scale_b=torch.tensor(2.25 / 448), out_dtype=torch.bfloat16)
    assert torch.equal(ours, theirs)


def test_fp8_matmul_scales_by_the_fp32_product_of_fp32_scales():
    """_scaled_mm takes the scales as fp32 tensors and multiplies them in fp32; for PR #248's
    weight gradient (s_x = 32/448, s_g = 1.5/448) that is one fp32 step from the double product."""
    one = torch.ones(1, 1).to(torch.float8_e4m3fn)
    s_x, s_g = 32 / 448, 1.5 / 448
    got = kernels.fp8_matmul(one, one, s_x, s_g, torch.float32)
    fp32 = np.float32(np.float32(s_x) * np.float32(s_g))
    assert got.item() == fp32 != np.float32(s_x * s_g)
