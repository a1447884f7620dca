"""The model against docs/bulk-model.md: a float64 reference forward, the step-0 loss, init, structure."""
import dataclasses
import math

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from reference import reference_loss


def randomize(model, seed=0):
    """Non-zero values everywhere (the record's zero inits would hide o, proj, the gates and the
    value embeddings)."""
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


@pytest.mark.parametrize("window,untie,mtp", [((3, 1), None, None), ((7, 3), 0, [1.0, 0.5, 0.25])],
                         ids=["tied-3/1", "untied-7/3-mtp"])
def test_forward_matches_float64_reference_of_the_recipe(window, untie, mtp):
    """The tiny preset's model (the record's switches; fp32 rotary tables, so that only fp32 rounding
    separates it from float64), tied and untied, after two YaRN changes; training (summed, with and
    without multi-token prediction) and evaluation."""
    config = tg.make_config("tiny", dtype="float32", rotary_bf16=False, untie_embed_after_step=untie)
    model = tg.build_model(config)
    assert model.embed_tied == (untie is None)
    randomize(model)
    model.rotary.set_changes(((3, 7), (7, 11)))
    inputs, targets = packed_tokens(config)
    got = model(inputs, targets, torch.tensor(window), mtp_weights=None if mtp is None else torch.tensor(mtp)).item()
    want = reference_loss(model, inputs, targets, *window, mtp)
    assert got == pytest.approx(want, rel=1e-5), (got, want)  # fp32 vs fp64: ~5e-8 seen
    model.eval()
    got = model(inputs, targets, torch.tensor(window)).item()
    assert got == pytest.approx(reference_loss(model, inputs, targets, *window), rel=1e-5)


def test_eval_mode_chunks_the_head_without_changing_the_loss(tiny_config):
    """Evaluation takes the mean over 4 head chunks; training (here asked for its mean, it defaults
    to the sum) one chunk: the same number."""
    model = tg.build_model(tiny_config)
    randomize(model, seed=1)
    inputs, targets = packed_tokens(tiny_config, seed=1)
    window = torch.tensor([3, 1])
    train_loss = model(inputs, targets, window, reduction="mean").item()
    assert model(inputs, targets, window).item() == pytest.approx(train_loss * targets.numel(), rel=1e-6)  # the sum
    model.eval()
    assert model(inputs, targets, window).item() == pytest.approx(train_loss, rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step0_loss_is_log_of_padded_vocab(dtype):
    """Untied from the start the head starts at zero, so every one of the padded vocabulary's
    logits is the same (the cap of 0) and the loss is ln 512. Tied (the record), the head starts
    N(0, 0.005^2): the logits spread a little and the input token's own row (x00 is that row,
    normed) scores about d x 0.005; measured excess over ln 512: 0.00098 in both dtypes.
    Evaluation: fp32 logits (bf16 training logits round the loss itself by up to 0.08)."""
    for untie, low, high in ((0, -1e-4, 1e-4), (None, 5e-4, 2e-3)):
        config = tg.make_config("tiny", dtype=dtype, untie_embed_after_step=untie)
        model = tg.build_model(config).eval()
        inputs, targets = packed_tokens(config)
        loss = model(inputs, targets, torch.tensor([1, 1])).item()
        assert config.padded_vocab_size == 512
        assert low < loss - math.log(512) < high, (untie, loss - math.log(512))


def test_medium_parameter_count_and_layout():
    """docs/bulk-model.md ("Counts and FLOPs")."""
    model = tg.build_model(tg.make_config(), "meta")
    counts = tg.parameter_counts(model)
    assert counts["total"] == 613_420_440 and counts["in_use_before_split"] == 613_420_440 - 50304 * 1024
    assert model.embed_tied  # tied until the split: the head is stored in the model dtype, as a table
    assert model.head.weight.shape == (50304, 1024) and model.head.weight.dtype == torch.bfloat16
    assert all(b.attn is not None for b in model.blocks)
    assert len(model.embeds) == 2 and len(model.value_embeds.tables) == 5
    assert all(e.weight.shape == (50304, 1024) and e.weight.dtype == torch.bfloat16 for e in model.embeds)
    assert model.blocks[0].attn.qkvo_w.shape == (4, 1024, 1024) and model.blocks[0].attn.qkvo_w.dtype == torch.float32
    assert model.blocks[0].mlp.proj_w.shape == (4096, 1024)  # stored transposed
    # resid, attention lambdas, smear, skip gains and 3 pads; with the backout's weight 56, as the record counts them
    assert model.scalars.numel() == 16 + 16 * 2 + 1 + 3 + 3 and model.x0_lambdas.numel() == 16 * 2
    assert model.backout.layer == 11 and model.backout.weight.numel() == 1 and counts["scalar"] == 56


def test_init_follows_the_recipe():
    config = tg.make_config("tiny", dtype="float32", model_dim=128, head_dim=64)  # more samples per matrix
    model = tg.build_model(config)
    emb = model.embeds[0].weight  # the input table (read after the split) and x01's: N(0, 1)
    for table in (emb, model.embeds[1].weight):
        assert table.mean().abs() < 0.02 and table.std().item() == pytest.approx(1.0, abs=0.02)
    head = model.head.weight  # tied: N(0, 0.005^2)
    assert head.mean().abs() < 2e-4 and head.std().item() == pytest.approx(0.005, rel=0.02)
    qkvo = model.blocks[0].attn.qkvo_w
    bound = 3**0.5 * 1.0 / 128**0.5  # qkv_init_std 1
    assert qkvo[:3].abs().max() <= bound and qkvo[:3].abs().max() > 0.98 * bound
    assert qkvo[:3].std().item() == pytest.approx(1.0 / 128**0.5, rel=0.03)
    assert torch.count_nonzero(qkvo[3]) == 0 and torch.count_nonzero(model.blocks[0].mlp.proj_w) == 0
    fc = model.blocks[0].mlp.fc_w
    assert fc.std().item() == pytest.approx(0.5 / 128**0.5, rel=0.03)
    zero = [t.weight for t in model.value_embeds.tables] + [p for n, p in model.named_parameters() if "gate" in n]
    assert all(torch.count_nonzero(p) == 0 for p in zero) and torch.count_nonzero(model.x0_lambdas) == 0
    # resid 1.05 x 16, attention lambdas (0.5, 1) x 16, smear 0, skip gains -1.5 x 3, 3 pads (with backout: 56)
    want = [1.05] * 16 + [0.5, 1.0] * 16 + [0.0] + [-1.5] * 3 + [1.0] * 3
    assert model.scalars.tolist() == pytest.approx(want) and model.backout.weight.item() == 0.5


def test_same_seed_same_init_and_other_seed_differs(tiny_config):
    a, b = tg.build_model(tiny_config), tg.build_model(tiny_config)
    c = tg.build_model(tg.make_config("tiny", dtype="float32", seed=1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.numel() > 1 and pa.std() > 0 and name != "scalars":
            assert not torch.equal(pa, pc), name


def test_flops_per_token_of_the_record():
    """docs/bulk-model.md ("Counts and FLOPs"): 1.5170e9 per token from the matmuls (gates
    included), and per window pair of the schedule; attention averaged over the run's tokens,
    counted here slot by slot of the step grid (4700 steps in 12 slots, then 40 at 23/11)."""
    config = tg.make_config()
    model = tg.build_model(config, "meta")
    flops = tg.flops_per_token(config, model)
    assert flops["weights"] == 6 * (16 * 4 * 1024**2 + 16 * 2 * 4096 * 1024 + 50304 * 1024 + 16 * 8 * 16 + 10 * 8 * 16)
    assert flops["weights"] == pytest.approx(1.5170e9, rel=1e-4)
    per_token = lambda lw, sw: 12 * 1024 * (4 * (lw * 128 + 1) + 12 * (sw * 128 + 1))  # 4 long layers, 12 short
    longs = (3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23)
    batch = (131072, 262144, 393216) + (524288,) * 9
    num = den = 0
    for k in range(12):
        steps = math.ceil((k + 1) * 4700 / 12) - math.ceil(k * 4700 / 12)
        num += steps * batch[k] * per_token(longs[k], min(11, longs[k] // 2))
        den += steps * batch[k]
    num, den = num + 40 * 524288 * per_token(23, 11), den + 40 * 524288
    assert flops["attention"] == pytest.approx(num / den, rel=1e-12)
    by_window = tg.flops_by_window(config, model)
    for window, want in (("3/1", 1.5550e9), ("13/6", 1.7123e9), ("23/11", 1.8696e9)):
        assert by_window[window] == pytest.approx(want, rel=1e-4), window


# ---- activation checkpointing: the same function, recomputed in backward


def loss_grads_and_saved_bytes(config, seed=2):
    """Loss (the training loss of the record's first steps: summed, multi-token), gradients and the
    bytes of the tensors autograd keeps for backward (outside recomputed regions: what activation
    checkpointing is meant to shrink)."""
    model = tg.build_model(config)
    randomize(model, seed=seed)
    inputs, targets = packed_tokens(config, seed=seed)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = model(inputs, targets, torch.tensor([3, 1]), mtp_weights=torch.tensor([1.0, 0.5, 0.25]))
    loss.backward()
    # tied (the record's start), the input table gets no gradient: it is left out
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


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
    assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, plain_grads[name]), name


def test_activation_checkpointing_keeps_a_fraction_of_the_activations(tiny_config):
    """Measured on the tiny model: 91.4 MiB saved for backward without, 9.4 MiB with."""
    *_, plain = loss_grads_and_saved_bytes(tiny_config)
    *_, recomputed = loss_grads_and_saved_bytes(dataclasses.replace(tiny_config, activation_checkpointing=True))
    assert recomputed < plain / 5, (recomputed, plain)


def test_chunked_loss_under_checkpointing_differs_only_by_summation_order(tiny_config, monkeypatch):
    """A 65,536-token sequence is split into 8 loss chunks; here 128-token chunks force 4. Summing 4
    partial sums instead of one changes only fp32 rounding: measured max relative gradient difference
    1.4e-7, loss 6e-8; asserted 1e-5 (relative to each gradient's largest entry), loss rel 1e-6."""
    plain_loss, plain_grads, _ = loss_grads_and_saved_bytes(tiny_config)
    monkeypatch.setattr(tg, "LOSS_CHUNK_TOKENS", 128)
    loss, grads, _ = loss_grads_and_saved_bytes(dataclasses.replace(tiny_config, activation_checkpointing=True))
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for name, g in grads.items():
        scale = plain_grads[name].abs().max()
        assert (g - plain_grads[name]).abs().max() <= 1e-5 * scale, name
