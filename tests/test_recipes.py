"""The later records as recipes (docs/recipes.md): `--recipe NAME` sets each record's values; Snoo's
outer step against a hand computation and against the CUDA kernel's arithmetic written element by
element; Muon update smoothing in both forms against a hand computation and at beta = 0; the lr
floor and the beta ramp against the records' formulas; backout and smear against the float64
reference forward and, frozen at their initial values, against the recipe before them; parameter
counts, memory predictions, matched initialization; every recipe learns; the warm-up restores
all of the new state; the Newton-Schulz input as the records' compiled update normalizes it.
Resume and multi-process tests: test_checkpoint.py, test_distributed.py."""
import dataclasses
import json
import math
import struct

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from reference import reference_loss
from test_model import packed_tokens, randomize
from test_training import all_state, assert_same_state, random_batches

CPU = torch.device("cpu")
LATER = ["snoo", "update_smoothing", "smoothed_snoo", "backout", "smear"]

# What each record's script sets (the top of its log, upstream), over x01's values.
RECORD_VALUES = {
    "x01": dict(num_iterations=5690, muon_lr=0.025),
    "snoo": dict(num_iterations=5640, muon_lr=0.027, snoo_period=28, snoo_lr=0.68, snoo_momentum=0.37),
    "update_smoothing": dict(num_iterations=5610, muon_lr=0.03, muon_update_smoothing="interpolated",
                             smoothing_beta_start=0.5, smoothing_beta=0.2, smoothing_ramp_steps=3000, lr_floor=0.01),
    "smoothed_snoo": dict(num_iterations=5590, muon_lr=0.03, snoo_period=28, snoo_lr=0.68, snoo_momentum=0.37,
                          muon_update_smoothing="ema", smoothing_beta_start=0.2, smoothing_beta=0.2, lr_floor=0.01),
    "backout": dict(num_iterations=5550, muon_lr=0.03, snoo_period=28, snoo_lr=0.68, snoo_momentum=0.37,
                    muon_update_smoothing="ema", smoothing_beta_start=0.2, smoothing_beta=0.2, lr_floor=0.01,
                    backout="mix", backout_layer=11),
    "smear": dict(num_iterations=5535, muon_lr=0.03, snoo_period=28, snoo_lr=0.68, snoo_momentum=0.37,
                  muon_update_smoothing="ema", smoothing_beta_start=0.2, smoothing_beta=0.2, lr_floor=0.01,
                  backout="mix", backout_layer=11, head_smear=True),
}
PARAMETERS = dict(x01=608_885_856, snoo=608_885_856, update_smoothing=608_885_856, smoothed_snoo=608_885_856,
                  backout=608_885_858, smear=608_885_859)


def tiny(recipe="x01", dtype="float32", **overrides):
    return tg.make_config("tiny", recipe, dtype=dtype, **overrides)


# ---- the recipes as configurations


@pytest.mark.parametrize("name", list(RECORD_VALUES))
def test_a_recipe_sets_its_records_values_and_nothing_else(name):
    config, x01 = tg.make_config(recipe=name), tg.make_config()
    touched = {k for values in RECORD_VALUES.values() for k in values} | {"smoothing_ramp_steps"}
    want = {**{k: getattr(x01, k) for k in touched}, **RECORD_VALUES[name]}
    assert {k: getattr(config, k) for k in want} == want
    others = [f.name for f in tg.fields(config) if f.name not in want and f.name != "recipe"]
    assert [n for n in others if getattr(config, n) != getattr(x01, n)] == []
    assert config.recipe == name


def test_flags_override_the_recipe_wherever_they_stand_and_the_recipe_overrides_the_preset():
    for argv in (["--recipe=snoo", "--muon_lr=0.02"], ["--muon_lr=0.02", "--recipe", "snoo"]):
        config = tg.parse_args(argv)
        assert (config.recipe, config.muon_lr, config.snoo_period, config.num_iterations) == ("snoo", 0.02, 28, 5640)
    assert tg.parse_args(["--recipe=smear"]) == tg.make_config(recipe="smear")
    assert tg.parse_args(["--preset=tiny", "--recipe=smear", "--seed=3"]) == tg.make_config("tiny", "smear", seed=3)


def test_under_the_tiny_preset_a_recipe_keeps_its_switches_and_the_preset_its_scale():
    for name in LATER:
        config, medium = tiny(name, dtype="auto"), tg.make_config(recipe=name)
        assert config.num_iterations == 200 and config.model_dim == 64  # the preset's scale
        switches = {k for k in RECORD_VALUES[name] if k not in ("num_iterations", "smoothing_ramp_steps")}
        assert {k: getattr(config, k) for k in switches} == {k: getattr(medium, k) for k in switches}
    # the 3000-step beta ramp keeps its share of the run: 3000 / 5610 of 200 steps
    assert tiny("update_smoothing").smoothing_ramp_steps == round(3000 / 5610 * 200) == 107
    assert tiny("snoo").snoo_period == 28


def test_an_unknown_recipe_is_refused_naming_the_flag_and_the_choices(capsys):
    assert tg.main(["--recipe=bulk2", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert "--recipe: unknown recipe 'bulk2'" in err and "smoothed_snoo" in err


def test_help_lists_each_recipe_with_its_records_published_result():
    text = " ".join(tg.help_text().split())
    published = {"x01": "1412.45 s mean over 19 runs", "snoo": "1404.03 s mean over 30 runs",
                 "update_smoothing": "1410.96 s mean over 160 runs", "smoothed_snoo": "1405.70 s mean over 160 runs",
                 "backout": "1384.62 s mean over 22 runs", "smear": "1374.69 s mean over 26 runs",
                 "bulk": "1041.28 s mean over 2 runs"}
    p_values = dict(x01="p=0.00036", snoo="p=0.0032", update_smoothing="p=3.2e-05", smoothed_snoo="p=1.2e-11",
                    backout="p=0.000126", smear="p=1.13e-05", bulk="p=0.0046")
    for name, r in tg.RECIPES.items():
        assert f"{name} ({r.date}, {r.folder})" in text
        assert published[name] in text and p_values[name] in text
    assert "--snoo_period=28 --snoo_lr=0.68 --snoo_momentum=0.37 --muon_lr=0.027 --num_iterations=5640" in text


def test_the_recipe_name_is_bookkeeping_and_the_fields_it_sets_decide_a_resume():
    """A resume compares what is computed: --recipe=snoo and x01 with Snoo's flags are the same run."""
    dtype = torch.float32
    record = lambda c: tg.config_record(c, dtype)
    by_hand = tg.make_config(**tg.RECIPES["snoo"].values)
    assert tg.config_differences(record(tg.make_config(recipe="snoo")), record(by_hand)) == {}
    diffs = tg.config_differences(record(tg.make_config()), record(tg.make_config(recipe="snoo")))
    assert set(diffs) == {"snoo_period", "muon_lr", "num_iterations"}  # lr and momentum defaults are Snoo's
    assert [f.metadata["group"] for f in tg.fields(tg.Hyperparameters) if f.name == "recipe"] == ["bookkeeping"]


def test_ablate_arms_over_recipes_parse_and_share_their_initial_tensors(tmp_path):
    """records/ablate.py --grid recipe=x01,smear runs the trainer with these flags (its
    trainer_flags): both arms parse, differ only in the smear recipe's fields, and every tensor the
    arms share starts bit-identical, so the arms pair seed by seed."""
    arms = {}
    for name in ("x01", "smear"):
        argv = ["--preset=tiny", f"--recipe={name}", "--seed=5", f"--run_id=recipe-{name}_s5",
                f"--log_dir={tmp_path / name}", "--num_iterations=50"]
        arms[name] = tg.parse_args(argv)
    differing = {f.name for f in tg.fields(tg.Hyperparameters)
                 if getattr(arms["x01"], f.name) != getattr(arms["smear"], f.name)}
    assert differing == {"muon_lr", "snoo_period", "muon_update_smoothing", "lr_floor", "backout", "head_smear",
                         "recipe", "run_id", "log_dir"}  # the others the smear recipe sets are x01's defaults
    x01 = dict(tg.build_model(arms["x01"]).named_parameters())
    smear = dict(tg.build_model(arms["smear"]).named_parameters())
    assert set(smear) - set(x01) == {"backout.weights", "head_smear.weight"}
    for name, p in x01.items():
        assert torch.equal(p, smear[name]), name


def test_tensors_two_recipes_share_start_identical():
    """The x01 lineage; the bulk record is a lineage of its own (next test)."""
    names = [name for name in tg.RECIPES if name != "bulk"]
    models = {name: dict(tg.build_model(tiny(name, dtype="bfloat16", seed=2)).named_parameters()) for name in names}
    for name, params in models.items():
        for other, other_params in models.items():
            for k in set(params) & set(other_params):
                assert torch.equal(params[k], other_params[k]), (name, other, k)


def test_the_bulk_recipe_and_its_ablations_share_their_tensors_identical():
    """Every tensor the bulk recipe shares with itself minus one switch starts identical; the scalar
    vector's slots are compared by name (a switch adds or drops slots, and so moves the others)."""
    bulk_model = tg.build_model(tiny("bulk", dtype="bfloat16", seed=2))
    bulk = dict(bulk_model.named_parameters())
    for switch in ("smear_embed", "gated_skips", "attn_output_gate", "value_embed_gate", "separate_x0_lambdas"):
        model = tg.build_model(tiny("bulk", dtype="bfloat16", seed=2, **{switch: False}))
        ablated = dict(model.named_parameters())
        shared = (set(bulk) & set(ablated)) - {"scalars"}
        assert len(shared) > len(bulk) // 2, switch
        for k in shared:
            assert torch.equal(bulk[k], ablated[k]), (switch, k)
        slots, ablated_slots = bulk_model.scalar_slots(), model.scalar_slots()
        for slot in (set(slots) & set(ablated_slots)) - {"pad"}:
            assert torch.equal(slots[slot], ablated_slots[slot]), (switch, slot)


# ---- --dry_run at the record's size


def dry_run_output(argv, capsys) -> tuple[str, dict]:
    assert tg.main(["--dry_run", *argv]) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_dry_run_counts_each_recipes_parameters(name, capsys):
    out, summary = dry_run_output([f"--recipe={name}"], capsys)
    assert summary["total_params"] == PARAMETERS[name]
    assert summary["params_by_group"]["scalar"] == 96 + PARAMETERS[name] - PARAMETERS["x01"]
    assert f"recipe {name}: record {tg.RECIPES[name].folder}" in out


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_dry_run_predicts_each_recipes_peak_within_3_mib_of_its_records_log(name, capsys):
    """x01's logged peak plus the state the recipe adds per GPU (Snoo: two copies of every
    parameter, 2,519 MiB; smoothing: one bf16 copy of the busiest rank's Muon matrices, 48 MiB) and
    the mix's two kept (T, d) activations (256 MiB)."""
    out, _ = dry_run_output([f"--recipe={name}"], capsys)
    line = next(line for line in out.splitlines() if line.startswith("predicted peak memory allocated:"))
    predicted, logged = (int(n.replace(",", "")) for n in
                         (line.split(": ")[1].split(" MiB")[0], line.split("logged ")[1].split(" MiB")[0]))
    assert logged == tg.RECIPES[name].peak_mib
    assert abs(predicted - logged) <= 3, line


def test_dry_run_accounts_snoo_as_two_copies_of_every_parameter_per_gpu(capsys):
    out, _ = dry_run_output(["--recipe=snoo"], capsys)
    with torch.device("meta"):
        cuda_model = tg.GPT(tg.make_config(recipe="snoo"), torch.bfloat16)
    copy = sum(p.numel() * p.element_size() for p in cuda_model.parameters())
    assert 1.3e9 < copy < 1.33e9  # 557.4M bf16 + 51.5M fp32 (head) + scalars
    assert f"snoo state: {2 * copy / 2**20:.1f} MiB on every process" in out
    assert f"snoo {2 * copy / 2**20:,.1f} MiB" in out


def test_no_peak_is_predicted_for_other_shapes(capsys):
    out, _ = dry_run_output(["--preset=tiny", "--recipe=smear"], capsys)
    assert "predicted peak memory: none" in out


# ---- schedules: the records' formulas


def test_lr_floor_is_the_records_formula_at_every_step():
    config = tg.make_config(recipe="update_smoothing")
    N = config.num_iterations
    for step in range(N + 1):
        x = step / N
        want = 1.0 if x < 1 - 0.7 else (1 - x) / 0.7 * (1 - 0.01) + 0.01
        assert tg.lr_multiplier(step, config) == want, step
    assert tg.lr_multiplier(N - 1, config) == pytest.approx(0.01 + 0.99 / (0.7 * N))


def test_lr_floor_zero_is_todays_schedule_bit_for_bit():
    config = tg.make_config()
    for step in range(config.num_iterations + 1):
        x = step / config.num_iterations
        assert tg.lr_multiplier(step, config) == (1.0 if x < 0.3 else max((1 - x) / 0.7, 0.0))


def test_smoothing_beta_ramps_over_3000_absolute_steps_as_in_the_record():
    config = tg.make_config(recipe="update_smoothing")
    for step in range(config.num_iterations):
        frac = min(step / 3000, 1)
        assert tg.update_smoothing_beta(step, config) == (1 - frac) * 0.5 + frac * 0.2, step
    assert tg.update_smoothing_beta(0, config) == 0.5 and tg.update_smoothing_beta(3000, config) == 0.2
    constant = tg.make_config(recipe="smoothed_snoo")
    assert {tg.update_smoothing_beta(s, constant) for s in range(constant.num_iterations)} == {0.2}


# ---- Muon update smoothing


def identity_orthogonalize(G, dtype=torch.bfloat16):
    return G.to(dtype)


@pytest.mark.parametrize("form", ["interpolated", "ema"])
def test_two_smoothed_updates_worked_by_hand_on_a_2x2_matrix(form, monkeypatch):
    """Newton-Schulz replaced by the identity and momentum 0, so the update u is the gradient;
    beta 0.5 then 0.25 (ramp from 0.5 to 0.25 over 1 step), lr 0.5, no weight decay; all values
    dyadic, so fp32 computes them exactly.
      u1 = [[1, -2], [0.5, 4]], u2 = [[-1, 0.5], [2, 0.25]], w0 = [[0.5, 0.25], [-1, 2]]
      S1 = 0.5 u1 = [[0.5, -1], [0.25, 2]]
      S2 = 0.25 S1 + 0.75 u2 = [[-0.625, 0.125], [1.5625, 0.6875]]
      interpolated: v1 = 0.5 S1 + 0.5 u1 = 0.75 u1, v2 = 0.25 S2 + 0.75 u2
                    w1 = w0 - 0.5 v1 = [[0.125, 1], [-1.1875, 0.5]]
                    w2 = w1 - 0.5 v2 = [[0.578125, 0.796875], [-2.1328125, 0.3203125]]
      ema:          v1 = S1, v2 = S2
                    w1 = [[0.25, 0.75], [-1.125, 1]], w2 = [[0.5625, 0.6875], [-1.90625, 0.65625]]"""
    monkeypatch.setattr(tg, "orthogonalize", identity_orthogonalize)
    config = tiny(muon_update_smoothing=form, smoothing_beta_start=0.5, smoothing_beta=0.25, smoothing_ramp_steps=1)
    w = torch.nn.Parameter(torch.tensor([[0.5, 0.25], [-1.0, 2.0]]))
    opt = tg.Muon([dict(params=[w])], lr=0.5, momentum=0.0, weight_decay=0.0, update_smoothing=form)
    u1, u2 = torch.tensor([[1.0, -2.0], [0.5, 4.0]]), torch.tensor([[-1.0, 0.5], [2.0, 0.25]])
    want = {"interpolated": [[[0.125, 1.0], [-1.1875, 0.5]], [[0.578125, 0.796875], [-2.1328125, 0.3203125]]],
            "ema": [[[0.25, 0.75], [-1.125, 1.0]], [[0.5625, 0.6875], [-1.90625, 0.65625]]]}[form]
    smoothed = [[[0.5, -1.0], [0.25, 2.0]], [[-0.625, 0.125], [1.5625, 0.6875]]]
    for step, u in enumerate((u1, u2)):
        opt.param_groups[0].update(momentum=0.0, update_smoothing=tg.update_smoothing_beta(step, config))
        w.grad = u.clone()
        opt.step()
        assert torch.equal(w.detach(), torch.tensor(want[step])), step
        assert torch.equal(opt.state[w]["smoothed_update"], torch.tensor(smoothed[step])), step


@pytest.mark.parametrize("form", ["interpolated", "ema"])
def test_bf16_smoothed_update_is_stored_rounded_and_applied_from_its_fp32_value(form):
    """S is stored in the weight's dtype; the update applied is formed from the fp32 new S (what
    the compiled update, the record's too, keeps in registers), not from its bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(8, 8, generator=gen) * 0.1).bfloat16()
    S0 = torch.randn(8, 8, generator=gen).bfloat16()
    g = torch.randn(8, 8, generator=gen).bfloat16()
    w = torch.nn.Parameter(w0.clone())
    opt = tg.Muon([dict(params=[w])], lr=0.02, momentum=0.0, weight_decay=0.0, update_smoothing=form)
    opt.state[w]["smoothed_update"].copy_(S0)
    opt.param_groups[0].update(momentum=0.0, update_smoothing=0.3)
    w.grad = g.clone()
    opt.step()
    u = tg.orthogonalize(g.float(), torch.bfloat16).float()  # momentum 0: the update of g itself
    beta, one_minus = torch.tensor(0.3), torch.tensor(1 - 0.3)
    S_new = beta * S0.float() + one_minus * u
    assert torch.equal(opt.state[w]["smoothed_update"], S_new.bfloat16())
    applied = S_new if form == "ema" else beta * S_new + one_minus * u
    master = w0.float().addcmul(applied, torch.tensor(-0.02))
    assert torch.equal(tg.fp32_from_halves(w.detach(), opt.state[w]["low_bits"]).view(torch.int32),
                       master.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["interpolated", "ema"])
def test_smoothing_with_beta_zero_is_todays_muon_bit_for_bit(form, dtype):
    gen = torch.Generator().manual_seed(1)
    shapes = [(32, 16), (16, 32), (4, 16, 16)]
    start = [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]
    runs = []
    for smoothing in ("off", form):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = tg.Muon([dict(params=params, wd_mul=2.0)], lr=0.02, momentum=0.9, weight_decay=0.01,
                      update_smoothing=smoothing)
        for step, gs in enumerate(grads):
            for group in opt.param_groups:
                group.update(momentum=0.85 + 0.05 * step, lr=0.02 / (step + 1))
                if smoothing != "off":
                    group["update_smoothing"] = 0.0
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt))
    (plain, plain_opt), (smoothed, smoothed_opt) = runs
    for p, q in zip(plain, smoothed):
        assert torch.equal(p, q)
        for key, value in plain_opt.state[p].items():
            assert torch.equal(value, smoothed_opt.state[q][key]), key
        assert smoothed_opt.state[q]["smoothed_update"].any()  # S does hold the (unsmoothed) updates
    assert not torch.equal(plain[0].detach(), start[0])


def test_smoothing_off_builds_no_state_and_on_holds_one_buffer_per_owned_matrix():
    off = tg.Runner(tiny(dtype="bfloat16"), CPU)
    on = tg.Runner(tiny("update_smoothing", dtype="bfloat16"), CPU)
    assert all("smoothed_update" not in s for s in off.optimizers[1].state.values())
    assert "update_smoothing" not in off.optimizers[1].param_groups[0]
    states = on.optimizers[1].state.values()
    assert len(states) == len(off.optimizers[1].state)
    assert all(s["smoothed_update"].dtype == torch.bfloat16 and not s["smoothed_update"].any() for s in states)


# ---- Snoo


def snoo_over(weight: torch.Tensor, period, lr, momentum):
    p = torch.nn.Parameter(weight.clone())
    return p, tg.Snoo([("w", p)], period, lr, momentum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_outer_steps_worked_by_hand_on_a_2x2_matrix(dtype):
    """Period 2, outer lr 1/2, momentum 1/4; inner steps add D0, D1, D2 (dyadic: exact in bf16).
      anchor p0 = [[1, -2], [1/2, 0]]; D0 = [[1/4, 1/2], [-1/8, 3/4]]
      call 0 (outer): w = p0 + D0; d = p0 - w = -D0; b = d = [[-1/4, -1/2], [1/8, -3/4]]
                      w = p0 - 1/2 (d + 1/4 b) = p0 + 5/8 D0 = [[37/32, -27/16], [27/64, 15/32]] = anchor
      call 1:         w += D1 = [[-1/2, 1/4], [1/4, 1/8]]           (no outer step)
      call 2 (outer): w += D2 = [[1/8, -1/4], [1/2, -1/2]]; d = anchor - w = [[3/8, 0], [-3/4, 3/8]]
                      b = 1/4 b + d = [[5/16, -1/8], [-23/32, 3/16]]
                      w = anchor - 1/2 (d + 1/4 b) = [[119/128, -107/64], [227/256, 33/128]] = anchor"""
    t = lambda rows: torch.tensor(rows, dtype=torch.float64).to(dtype)
    p, snoo = snoo_over(t([[1, -2], [0.5, 0]]), period=2, lr=0.5, momentum=0.25)
    inner = [t([[0.25, 0.5], [-0.125, 0.75]]), t([[-0.5, 0.25], [0.25, 0.125]]), t([[0.125, -0.25], [0.5, -0.5]])]
    after = [t([[37 / 32, -27 / 16], [27 / 64, 15 / 32]]), t([[37 / 32 - 0.5, -27 / 16 + 0.25], [27 / 64 + 0.25, 15 / 32 + 0.125]]),
             t([[119 / 128, -107 / 64], [227 / 256, 33 / 128]])]
    anchors = [after[0], after[0], after[2]]
    momenta = [t([[-0.25, -0.5], [0.125, -0.75]])] * 2 + [t([[5 / 16, -1 / 8], [-23 / 32, 3 / 16]])]
    for call, delta in enumerate(inner):
        with torch.no_grad():
            p.add_(delta)
        snoo.step()
        assert torch.equal(p.detach(), after[call]), call
        assert torch.equal(snoo.anchors["w"], anchors[call]) and torch.equal(snoo.momentum_buffers["w"], momenta[call])
        assert snoo.counter == call + 1 and p.dtype == snoo.anchors["w"].dtype == snoo.momentum_buffers["w"].dtype


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def bf16(x: float) -> float:
    """Round an fp32 value to bf16, to nearest with ties to even, on its bits."""
    bits = struct.unpack("I", struct.pack("f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]


def kernel_step(w: float, a: float, b, lr: float, mu: float, store):
    """torch's fused CUDA SGD (Nesterov, dampening 0) on one element, after the record's Snoo set
    grad = a - w (a tensor subtraction in the storage dtype) and w = a: p and g are read as fp32
    (opmath) and combined with the double lr and momentum in double; the buffer and the weight are
    stored from their double value (through fp32) and g is an fp32 variable."""
    g = store(f32(a - w))
    buf = g if b is None else mu * b + (1 - 0.0) * g
    new_b = store(f32(buf))
    g = f32(g + mu * buf)
    new_w = store(f32(a - lr * g))
    return new_w, new_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outer_update_is_the_fused_cuda_sgd_kernels_arithmetic_element_by_element(dtype):
    """Three outer steps (the first creates the buffer) on 2000 elements, against kernel_step in
    Python floats."""
    store = bf16 if dtype == torch.bfloat16 else f32
    gen = torch.Generator().manual_seed(3)
    anchor = (torch.randn(2000, generator=gen) * torch.rand(2000, generator=gen) * 4).to(dtype)
    p, snoo = snoo_over(anchor, period=1, lr=0.68, momentum=0.37)
    a_list, b_list = anchor.double().tolist(), [None] * 2000
    for step in range(3):
        with torch.no_grad():
            p.add_((torch.randn(2000, generator=gen) * 0.01).to(dtype))
        w_list = p.detach().double().tolist()
        snoo.step()
        expected = [kernel_step(w, a, b, 0.68, 0.37, store) for w, a, b in zip(w_list, a_list, b_list)]
        got_w, got_b = p.detach().double().tolist(), snoo.momentum_buffers["w"].double().tolist()
        assert got_w == [e[0] for e in expected], step
        assert got_b == [e[1] for e in expected], step
        a_list, b_list = got_w, got_b
    assert snoo.anchors["w"].double().tolist() == a_list


def test_a_bf16_outer_step_rounds_the_new_weight_to_nearest_even():
    """Anchor 1, inner iterates 1 + 2^-7 and 1 + 3*2^-7, lr 1/2, momentum 0: the new weights are
    1 - (1/2)(-2^-7) = 1 + 2^-8 and 1 + 3*2^-8, both halfway between two bf16 values; to even they
    go to 1 and 1 + 2^-6 (truncation would give 1 and 1 + 2^-7)."""
    p, snoo = snoo_over(torch.ones(2, dtype=torch.bfloat16), period=1, lr=0.5, momentum=0.0)
    with torch.no_grad():
        p.copy_(torch.tensor([1 + 2**-7, 1 + 3 * 2**-7]))
    snoo.step()
    assert p.detach().tolist() == [1.0, 1 + 2**-6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outer_step_with_period_1_lr_1_momentum_0_returns_the_inner_iterate_where_the_displacement_is_exact(dtype):
    """w_new = anchor - (anchor - w): w itself whenever anchor - w is exact in the storage dtype
    (Sterbenz: w/2 <= anchor <= 2w), and otherwise one rounding of that difference away."""
    gen = torch.Generator().manual_seed(4)
    anchor = torch.randn(5000, generator=gen).to(dtype)
    inner = (anchor.double() * (0.5 + 1.5 * torch.rand(5000, generator=gen, dtype=torch.float64))).to(dtype)
    inner[:500] = torch.randn(500, generator=gen).to(dtype)  # sign changes and far jumps too
    p, snoo = snoo_over(anchor, period=1, lr=1.0, momentum=0.0)
    with torch.no_grad():
        p.copy_(inner)
    snoo.step()
    exact = (anchor - inner).double() == anchor.double() - inner.double()
    assert exact[500:].all() and not exact.all()
    assert torch.equal(p.detach()[exact], inner[exact])
    d = (anchor - inner).double()
    assert torch.equal(p.detach()[~exact].double(), (anchor.double() - d)[~exact].to(dtype).double())


def test_snoo_with_period_1_lr_1_momentum_0_trains_like_the_inner_optimizers_alone():
    """The identity in training: each outer update returns the inner iterate up to the rounding of
    a displacement that is not exact. Here the first two steps are bit-identical; in the third a few
    displacements round (measured: weights then differ by at most 9.3e-10; Adam's normalization
    amplifies such differences from the next step on, to 2.3e-5 after a fourth)."""
    base = tiny(warmup_steps=0)
    plain, wrapped = tg.Runner(base, CPU), tg.Runner(dataclasses.replace(base, snoo_period=1, snoo_lr=1.0,
                                                                         snoo_momentum=0.0), CPU)
    for step in range(3):
        batches = random_batches(base, step)
        a, b = plain.train_step(step, batches), wrapped.train_step(step, batches)
        assert torch.equal(a, b)
        if step < 2:
            assert_same_state(all_state(plain), all_state(wrapped))
    wrapped_params = dict(wrapped.model.named_parameters())
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(wrapped_params[name], p, rtol=0, atol=1e-8, msg=name)
    assert any(not torch.equal(p, wrapped_params[n]) for n, p in plain.model.named_parameters())


def test_outer_steps_follow_the_inner_steps_of_steps_0_k_2k():
    config = tiny(warmup_steps=0, snoo_period=3)
    runner = tg.Runner(config, CPU)
    assert runner.outer.counter == 0 and runner.outer.momentum_buffers == {}
    outer_steps = []
    for step in range(8):
        before = {k: v.clone() for k, v in runner.outer.anchors.items()}
        runner.train_step(step, random_batches(config, step))
        moved = any(not torch.equal(before[k], v) for k, v in runner.outer.anchors.items())
        if moved:
            outer_steps.append(step)
            for name, p in runner.model.named_parameters():  # the model is the new anchor
                assert torch.equal(p, runner.outer.anchors[name])
    assert outer_steps == [0, 3, 6] and runner.outer.counter == 8


@pytest.mark.parametrize("low_bits", ["keep", "clear"])
def test_an_outer_step_keeps_the_low_bits_of_the_inner_step_or_clears_them(low_bits):
    """bf16 Muon matrices: the outer step writes the bf16 weight. `keep` (the records) leaves the
    low 16 bits of the inner step's fp32 master, which the next Muon step combines with the new
    bf16 half; `clear` makes the master exactly the new weight. Seen around the outer step after
    step 2 (period 2), when two inner steps have moved the weights by several bf16 ulps."""
    config = tiny(dtype="bfloat16", warmup_steps=0, snoo_period=2, snoo_low_bits=low_bits)
    runner = tg.Runner(config, CPU)
    muon, real_step, seen = runner.optimizers[1], runner.outer.step, {}

    def observed_step():
        if runner.outer.counter == 2:
            seen["before"] = {p: (p.detach().clone(), s["low_bits"].clone()) for p, s in muon.state.items()}
        real_step()
        if runner.outer.counter == 3:
            seen["after"] = {p: (p.detach().clone(), s["low_bits"].clone()) for p, s in muon.state.items()}

    runner.outer.step = observed_step
    for step in range(3):
        runner.train_step(step, random_batches(config, step))
    moved = 0
    for p, (weight, bits) in seen["before"].items():
        new_weight, new_bits = seen["after"][p]
        moved += int((new_weight != weight).sum())
        assert bits.any()
        assert torch.equal(new_bits, bits if low_bits == "keep" else torch.zeros_like(bits))
    assert moved > 1000  # the outer step did rewrite the bf16 halves


def test_snoo_off_builds_nothing():
    runner = tg.Runner(tiny(), CPU)
    assert runner.outer is None


# ---- backout and the head smear


HEAD_INPUTS = [dict(backout="mix"), dict(backout="subtract"), dict(head_smear=True),
               dict(backout="mix", head_smear=True), dict(backout="subtract", backout_layer=4)]


@pytest.mark.parametrize("switch", HEAD_INPUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_head_input_ideas_match_the_float64_reference_forward(switch):
    """tests/reference.py: a*norm(h15) + b*norm(h_layer) with no norm after; norm(h15 - lambda*h_layer);
    then y_t = x_t + c*x_(t-1) over the whole packed sequence (documents ignored)."""
    config = tiny(**switch)
    model = tg.build_model(config)
    randomize(model)
    inputs, targets = packed_tokens(config, docs_per_block=4)
    got = model(inputs, targets, torch.tensor(3)).item()
    assert got == pytest.approx(reference_loss(model, inputs, targets, 3), rel=1e-5)
    baseline = tg.build_model(tiny())
    randomize(baseline)
    assert abs(got - baseline(inputs, targets, torch.tensor(3)).item()) > 1e-3  # the idea changes the loss


def test_new_parameters_start_at_the_records_values_in_the_scalar_group():
    mix = tg.build_model(tiny("smear"))
    assert torch.equal(mix.backout.weights, torch.tensor([1.0, 0.0])) and torch.equal(mix.head_smear.weight, torch.zeros(1))
    scalar = tg.parameter_groups(mix)["scalar"]
    assert any(p is mix.backout.weights for p in scalar) and any(p is mix.head_smear.weight for p in scalar)
    assert all(p.dtype == torch.float32 for p in scalar)
    sub = tg.build_model(tiny(backout="subtract"))
    assert torch.equal(sub.backout.weights, torch.tensor([0.5]))
    assert (sub.backout.weights.lr_mul, sub.backout.weights.wd_mul) == (5.0, 0.0)
    assert not hasattr(mix.backout.weights, "lr_mul")
    plain = dict(tg.build_model(tiny("smoothed_snoo")).named_parameters())
    assert not any(n.startswith(("backout", "head_smear")) for n in plain)


def test_smear_keeps_the_activation_dtype():
    smear = tg.HeadSmear()
    with torch.no_grad():
        smear.weight.fill_(0.25)
    x = torch.randn(6, 4).bfloat16()
    y = smear(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[0], x[0]) and torch.equal(y[3], (x[3] + 0.25 * x[2]))


def frozen_run(config, freeze: tuple[str, ...], steps=4):
    runner = tg.Runner(config, CPU)
    for name, p in runner.model.named_parameters():
        if name.startswith(freeze):
            p.requires_grad_(False)
    losses = [runner.train_step(s, random_batches(config, 10 + s)).item() for s in range(steps)]
    return runner, losses


@pytest.mark.parametrize("recipe,before,frozen", [("backout", "smoothed_snoo", ("backout",)),
                                                  ("smear", "backout", ("head_smear",))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backout_frozen_at_1_0_and_smear_frozen_at_0_train_exactly_like_the_recipe_before(recipe, before, frozen,
                                                                                          dtype):
    """Four steps with outer steps after steps 0 and 2 (period 2): every shared parameter and
    optimizer state, the Snoo anchors and momenta, and the losses are bit-identical."""
    a, losses_a = frozen_run(tiny(before, dtype=dtype, warmup_steps=0, snoo_period=2), ())
    b, losses_b = frozen_run(tiny(recipe, dtype=dtype, warmup_steps=0, snoo_period=2), frozen)
    assert losses_a == losses_b
    state_a, state_b = all_state(a), all_state(b)
    assert {k for k in state_b if k not in state_a} == {f"param/{n}" for n, _ in b.model.named_parameters()
                                                       if n.startswith(frozen)}
    assert_same_state(state_a, {k: v for k, v in state_b.items() if k in state_a})
    for k, v in a.outer.anchors.items():
        assert torch.equal(v, b.outer.anchors[k]) and torch.equal(a.outer.momentum_buffers[k], b.outer.momentum_buffers[k])
    assert losses_a[0] != losses_a[-1]


def test_every_switch_off_is_the_x01_recipe():
    """The golden files pin x01's numbers (tests/test_golden.py); here: x01 builds none of the new
    modules or states, and the lr multiplier is today's."""
    runner = tg.Runner(tiny(dtype="bfloat16"), CPU)
    assert runner.outer is None and runner.model.backout is None and runner.model.head_smear is None
    assert runner.optimizers[1].smoothing == "off"
    assert {k for s in runner.optimizers[1].state.values() for k in s} == {"momentum_buffer", "low_bits"}


# ---- the warm-up restores the new state; every recipe learns


@pytest.mark.parametrize("recipe,dtype", [("smear", "float32"), ("smear", "bfloat16"), ("update_smoothing", "bfloat16")])
def test_warmup_then_restore_equals_a_fresh_build_with_every_recipe_state(recipe, dtype):
    """The warm-up runs outer steps (period 2 over 3 steps) and smoothed updates; afterwards the
    anchors, the (absent) outer momentum, the counter and the smoothing buffers are those of a
    fresh build, and the next steps are the same steps."""
    config = tiny(recipe, dtype=dtype, warmup_steps=3, snoo_period=2 if recipe == "smear" else 0)
    fresh, warmed = tg.Runner(config, CPU), tg.Runner(config, CPU)
    warmed.warmup()
    assert_same_state(all_state(warmed), all_state(fresh))
    if warmed.outer is not None:
        assert warmed.outer.counter == 0 and warmed.outer.momentum_buffers == {}
        assert_same_state(warmed.outer.anchors, fresh.outer.anchors)
    for step in range(3):
        batches = random_batches(config, step)
        assert torch.equal(fresh.train_step(step, batches), warmed.train_step(step, batches))
    assert_same_state(all_state(warmed), all_state(fresh))
    if warmed.outer is not None:
        assert_same_state(warmed.outer.state_dict()["momentum_buffers"], fresh.outer.state_dict()["momentum_buffers"])


LEARN_STEPS = 20


@pytest.fixture(scope="module")
def recipe_runs(synthetic_dir, tmp_path_factory):
    """Every later recipe, tiny, LEARN_STEPS steps on the session's synthetic data: {recipe: log
    body}. (x01, the defaults, learns in tests/test_training.py's full tiny run.)"""
    bodies = {}
    for name in LATER:
        out = tmp_path_factory.mktemp(f"recipe_{name}")
        argv = ["--preset=tiny", f"--recipe={name}", "--seed=0", f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
                f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false",
                f"--num_iterations={LEARN_STEPS}", f"--val_every={LEARN_STEPS}", "--val_tokens=2048",
                "--warmup_steps=1", f"--log_dir={out}"]
        assert tg.main(argv) == 0
        (log,) = out.glob("*.txt")
        bodies[name] = log.read_text().split("=" * 100 + "\n")[-1]
    return bodies


def val_losses(body: str) -> list[float]:
    return [float(line.split("val_loss:")[1].split()[0]) for line in body.splitlines()
            if line.startswith("step:") and "val_loss:" in line]


@pytest.mark.slow
@pytest.mark.parametrize("name", LATER)
def test_every_recipe_learns_from_the_same_start(name, recipe_runs):
    """All start at ln(512) = 6.238 (the zero head; backout (1, 0) and smear 0 change nothing at step
    0) and lose more than half a nat in 20 steps (measured: 5.28 without the head-input ideas,
    4.92 and 4.93 with them; the synthetic data's unigram entropy is 6.07)."""
    first, last = val_losses(recipe_runs[name])
    assert first == pytest.approx(math.log(512), abs=1e-4)
    assert last < first - 0.5, last


@pytest.mark.slow
def test_the_log_names_the_recipe_and_the_learned_head_input_weights(recipe_runs):
    for name, body in recipe_runs.items():
        assert f"recipe {name}: record {tg.RECIPES[name].folder}" in body
    assert "backout from layer 11: a:" in recipe_runs["backout"] and "head smear: c:" in recipe_runs["smear"]
    assert "head smear:" not in recipe_runs["backout"] and "backout from layer" not in recipe_runs["snoo"]


# ---- the GPU path: what runs compiled there compiles whole and computes the same


@pytest.mark.slow
@pytest.mark.parametrize("form", ["interpolated", "ema"])
def test_compiled_smoothed_muon_update_agrees_with_eager_to_fp32_rounding(form):
    """fullgraph compile of the update with smoothing (fp32 weights; the scalars refilled in place,
    so a new beta compiles nothing); three steps of a new lr, momentum and beta each. Fused
    multiply-adds and the norm's summation order round differently: within 1e-7 on weights of
    magnitude 0.25 (as the plain update, tests/test_gpu_path.py)."""
    gen = torch.Generator().manual_seed(6)
    start = torch.randn(48, 24, generator=gen) * 0.05
    grads = [torch.randn(48, 24, generator=gen) for _ in range(3)]
    runs = []
    for compile_update in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = tg.Muon([dict(params=[p], wd_mul=2.0)], lr=0.02, momentum=0.9, weight_decay=0.01,
                      compile_update=compile_update, update_smoothing=form)
        for step, g in enumerate(grads):
            opt.param_groups[0].update(lr=0.025 / (1 + step), momentum=0.85 + 0.04 * step,
                                       update_smoothing=0.5 - 0.1 * step)
            p.grad = g.clone()
            opt.step()
        runs.append((p.detach().clone(), opt.state[p]["smoothed_update"].clone()))
    (w_eager, s_eager), (w_compiled, s_compiled) = runs
    torch.testing.assert_close(w_compiled, w_eager, rtol=0, atol=1e-7)
    torch.testing.assert_close(s_compiled, s_eager, rtol=0, atol=1e-6)
    assert not torch.equal(w_eager, start)


@pytest.mark.parametrize("module", ["mix", "subtract", "smear"])
def test_head_input_modules_compile_whole_and_round_once_to_bf16(module):
    """What the compiled model runs on a GPU: one graph (fullgraph), bf16 out, computed in fp32
    and rounded once: within half a bf16 ulp (2^-8 relative) of the float64 formula."""
    gen = torch.Generator().manual_seed(7)
    h, h_b = torch.randn(256, 64, generator=gen).bfloat16(), torch.randn(256, 64, generator=gen).bfloat16()
    m = tg.HeadSmear() if module == "smear" else tg.Backout(module, 11)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    compiled = torch.compile(m, fullgraph=True, dynamic=False)(*((h,) if module == "smear" else (h, h_b)))
    assert compiled.dtype == torch.bfloat16
    w = (m.weight if module == "smear" else m.weights).detach().tolist()
    norm = lambda x: x / x.square().mean(-1, keepdim=True).sqrt()
    x, x_b = h.double(), h_b.double()
    if module == "mix":
        want = w[0] * norm(x) + w[1] * norm(x_b)
    elif module == "subtract":
        want = norm(x - w[0] * x_b)
    else:
        want = torch.cat([x[:1], x[1:] + w[0] * x[:-1]])
    torch.testing.assert_close(compiled.double(), want, rtol=2**-8 + 1e-5, atol=1e-5)


def records_compiled_tail(master, smoothed, update, beta, lr, interpolated: bool):
    """The records' smoothing written as their scripts do (bf16 S and update, beta a float64 0-d
    tensor), followed by their fp32 master update, for torch.compile."""
    smoothed.copy_(beta * smoothed + (1 - beta) * update)
    applied = beta * smoothed + (1 - beta) * update if interpolated else smoothed
    master.add_(other=applied, alpha=-lr)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["interpolated", "ema"])
def test_smoothing_computes_what_the_records_compiled_expressions_compute(form):
    """Compiled (Inductor, on the CPU), the records' expressions keep the new S in fp32 for the
    applied update and round only what is stored; smooth_update does that explicitly, eagerly.
    Bit for bit on 65,536 bf16 elements, beta 0.2 (as an fp32 scalar, as Muon passes it), on every
    CPU kind: the applied update is seen through a master update with lr a power of two, so
    master - lr * applied rounds once whether the kernel fuses the multiply-add (Inductor always,
    aten's addcmul with AVX2 or AVX512) or not (aten's kernels without vectors, where lr = 0.03
    sqrt(2) made a twentieth of the elements differ)."""
    gen = torch.Generator().manual_seed(8)
    S = torch.randn(1 << 16, generator=gen).bfloat16()
    u = torch.randn(1 << 16, generator=gen).bfloat16()
    master = torch.randn(1 << 16, generator=gen)
    lr = 2.0**-5
    want_master, want_S = master.clone(), S.clone()
    torch.compile(records_compiled_tail, dynamic=False)(want_master, want_S, u, torch._as_tensor_fullprec(0.2),
                                                        torch._as_tensor_fullprec(lr), form == "interpolated")
    got_S = S.clone()
    applied = tg.smooth_update(u, got_S, torch.tensor(0.2), torch.tensor(1 - 0.2), form == "ema")
    got_master = master.addcmul(applied.float(), torch.tensor(-lr))
    assert torch.equal(got_S, want_S)
    assert torch.equal(got_master.view(torch.int32), want_master.view(torch.int32))
    rounded_first = master.addcmul((torch.tensor(0.2) * got_S.float() + torch.tensor(0.8) * u.float()
                                    if form == "interpolated" else got_S.float()), torch.tensor(-lr))
    assert not torch.equal(rounded_first, want_master)  # applying the stored (rounded) S would differ


def records_newton_schulz_input(G):
    """The records' Newton-Schulz opens with these lines (for torch.compile): the momentum cast to
    bf16, transposed if it has more rows than columns, then divided by its Frobenius norm + 1e-7."""
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def exact_norm_momentum(shape, seed):
    """A momentum whose squared Frobenius norm every summation order computes exactly: integers,
    mostly |k| <= 63 (bf16 holds them), one in ~128 an odd 257..511 (9 significant bits: bf16 rounds
    it), each matrix's sum of squares below 2**24 (fp32 holds every partial sum)."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.randint(-63, 64, shape, generator=gen).float()
    wide = torch.rand(shape, generator=gen) < 1 / 128
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    G[wide] = (sign * (torch.randint(128, 256, shape, generator=gen) * 2 + 1))[wide]
    assert G.double().square().sum(dim=(-2, -1)).max() < 2**24 and not torch.equal(G.bfloat16().float(), G)
    return G


def compiled_and_eager_normalization(G, monkeypatch):
    """(the records' compiled normalization, orthogonalize's with no iteration), the same way round."""
    want = torch.compile(records_newton_schulz_input, dynamic=False)(G)
    if G.size(-2) > G.size(-1):
        want = want.mT  # orthogonalize returns the matrix the right way round
    monkeypatch.setattr(tg, "NEWTON_SCHULZ_COEFFS", ())  # no iteration: orthogonalize returns its input
    return want, tg.orthogonalize(G, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 64, 64), (48, 24)])
def test_newton_schulz_input_is_what_the_records_compiled_update_normalizes(shape, monkeypatch):
    """The records cast the momentum to bf16 before dividing by its norm, inside a compiled update,
    where Inductor keeps the cast's value in fp32: they divide the fp32 momentum by its fp32 norm
    and round once, as orthogonalize does eagerly. Bit for bit on every CPU kind for a momentum
    whose norm is exact in any summation order (then every step is one correctly rounded IEEE
    operation: sqrt, + 1e-7, the division, the cast); the same lines run eagerly round the momentum
    and its norm to bf16 first and differ in a quarter to a third of the elements."""
    G = exact_norm_momentum(shape, seed=3)
    want, got = compiled_and_eager_normalization(G, monkeypatch)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    numerator_rounded = (G.bfloat16().float() / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)).bfloat16()
    assert numerator_rounded.ne(want).any()  # the compiled update divides the unrounded momentum
    eager = records_newton_schulz_input(G)
    assert (eager.mT if shape[0] > shape[1] else eager).ne(want).float().mean() > 0.2  # rounded before the norm


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 64, 64), (48, 24)])
def test_newton_schulz_input_of_a_random_momentum_differs_only_by_the_norms_summation_order(shape, monkeypatch):
    """A random momentum: Inductor's norm and aten's sum the squares in different orders, which
    differ by CPU kind (vector width), so the fp32 norms can differ by a few ulps and a quotient
    near a bf16 rounding boundary can round the other way. Measured over 40 seeds on an Intel Xeon
    under ATEN_CPU_CAPABILITY=avx512 / avx2 / default: at most 1, 2, 4 of the 16,384 elements of
    (4, 64, 64) and 0, 0, 1 of the 1,152 of (48, 24) differ, each by 1 bf16 ulp. Allowed: 1 ulp in
    1/256 of the elements (64 and 4: 16 and 4 times the most seen); rounding first differs in > 1/5."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    want, got = compiled_and_eager_normalization(G, monkeypatch)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()  # same sign: bit distance
    assert ulps.max() <= 1 and got.ne(want).sum() <= got.numel() / 256
    eager = records_newton_schulz_input(G)
    assert (eager.mT if shape[0] > shape[1] else eager).ne(want).float().mean() > 0.2  # rounded before the norm
