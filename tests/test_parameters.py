"""A parameter says where it belongs where it is made (tg.declare): its optimizer group, its lr and
weight-decay multipliers and its initial value are its own attributes, which the optimizers, the
initialization and the accounting read. So an idea's parameters live in its module only."""
import pytest
import torch
import torch.nn as nn

import train_gpt_medium as tg


def test_every_parameter_of_the_record_declares_its_group_multipliers_and_init():
    model = tg.build_model(tg.make_config("tiny", dtype="float32"))
    for name, p in model.named_parameters():
        assert p.group in tg.GROUP_ORDER and callable(p.init), name
        assert isinstance(p.lr_mul, float) and isinstance(p.wd_mul, float), name
    groups = tg.parameter_groups(model)
    assert sum(len(ps) for ps in groups.values()) == len(list(model.parameters()))
    assert list(groups) == [g for g in tg.GROUP_ORDER if g in groups]


def test_the_records_multipliers_are_declared_with_their_tables():
    model = tg.build_model(tg.make_config("tiny", dtype="float32"))
    mults = lambda p: (p.lr_mul, p.wd_mul)
    assert mults(model.head.weight) == (1.0, 150.0) and mults(model.embeds[0].weight) == (1.0, 150.0)
    assert mults(model.embeds[1].weight) == (75.0, 5.0) and mults(model.value_embeds.tables[0].weight) == (75.0, 5.0)
    assert mults(model.scalars) == (5.0, 0.0) and mults(model.x0_lambdas) == (5.0, 0.0)
    assert mults(model.backout.weight) == (5.0, 0.0) and mults(model.blocks[0].mlp.proj_w) == (2.0, 1.0)
    plain = tg.build_model(tg.make_config("tiny", dtype="float32", table_multipliers=False))
    assert mults(plain.head.weight) == mults(plain.embeds[1].weight) == mults(plain.scalars) == (1.0, 1.0)


def test_initial_values_come_from_the_declared_init_on_the_parameters_own_stream():
    config = tg.make_config("tiny", dtype="float32", seed=4)
    model = tg.build_model(config)
    for name, p in model.named_parameters():
        want = p.init(p.shape, tg._param_generator(4, name))
        assert torch.equal(p, want.to(p.dtype)), name
    assert torch.equal(model.scalars, torch.tensor([v for _, vs in tg.scalar_layout(config) for v in vs]))


class Extra(nn.Module):
    """An idea's module as a new switch would add it: one declared parameter, nothing else."""

    def __init__(self):
        super().__init__()
        self.gain = tg.declare(nn.Parameter(torch.empty(3)), "gates", tg.constant_init([0.25] * 3), 0.5, 0.0,
                               lr="gates_lr")


def test_a_module_with_a_declared_parameter_needs_no_table_elsewhere():
    """Attached to the model, the new parameter is initialized, grouped and optimized with its
    multiplier, and the checkpointed state of the others is unchanged."""
    config = tg.make_config("tiny", dtype="float32", seed=1)
    model = tg.build_model(config)
    model.extra = Extra()
    tg.init_parameters(model, 1)
    assert torch.equal(model.extra.gain, torch.full((3,), 0.25))
    assert any(p is model.extra.gain for p in tg.parameter_groups(model)["gates"])
    adam, muon = tg.build_optimizers(model, config, 0, 1)
    (group,) = [g for g in adam.param_groups if any(p is model.extra.gain for p in g["params"])]
    assert group["name"] == "gates"
    model.extra.gain.grad = torch.ones(3)
    before = model.extra.gain.detach().clone()
    tg.set_schedules([adam, muon], 1, config)
    adam.step()
    moved = (before - model.extra.gain.detach()).abs()
    assert torch.allclose(moved, torch.full((3,), group["lr"] * 0.5), rtol=1e-4)  # Adam's first step: lr x lr_mul


def test_a_new_adam_group_takes_the_lr_its_parameters_name_and_nothing_else():
    """A group of its own (not in GROUP_ORDER): Adam at the lr of the field its parameter declared;
    the dry run's optimizer table shows it."""
    config = tg.make_config("tiny", dtype="float32", scalar_lr=0.02)
    model = tg.build_model(config)
    model.extra = Extra()
    model.extra.gain.group, model.extra.gain.lr_field = "extra_gains", "scalar_lr"
    adam, _ = tg.build_optimizers(model, config, 0, 1)
    (group,) = [g for g in adam.param_groups if g["name"] == "extra_gains"]
    assert group["lr"] == 0.02 and group["params"] == [model.extra.gain]
    line = next(line for line in tg.optimizer_table_lines(model, config) if line.startswith("  extra_gains:"))
    assert "adam, lr scalar_lr=0.02" in line and "3 params: 1 tensor at lr_mul 0.5, wd_mul 0" in line


@pytest.mark.parametrize("fields", [(None,), ("gates_lr", "scalar_lr")])
def test_an_adam_group_whose_parameters_name_no_lr_or_two_is_refused_by_name(fields):
    config = tg.make_config("tiny", dtype="float32")
    model = tg.build_model(config)
    model.extra, model.other = Extra(), Extra()
    model.extra.gain.group = model.other.gain.group = "mystery"
    model.extra.gain.lr_field, model.other.gain.lr_field = fields[0], fields[-1]
    with pytest.raises(ValueError, match="parameter group mystery: .*declare"):
        tg.build_optimizers(model, config, 0, 1)


@pytest.mark.parametrize("recipe", sorted(tg.RECIPES))
def test_the_optimizer_table_has_a_line_per_group_with_the_values_the_optimizers_use(recipe):
    config = tg.make_config("tiny", recipe=recipe, dtype="float32")
    model = tg.build_model(config)
    adam, muon = tg.build_optimizers(model, config, 0, 1)
    lines = tg.optimizer_table_lines(model, config)[1:]
    groups = [(g, "adam") for g in adam.param_groups] + [(g, "muon") for g in muon.param_groups]
    names = list(dict.fromkeys(g["name"] for g, _ in groups))  # Muon splits its groups by shape
    assert [line.split(":")[0].strip() for line in lines] == names
    for g, kind in groups:
        line = lines[names.index(g["name"])]
        assert line.startswith(f"  {g['name']}: {kind}, lr ") and f"={g['initial_lr']:g}" in line
        if kind == "adam":
            assert f"betas {g['betas'][0]:g}/{g['betas'][1]:g}" in line or any(
                hasattr(p, "betas") for p in g["params"])


def test_a_model_with_its_declared_parameters_pickles():
    """The inits are module-level functions or partials of them, so a model (and a result holding
    one, as the test workers share) pickles with what its parameters declared."""
    import pickle
    model = tg.build_model(tg.make_config("tiny", dtype="float32", ve_mode="learned"))
    clone = pickle.loads(pickle.dumps(model))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))
    assert torch.equal(clone.scalars.init(model.scalars.shape, None), model.scalars.detach())
    assert (clone.scalars.group, clone.scalars.lr_mul) == ("scalar", 5.0)
