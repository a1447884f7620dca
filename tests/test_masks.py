"""Attention masks: the block structure given to FlexAttention and the dense CPU mask both equal
the rule of docs/recipe.md ("Attention masks"), computed here the slow, literal way; FlexAttention and SDPA agree."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
import reference

BS, EOT = 128, 99


def literal_mask(ids, window):
    return reference.literal_mask(ids, window, BS, EOT)


def random_layout(rng, num_blocks: int, docs_per_block: float) -> np.ndarray:
    ids = rng.integers(0, EOT, size=num_blocks * BS)
    eots = rng.random(ids.size) < docs_per_block / BS
    ids[eots] = EOT
    return ids


CONFIG = tg.make_config("tiny", vocab_size=100, eot_token=EOT, attn_block_size=BS)
LAYOUTS = [  # (seed, blocks, expected documents per block): long documents to one per few tokens
    (0, 32, 0.05), (1, 32, 0.6), (2, 32, 3.0), (3, 32, 40.0),
]
SCHEDULE_WINDOWS = sorted(set(tg.window_blocks(s, tg.make_config()) for s in range(5690)))


def test_the_schedule_covers_windows_1_to_27():
    assert SCHEDULE_WINDOWS == list(range(1, 28))


@pytest.mark.parametrize("seed,num_blocks,density", LAYOUTS)
def test_dense_mask_equals_the_literal_rule_for_every_window_of_the_schedule(seed, num_blocks, density):
    ids = random_layout(np.random.default_rng(seed), num_blocks, density)
    ids_t = torch.from_numpy(ids)
    for window in SCHEDULE_WINDOWS:
        long_mask, short_mask = tg.attention_masks(ids_t, torch.tensor(window), CONFIG, "sdpa")
        assert torch.equal(long_mask, torch.from_numpy(literal_mask(ids, window))), f"long, W={window}"
        assert torch.equal(short_mask, torch.from_numpy(literal_mask(ids, window // 2))), f"short, W={window}"


@pytest.mark.parametrize("seed,num_blocks,density", LAYOUTS)
def test_flex_block_mask_materializes_to_the_literal_rule(seed, num_blocks, density):
    """The BlockMask's own tensors (kv_num_blocks/kv_indices, full_kv_*), expanded by hand with
    the mask_mod applied inside partial blocks only, give the literal rule's mask."""
    ids = random_layout(np.random.default_rng(seed), num_blocks, density)
    ids_t = torch.from_numpy(ids)
    docs = np.cumsum(ids == EOT)
    pos = np.arange(ids.size)
    token_rule = (pos[:, None] >= pos[None, :]) & (docs[:, None] == docs[None, :])
    for window in (1, 2, 3, 7, 14, 27):
        block_mask, _ = tg.attention_masks(ids_t, torch.tensor(window), CONFIG, "flex")
        dense = np.zeros((ids.size, ids.size), dtype=bool)
        for i in range(num_blocks):
            rows = slice(i * BS, (i + 1) * BS)
            for j in block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]].tolist():
                dense[rows, j * BS:(j + 1) * BS] = True
            for j in block_mask.kv_indices[0, 0, i, :block_mask.kv_num_blocks[0, 0, i]].tolist():
                cols = slice(j * BS, (j + 1) * BS)
                dense[rows, cols] |= token_rule[rows, cols]
        np.testing.assert_array_equal(dense, literal_mask(ids, window), err_msg=f"W={window}")


@pytest.mark.slow
def test_compiled_flex_attention_equals_sdpa_with_the_dense_mask():
    """Eager flex_attention on CPU ignores the block truncation (measured), so the compiled call
    is what must agree: this proves flex reads our block tensors as the dense mask says."""
    rng = np.random.default_rng(5)
    compiled = torch.compile(tg.flex_attention, dynamic=False)
    for density in (0.3, 4.0):
        ids = torch.from_numpy(random_layout(rng, 16, density))
        q, k, v = torch.randn(3, 1, 2, ids.numel(), 32).unbind(0)
        for window in (1, 2, 5, 16):
            block_mask, _ = tg.attention_masks(ids, torch.tensor(window), CONFIG, "flex")
            dense, _ = tg.attention_masks(ids, torch.tensor(window), CONFIG, "sdpa")
            got = compiled(q, k, v, block_mask=block_mask, scale=0.12)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.12)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"density {density}, W={window}")


def test_every_query_keeps_its_own_token():
    """The diagonal block is always the most recent partial candidate: no row is empty (no NaN)."""
    ids = torch.from_numpy(random_layout(np.random.default_rng(9), 8, 2.0))
    for window in (0, 1, 2):
        dense, _ = tg.attention_masks(ids, torch.tensor(window), CONFIG, "sdpa")
        assert dense.diagonal().all()
