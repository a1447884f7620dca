"""The model against docs/recipe.md ("Model"): a float64 reference forward, the step-0 loss, init, structure."""
import dataclasses
import math

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from reference import reference_loss


def randomize(model, seed=0):
    """Non-zero values everywhere (the record's zero inits would hide o, proj and the head)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (0.5 if p.ndim == 1 else 0.0))


def packed_tokens(config, seed=0, docs_per_block=1.5):
    rng = np.random.default_rng(seed)
    T = config.train_seq_len
    ids = rng.integers(0, config.vocab_size, T + 1)
    ids[rng.random(T + 1) < docs_per_block / config.attn_block_size] = config.eot_token
    ids = torch.from_numpy(ids)
    return ids[:-1].to(torch.int32), ids[1:].to(torch.int64)


@pytest.mark.parametrize("window", [1, 3])
def test_forward_matches_float64_reference_of_the_recipe(tiny_config, window):
    model = tg.build_model(tiny_config)
    randomize(model)
    inputs, targets = packed_tokens(tiny_config)
    got = model(inputs, targets, torch.tensor(window)).item()
    want = reference_loss(model, inputs, targets, window)
    assert got == pytest.approx(want, rel=1e-5), (got, want)  # fp32 vs fp64: ~1e-7 seen


def test_eval_mode_chunks_the_head_without_changing_the_loss(tiny_config):
    model = tg.build_model(tiny_config)
    randomize(model, seed=1)
    inputs, targets = packed_tokens(tiny_config, seed=1)
    train_loss = model(inputs, targets, torch.tensor(2)).item()
    model.eval()
    assert model(inputs, targets, torch.tensor(2)).item() == pytest.approx(train_loss, rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step0_loss_is_log_of_padded_vocab(dtype):
    """The head starts at zero, so every one of the padded vocabulary's logits is 0."""
    config = tg.make_config("tiny", dtype=dtype)
    model = tg.build_model(config)
    inputs, targets = packed_tokens(config)
    loss = model(inputs, targets, torch.tensor(1)).item()
    assert config.padded_vocab_size == 512
    assert loss == pytest.approx(math.log(512), abs=1e-4)


def test_medium_parameter_count_and_layout():
    model = tg.build_model(tg.make_config(), "meta")
    counts = tg.parameter_counts(model)
    assert counts["total"] == 608_885_856
    assert model.head.weight.shape == (50304, 1024) and model.head.weight.dtype == torch.float32
    assert [b.attn is None for b in model.blocks] == [i == 7 for i in range(16)]
    assert len(model.embeds) == 2 and len(model.value_embeds.tables) == 5
    assert all(e.weight.shape == (50257, 1024) and e.weight.dtype == torch.bfloat16 for e in model.embeds)
    assert model.blocks[0].attn.qkvo_w.shape == (4, 1024, 1024)
    assert model.scalars.numel() == 16 + 16 * 3 + 16 * 2


def test_init_follows_the_recipe(tiny_config):
    config = tg.make_config("tiny", dtype="float32", model_dim=128, head_dim=64)  # more samples per matrix
    model = tg.build_model(config)
    emb = model.embeds[0].weight
    assert emb.mean().abs() < 0.02 and emb.std().item() == pytest.approx(1.0, abs=0.02)
    qkvo = model.blocks[0].attn.qkvo_w
    bound = 3**0.5 * 0.5 / 128**0.5
    assert qkvo[:3].abs().max() <= bound and qkvo[:3].abs().max() > 0.98 * bound
    assert qkvo[:3].std().item() == pytest.approx(0.5 / 128**0.5, rel=0.03)
    assert torch.count_nonzero(qkvo[3]) == 0
    assert torch.count_nonzero(model.blocks[0].mlp.proj_w) == 0 and torch.count_nonzero(model.head.weight) == 0
    skip_w, lambdas, attn_lambdas = model.scalar_views()
    assert torch.equal(skip_w, torch.ones(16))
    assert torch.equal(lambdas, torch.tensor([[1.0, 0.0, 0.0]]).repeat(16, 1))
    assert torch.equal(attn_lambdas, torch.full((16, 2), 0.5))


def test_same_seed_same_init_and_other_seed_differs(tiny_config):
    a, b = tg.build_model(tiny_config), tg.build_model(tiny_config)
    c = tg.build_model(tg.make_config("tiny", dtype="float32", seed=1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0 and name != "scalars":
            assert not torch.equal(pa, pc), name


def test_flops_per_token_of_the_record():
    """docs/recipe.md ("Model FLOPs"): about 1.492 GFLOP/token from the weights, 0.194 from attention, 1.686 in all."""
    flops = tg.flops_per_token(tg.make_config(), tg.build_model(tg.make_config(), "meta"))
    assert flops["weights"] == 6 * (15 * 4 * 1024**2 + 16 * 2 * 4096 * 1024 + 50304 * 1024)
    assert flops["attention"] == pytest.approx(0.194e9, rel=2e-3)
    assert flops["total"] == pytest.approx(1.686e9, rel=1e-3)


# ---- activation checkpointing: the same function, recomputed in backward


def loss_grads_and_saved_bytes(config, seed=2):
    """Loss, gradients and the bytes of the tensors autograd keeps for backward (outside recomputed
    regions: what activation checkpointing is meant to shrink)."""
    model = tg.build_model(config)
    randomize(model, seed=seed)
    inputs, targets = packed_tokens(config, seed=seed)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = model(inputs, targets, torch.tensor(3))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


def test_activation_checkpointing_gives_bit_identical_loss_and_gradients(tiny_config, monkeypatch):
    """Each block (and the one loss chunk of a 512-token sequence) is recomputed with the same
    kernels, so on the CPU the numbers are the same bits."""
    calls = []
    real = tg.checkpoint
    monkeypatch.setattr(tg, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain_loss, plain_grads, _ = loss_grads_and_saved_bytes(tiny_config)
    assert calls == []
    loss, grads, _ = loss_grads_and_saved_bytes(dataclasses.replace(tiny_config, activation_checkpointing=True))
    assert len(calls) == tiny_config.num_layers + 1  # every block and the loss went through checkpoint
    assert torch.equal(loss, plain_loss)
    for name, g in grads.items():
        assert torch.equal(g, plain_grads[name]), name


def test_activation_checkpointing_keeps_a_fraction_of_the_activations(tiny_config):
    """Measured on the tiny model: 91 MiB saved for backward without, 9.5 MiB with."""
    *_, plain = loss_grads_and_saved_bytes(tiny_config)
    *_, recomputed = loss_grads_and_saved_bytes(dataclasses.replace(tiny_config, activation_checkpointing=True))
    assert recomputed < plain / 5, (recomputed, plain)


def test_chunked_loss_under_checkpointing_differs_only_by_summation_order(tiny_config, monkeypatch):
    """A 65,536-token sequence is split into 8 loss chunks; here 128-token chunks force 4. Summing 4
    partial sums instead of one changes only fp32 rounding: measured max relative gradient difference
    2e-7; asserted 1e-5 (relative to each gradient's largest entry), loss rel 1e-6."""
    plain_loss, plain_grads, _ = loss_grads_and_saved_bytes(tiny_config)
    monkeypatch.setattr(tg, "LOSS_CHUNK_TOKENS", 128)
    loss, grads, _ = loss_grads_and_saved_bytes(dataclasses.replace(tiny_config, activation_checkpointing=True))
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for name, g in grads.items():
        scale = plain_grads[name].abs().max()
        assert (g - plain_grads[name]).abs().max() <= 1e-5 * scale, name
