"""The seed ideas (docs/ideas.md) as switches on top of the record (the defaults): matched
initialization, extra embeddings, x00 at the output, LoRE (on the record untied from the start:
its head doubles as the input table until the split), the value-embedding basis, accounting and
bits per byte."""
import functools
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from reference import reference_loss
from test_bulk_model import FOUR_BLOCK_FLAGS, FOUR_BLOCKS
from test_checkpoint import log_text, run_argv
from test_model import packed_tokens, randomize

ROOT = Path(__file__).resolve().parent.parent
UNTIED = dict(untie_embed_after_step=0)  # LoRE needs separate input table and head from the start
SWITCHES = [
    dict(num_extra_embeds=0), dict(num_extra_embeds=4), dict(x00_at_output=True),
    dict(lore_input=True, **UNTIED), dict(lore_output=True, **UNTIED),
    dict(lore_input=True, lore_output=True, lore_init="original", **UNTIED),
    dict(ve_mode="learned"), dict(ve_mode="frozen", ve_exec="materialized"),
    dict(ve_mode="grouped", value_embed_layout="0,1,2,2,2,-,-,-,-,-,-,0,1,2,2,2"),
]


# The value-embedding switches at four blocks (FOUR_BLOCKS otherwise) read two tables as at sixteen:
# the basis's first K sites one-hot and its later ones mixed (learned, frozen), a table read by three
# blocks (grouped); FOUR_BLOCKS' own layout (one table) would leave the basis a single table.
VE_FOUR_BLOCK_LAYOUTS = dict(learned="0,1,1,0", frozen="0,1,1,0", grouped="0,1,1,1")


def at_four_blocks(switch: dict) -> dict:
    """The switch on FOUR_BLOCKS, for tests whose property does not depend on the depth."""
    layout = VE_FOUR_BLOCK_LAYOUTS.get(switch.get("ve_mode"))
    return {**FOUR_BLOCKS, **switch, **({"value_embed_layout": layout} if layout else {})}


def tiny(dtype="float32", **overrides):
    return tg.make_config("tiny", dtype=dtype, **overrides)


def loss_of(model, config, seed=0, window=(3, 1)):
    inputs, targets = packed_tokens(config, seed=seed)
    return model(inputs, targets, torch.tensor(window))


# ---- matched initialization

@pytest.mark.parametrize("switch", SWITCHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_shared_parameters_start_identical_whatever_else_is_built(switch):
    """Against the record (untied from the start where the switch needs that)."""
    baseline = dict(tg.build_model(tiny(**{k: v for k, v in switch.items() if k in UNTIED})).named_parameters())
    other = dict(tg.build_model(tiny(**switch)).named_parameters())
    common = [n for n in baseline if n in other and baseline[n].shape == other[n].shape]
    assert len(common) >= len(baseline) - 4  # the switch touches only its own corner
    for name in common:
        assert torch.equal(baseline[name], other[name]), name


def test_unused_modules_are_not_built():
    names = set(dict(tg.build_model(tiny()).named_parameters()))
    assert not any(n.endswith(("output_mix", "coeffs", ".table.weight", ".proj", ".down", ".up")) for n in names)
    assert "head.weight" in names and "embeds.0.weight" in names


# ---- extra input embeddings

@pytest.mark.parametrize("extra", [0, 2, 4])
def test_extra_embeddings_mix_into_every_layer_as_documented(extra):
    """x = rho*x + a0*x00 + a1*x01 + ... at every layer: n = 0 drops the record's x01, each table
    adds one weight per layer (x0_lambdas, from 0; rho from 1.05). Against the float64 reference
    (fp32 rotary tables, so that only rounding separates them)."""
    config = tiny(num_extra_embeds=extra, rotary_bf16=False)
    model = tg.build_model(config)
    assert len(model.embeds) == 1 + extra
    resid, x0_weights = model.mixing_weights()
    assert x0_weights.shape == (16, 1 + extra) and torch.count_nonzero(x0_weights) == 0
    assert resid.tolist() == pytest.approx([1.05] * 16)
    randomize(model)
    inputs, targets = packed_tokens(config)
    got = model(inputs, targets, torch.tensor([2, 1])).item()
    assert got == pytest.approx(reference_loss(model, inputs, targets, 2, 1), rel=1e-5)


def test_each_extra_table_adds_v_times_d_to_the_embedding_group():
    """V = 50,304: the record pads its tables to the head's rows."""
    counts = [tg.parameter_counts(tg.build_model(tg.make_config(num_extra_embeds=n), "meta")) for n in range(5)]
    for n in range(4):
        assert counts[n + 1]["embed"] - counts[n]["embed"] == 50304 * 1024
        assert counts[n + 1]["x0_lambdas"] - counts[n]["x0_lambdas"] == 16
        assert counts[n + 1]["scalar"] == counts[n]["scalar"]


# ---- x00 at the output

def test_x00_at_output_starts_as_the_record_and_learns_a_weight():
    config = tiny(x00_at_output=True)
    with_mix, without = tg.build_model(config), tg.build_model(tiny())
    for model in (with_mix, without):  # non-zero head so the output matters
        torch.nn.init.normal_(model.head.weight, generator=torch.Generator().manual_seed(3))
    loss = loss_of(with_mix, config)
    assert torch.equal(loss, loss_of(without, config))
    loss.backward()
    assert with_mix.output_mix.grad[1] != 0
    with torch.no_grad():
        with_mix.output_mix[1] = 0.5
    assert not torch.equal(loss_of(with_mix, config), loss)


# ---- LoRE

@pytest.mark.parametrize("lore_input,lore_output", [(False, False), (True, False), (False, True), (True, True)])
def test_lore_parameter_counts_at_rank_128(lore_input, lore_output):
    V, Vp, d, r = 50304, 50304, 1024, 128  # the record's input tables are padded as the head is
    model = tg.build_model(tg.make_config(lore_input=lore_input, lore_output=lore_output, lore_rank=r, **UNTIED),
                           "meta")
    expected = 613_420_440
    if lore_input:  # both input tables (x00, x01) become V x r + r x d
        expected += 2 * (V * r + r * d - V * d)
    if lore_output:
        expected += Vp * r + r * d - Vp * d
    assert tg.parameter_counts(model)["total"] == expected


@pytest.mark.parametrize("flag", ["lore_input", "lore_output"])
def test_lore_on_the_tied_record_is_refused_in_one_line_naming_the_flag_that_allows_it(flag, capsys):
    """Until the split the record's head is also its input table; a low-rank factorization cannot
    be both. The nearest form, the record with separate tables from the start, is named."""
    with pytest.raises(tg.ConfigError, match=f"^--{flag}: .*add --untie_embed_after_step=0"):
        tg.make_config("tiny", **{flag: True})
    assert tg.main(["--preset=tiny", f"--{flag}=true", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --{flag}: ") and "--untie_embed_after_step=0" in err and len(err.splitlines()) == 1
    assert tg.main(["--preset=tiny", f"--{flag}=true", "--untie_embed_after_step=0", "--dry_run"]) == 0


@functools.lru_cache
def virtual_matrices(init, V=4096, d=1024, r=128):
    """The input table T @ P^T (V x d) and the head U @ D (V x d) as initialized (two layers and
    no value embeddings: the blocks play no part)."""
    config = tg.make_config("tiny", dtype="float32", vocab_size=V, eot_token=V - 1, model_dim=d, num_heads=8,
                            head_dim=128, lore_rank=r, lore_input=True, lore_output=True, lore_init=init,
                            num_extra_embeds=0, value_embed_layout="-,-", num_layers=2, skip_connections=(),
                            long_window_layers=(0,), backout_layer=0, **UNTIED)
    model = tg.build_model(config)
    embed, head = model.embeds[0], model.head
    return embed.table.weight @ embed.proj.T, head.up @ head.down


def test_corrected_init_gives_the_replaced_matrices_variance():
    """Input: the table it replaces is N(0, 1). Output: a default nn.Linear(d, V) has variance
    1/(3d). Sampling error of a variance over ~4M entries is far below the 3% allowed."""
    embed, head = virtual_matrices("corrected")
    assert embed.var().item() == pytest.approx(1.0, rel=0.03)
    assert head.var().item() == pytest.approx(1 / (3 * 1024), rel=0.03)


def test_original_init_inflates_the_head():
    """`original` draws the head's first factor N(0, 1/r): the virtual head's variance is 1/(3r),
    d/r times the 1/(3d) it replaces, i.e. d/(3r) times the default 1/d."""
    embed, head = virtual_matrices("original")
    d, r = 1024, 128
    assert embed.var().item() == pytest.approx(1.0, rel=0.03)
    assert head.var().item() == pytest.approx(d / (3 * r) / d, rel=0.03)
    _, corrected = virtual_matrices("corrected")
    assert head.var().item() / corrected.var().item() == pytest.approx(d / r, rel=0.05)


def test_none_init_uses_pytorch_defaults():
    embed, head = virtual_matrices("none")
    assert embed.var().item() == pytest.approx(1 / 3, rel=0.03)  # N(0,1) table, uniform(1/sqrt(r)) proj
    assert head.var().item() == pytest.approx(1 / (9 * 1024), rel=0.03)


def test_original_init_starts_with_a_visibly_higher_loss():
    """Logits of a unit-RMS x have variance d x Var(head): 1/3 under corrected, d/(3r) = 5.3 under
    original; the excess over ln(V) is about half the capped logits' variance (the sigmoid cap's
    slope at 0 is 0.69). Measured: 0.083 and 1.09. Evaluation: the mean loss, fp32 logits."""
    losses = {}
    for init in ("corrected", "original"):
        config = tiny(lore_output=True, lore_init=init, model_dim=128, head_dim=64, lore_rank=8, **UNTIED)
        losses[init] = loss_of(tg.build_model(config).eval(), config).item()
    excess = {k: v - math.log(512) for k, v in losses.items()}
    assert 0.05 < excess["corrected"] < 0.3 and excess["original"] > 5 * excess["corrected"], excess


def test_lore_factors_join_the_documented_optimizer_groups():
    """... with the record's multipliers of the tables they replace on the vocabulary-sized factors."""
    model = tg.build_model(tiny(lore_input=True, lore_output=True, **UNTIED))
    groups = tg.parameter_groups(model)
    assert groups["head"] == [model.head.up]
    assert groups["embed"] == [e.table.weight for e in model.embeds]
    assert groups["muon_lore"] == [e.proj for e in model.embeds] + [model.head.down]
    multipliers = lambda p: (getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0))
    plain = tg.build_model(tiny(**UNTIED))
    assert multipliers(model.head.up) == multipliers(plain.head.weight) == (1.0, 150.0)
    for lore, table in zip(model.embeds, plain.embeds):
        assert multipliers(lore.table.weight) == multipliers(table.weight)
    assert [multipliers(e.table.weight) for e in model.embeds] == [(1.0, 150.0), (75.0, 5.0)]
    assert all(multipliers(p) == (1.0, 1.0) for p in groups["muon_lore"])


# ---- value-embedding basis

def test_native_with_the_record_layout_is_the_record():
    model = tg.build_model(tg.make_config(ve_mode="native"), "meta")
    assert tg.parameter_counts(model) == tg.parameter_counts(tg.build_model(tg.make_config(), "meta"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["0,1,-,0", VE_FOUR_BLOCK_LAYOUTS["grouped"]])
@pytest.mark.parametrize("mode,exec_", [("learned", "direct"), ("learned", "materialized"), ("frozen", "direct")])
def test_one_hot_coefficients_reproduce_the_table_layout_exactly(dtype, layout, mode, exec_):
    """On four blocks (FOUR_BLOCKS with two tables: one read at both ends with a block without one
    between, or one read by three blocks; an exact equality of each block's rows, which does not
    depend on the depth)."""
    native = tg.build_model(tiny(dtype, **{**FOUR_BLOCKS, "value_embed_layout": layout}))
    mixed = tg.build_model(tiny(dtype, **{**FOUR_BLOCKS, "value_embed_layout": layout}, ve_mode=mode,
                                ve_coeff_init="assignment", ve_exec=exec_))
    randomize(native)
    mixed.load_state_dict(native.state_dict(), strict=False)  # everything but the coefficients
    config = tiny(dtype)
    assert torch.equal(loss_of(mixed, config), loss_of(native, config))


def test_canonical_coefficients():
    ve = tg.build_model(tiny(ve_mode="frozen")).value_embeds
    A = ve.coeffs
    sites = [0, 1, 2, 3, 4, 11, 12, 13, 14, 15]
    assert torch.equal(A[sites[:5]], torch.eye(5))
    assert torch.allclose(A[sites[5:]], torch.full((5, 5), 5**-0.5))
    assert torch.count_nonzero(A[5:11]) == 0


def test_direct_and_materialized_agree_in_bf16():
    """Same function, different rounding. Measured on this CPU: the losses agreed exactly, the
    worst gradient differed by 1.4% of its tensor's largest entry; allowed: 0.2% and 3%. (The
    input table gets no gradient while tied: left out.)"""
    results = {}
    for exec_ in ("direct", "materialized"):
        config = tiny("bfloat16", ve_mode="learned", ve_exec=exec_)
        model = tg.build_model(config)
        randomize(model, seed=4)
        loss = loss_of(model, config)
        loss.backward()
        results[exec_] = (loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                  if p.grad is not None})
    (loss_d, grads_d), (loss_m, grads_m) = results["direct"], results["materialized"]
    assert loss_d.item() == pytest.approx(loss_m.item(), rel=2e-3) and grads_d.keys() == grads_m.keys()
    for name in grads_d:
        scale = grads_d[name].abs().max().clamp_min(1e-6)
        assert ((grads_d[name] - grads_m[name]).abs().max() / scale) < 0.03, name


def test_direct_and_materialized_are_the_same_function_in_fp32():
    losses = []
    for exec_ in ("direct", "materialized"):
        config = tiny(ve_mode="learned", ve_exec=exec_)
        model = tg.build_model(config)
        randomize(model, seed=5)
        losses.append(loss_of(model, config).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_frozen_coefficients_get_no_update_and_no_optimizer_state():
    """On four blocks (the coefficients' handling does not depend on the depth)."""
    config = tiny(**at_four_blocks(dict(ve_mode="frozen")))
    runner = tg.Runner(config, torch.device("cpu"))
    coeffs = runner.model.value_embeds.coeffs
    assert not isinstance(coeffs, torch.nn.Parameter) and not coeffs.requires_grad
    before = coeffs.clone()
    inputs, targets = packed_tokens(config)
    for step in (0, 1):  # Adam steps on odd steps only
        runner.train_step(step, [(inputs, targets)] * 2)
    assert torch.equal(coeffs, before)
    assert all(p is not coeffs for opt in runner.optimizers for g in opt.param_groups for p in g["params"])


def test_learned_coefficients_train_with_their_own_lr():
    """On four blocks (the coefficients' optimizer does not depend on the depth)."""
    config = tiny(**at_four_blocks(dict(ve_mode="learned")), ve_coeff_lr=0.5)
    runner = tg.Runner(config, torch.device("cpu"))
    (group,) = [g for g in runner.optimizers[0].param_groups if g["name"] == "ve_coeff"]
    assert group["lr"] == 0.5 and group["params"] == [runner.model.value_embeds.coeffs]
    randomize(runner.model)  # with zero o-projections and value tables, no gradient reaches the coefficients
    before = runner.model.value_embeds.coeffs.detach().clone()
    inputs, targets = packed_tokens(config)
    runner.train_step(0, [(inputs, targets)] * 2)
    assert torch.equal(runner.model.value_embeds.coeffs, before)  # Adam steps on odd steps only
    runner.train_step(1, [(inputs, targets)] * 2)
    assert not torch.equal(runner.model.value_embeds.coeffs, before)


# ---- accounting

def test_accounting_reports_storage_and_optimizer_state_per_group():
    lines = tg.accounting_lines(tg.build_model(tg.make_config(), "meta"), tg.make_config())
    by_group = {line.split(":")[0]: line for line in lines}
    # muon_mlp: 134,217,728 stored fp32 (the master itself, no low bits) = 512 MiB; state fp32
    # momentum 512 MiB + NorMuon's fp32 statistic per row, 16 x 2 x 4096 x 4 B = 0.5 MiB
    assert "134,217,728 (float32) 512.0 MiB, optimizer state 512.5 MiB" in by_group["params muon_mlp"]
    # head: tied, so bf16 (a table until the split), Adam's two bf16 moments
    assert "51,511,296 (bfloat16) 98.2 MiB, optimizer state 196.5 MiB" in by_group["params head"]
    assert by_group["params total"].startswith("params total: 613,420,440")


# ---- bits per byte

def test_gpt2_byte_table():
    table = np.load(ROOT / "data/gpt2_token_bytes.npy")
    assert table.shape == (50257,) and table[50256] == 0
    assert (table[:256] == 1).all() and (table[256:50256] >= 2).all()
    assert table[262] == 4  # " the"
    assert table[13] == 1 and table[198] == 1  # "." and "\n"
    assert int(table.sum()) == 320_814


def test_gpt2_byte_table_generator_matches_the_committed_table(tmp_path):
    """Rebuild from a merges file written here (the first merges of GPT-2's, in its alphabet)."""
    sys.path.insert(0, str(ROOT / "data"))
    import gpt2_token_bytes as gtb
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he"] + ["a b"] * (50000 - 7)
    path = tmp_path / "merges.txt"
    path.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    tokens = gtb.token_bytes(path)
    assert tokens[0] == b"!" and tokens[188] == b"\x00"  # GPT-2's byte order: printable first
    assert tokens[256] == b" t" and tokens[262] == b" the"
    assert gtb.length_table(path)[262] == 4


def test_val_bpb_is_nats_over_ln2_bytes_without_end_of_text(tmp_path):
    """With the zero head (untied from the start) every target costs ln(512) nats; count the bytes by hand."""
    config = tiny(val_tokens=1024, val_seq_len=512, **UNTIED)
    vocab = config.vocab_size
    rng = np.random.default_rng(0)
    val = torch.from_numpy(rng.integers(0, vocab, 1025))
    val[::7] = config.eot_token
    byte_table = rng.integers(1, 5, vocab)
    byte_table[config.eot_token] = 0
    token_bytes = torch.zeros(config.padded_vocab_size, dtype=torch.int64)
    token_bytes[:vocab] = torch.from_numpy(byte_table)
    runner = tg.Runner(config, torch.device("cpu"))
    loss, bpb = runner.evaluate(0, val, token_bytes)
    targets = val[1:].numpy()
    counted = targets != config.eot_token
    want = counted.sum() * math.log(512) / (math.log(2) * byte_table[targets].sum())
    assert loss == pytest.approx(math.log(512), abs=1e-5)
    assert bpb == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_every_switch_trains_on_the_tiny_preset(switch):
    """On four blocks (at_four_blocks: each switch acts there as at sixteen; that a step helps does
    not depend on the depth)."""
    config = tiny(**at_four_blocks(switch))
    runner = tg.Runner(config, torch.device("cpu"))
    randomize(runner.model, seed=2)
    inputs, targets = packed_tokens(config)
    first = runner.train_step(0, [(inputs, targets)] * 2)
    second = runner.train_step(1, [(inputs, targets)] * 2)
    assert torch.isfinite(first) and second < first  # the same batch again: the step helped


def test_a_byte_table_of_the_wrong_size_is_refused_naming_the_flag(synthetic_dir, tmp_path, capsys):
    np.save(tmp_path / "bytes.npy", np.ones(10, dtype=np.uint8))
    assert tg.main(run_argv(synthetic_dir, tmp_path, f"--token_bytes_file={tmp_path / 'bytes.npy'}")) == 2
    err = capsys.readouterr().err
    assert "--token_bytes_file" in err and "10 entries, the vocabulary has 500" in err


def test_the_log_ends_with_the_learned_lambdas_per_layer():
    model = tg.build_model(tiny(num_extra_embeds=2, x00_at_output=True))
    with torch.no_grad():
        model.x0_lambdas.view(16, 3)[3, 1] = 0.25  # layer 3's weight on x01
    lines = tg.learned_scalars_lines(model)
    assert len(lines) == 19 and lines[-3:] == ["lambdas smear: 0.0000", "lambdas output: x:1.0000 x00:0.0000",
                                               "backout from layer 11: lambda:0.5000"]
    assert lines[3] == "lambdas layer 3: x:1.0500 x00:0.0000 x01:0.2500 x02:0.0000 attn_qkv:0.5000 attn_out:1.0000"
    assert lines[9].endswith(" skip_gain:-1.5000")  # the skip into layer 9


def test_the_ideas_together_run_the_whole_trainer_on_the_tiny_preset(synthetic_dir, tmp_path):
    """One short run of the trainer itself (warm-up, validation with BPB, the checkpoint, the log's
    accounting and lambdas) with every idea switched on at once, on four blocks (FOUR_BLOCKS: what
    is wired through the trainer does not depend on the depth)."""
    flags = [*FOUR_BLOCK_FLAGS, "--num_extra_embeds=2", "--x00_at_output=true", "--lore_input=true", "--lore_output=true",
             "--untie_embed_after_step=0", "--ve_mode=learned", "--save_every=4",
             f"--token_bytes_file={synthetic_dir / 'synthetic_token_bytes.npy'}"]
    assert tg.main(run_argv(synthetic_dir, tmp_path, *flags)) == 0
    log = log_text(tmp_path)
    assert "params muon_lore: " in log and "params ve_coeff: " in log and "lambdas output: x:" in log
    assert re.search(r"final val_loss:[0-9.]+ perplexity:[0-9.]+ val_bpb:[0-9.]+ ", log), log[-2000:]
    assert (tmp_path / "ck" / "tiny" / "step_000004").is_dir()
