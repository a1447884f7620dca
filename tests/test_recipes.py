"""Recipes of the live lineage: `--recipe NAME` sets a record's values over the defaults (the
current record, so `bulk` sets nothing); flags override it wherever they stand; the records of the
x01 lineage are refused with the path of their frozen script; --help lists each recipe with its
published result; the recipe name is bookkeeping and the fields decide a resume; the record and
its ablations share their initial tensors; the dry run's counts and peak prediction at the
record's size. The x01 lineage's own tests: test_x01_lineage.py."""
import json

import pytest
import torch

import train_gpt_medium as tg


def test_the_defaults_are_the_current_record_and_its_recipe_sets_nothing():
    assert tg.RECIPES["bulk"].values == {} and tg.make_config(recipe="bulk") == tg.make_config()
    assert tg.Hyperparameters().recipe == "bulk" and tg.make_config().recipe == "bulk"
    assert tg.recipe_flags("bulk") == "nothing (the defaults)"


def test_flags_override_the_recipe_wherever_they_stand():
    for argv in (["--recipe=bulk", "--muon_lr=0.02"], ["--muon_lr=0.02", "--recipe", "bulk"]):
        config = tg.parse_args(argv)
        assert (config.recipe, config.muon_lr, config.num_iterations) == ("bulk", 0.02, 4740)
    assert tg.parse_args(["--preset=tiny", "--recipe=bulk", "--seed=3"]) == tg.make_config("tiny", "bulk", seed=3)


def test_an_unknown_recipe_is_refused_naming_the_flag_and_the_choices(capsys):
    assert tg.main(["--recipe=bulk2", "--dry_run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--recipe: unknown recipe 'bulk2'; choose from bulk" in line


@pytest.mark.parametrize("name", tg.FROZEN_RECIPES)
def test_an_earlier_record_is_refused_naming_its_frozen_script(name, capsys):
    assert tg.main([f"--recipe={name}", "--dry_run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"python records/x01_lineage/train_gpt_medium.py --recipe={name}" in line


def test_help_lists_each_recipe_with_its_records_published_result():
    text = " ".join(tg.help_text().split())
    assert "bulk (2025-12-31, 2025-12-31_BulkSmallTrackTransfer)" in text
    assert "1041.28 s mean over 2 runs" in text and "p=0.0046" in text
    assert "records/x01_lineage/train_gpt_medium.py" in text


def test_the_recipe_name_is_bookkeeping_and_the_fields_decide_a_resume():
    record = lambda c: tg.config_record(c, torch.float32)
    assert tg.config_differences(record(tg.make_config(recipe="bulk")), record(tg.make_config())) == {}
    diffs = tg.config_differences(record(tg.make_config()), record(tg.make_config(muon_lr=0.02)))
    assert set(diffs) == {"muon_lr"}
    assert [f.metadata["group"] for f in tg.fields(tg.Hyperparameters) if f.name == "recipe"] == ["bookkeeping"]


@pytest.mark.parametrize("switch", ["smear_embed", "gated_skips", "attn_output_gate", "value_embed_gate", "backout",
                                    "key_offset", "multi_token_prediction"])
def test_the_record_and_the_record_without_one_idea_share_their_initial_tensors(switch):
    """Matched initialization: every tensor the record shares with itself minus one switch starts
    identical; the scalar vector's slots are compared by name (a switch adds or drops slots)."""
    record_model = tg.build_model(tg.make_config("tiny", dtype="bfloat16", seed=2))
    model = tg.build_model(tg.make_config("tiny", dtype="bfloat16", seed=2, **{switch: False}))
    record, ablated = dict(record_model.named_parameters()), dict(model.named_parameters())
    shared = (set(record) & set(ablated)) - {"scalars"}
    assert len(shared) > len(record) // 2
    for k in shared:
        assert torch.equal(record[k], ablated[k]), k
    slots, ablated_slots = record_model.scalar_slots(), model.scalar_slots()
    for slot in (set(slots) & set(ablated_slots)) - {"pad"}:
        assert torch.equal(slots[slot], ablated_slots[slot]), slot


# ---- --dry_run at the record's size

def dry_run_output(argv, capsys) -> tuple[str, dict]:
    assert tg.main(["--dry_run", *argv]) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_the_dry_run_counts_the_records_parameters_and_names_it(capsys):
    """613,420,440 stored (the record's 56 scalars on 8 GPUs: 3 of them padding), 561,909,144 in use
    before the embedding split."""
    out, summary = dry_run_output([], capsys)
    assert summary["total_params"] == 613_420_440 and summary["params_in_use_before_split"] == 561_909_144
    assert summary["params_by_group"]["scalar"] == 56
    assert "recipe bulk: record 2025-12-31_BulkSmallTrackTransfer" in out


def peak_line(out: str) -> tuple[int, int]:
    line = next(line for line in out.splitlines() if line.startswith("predicted peak memory allocated:"))
    return tuple(int(n.replace(",", "")) for n in (line.split(": ")[1].split(" MiB")[0],
                                                    line.split("logged ")[1].split(" MiB")[0]))


def test_the_dry_run_predicts_the_records_peak_from_its_log(capsys):
    """The record's logged 57,397 MiB: this trainer holds what the record held per GPU (Adam's
    moments sharded over the 8 GPUs: 196.5 MiB, not 1,572 whole)."""
    predicted, logged = peak_line(dry_run_output([], capsys)[0])
    assert logged == tg.RECIPES["bulk"].peak_mib == 57_397 == predicted
    with torch.device("meta"):
        model = tg.GPT(tg.make_config(), torch.bfloat16)
    assert round(tg.state_bytes_per_gpu(model, model.config, 8)["adam"] / 2**20, 1) == 196.5


def test_without_the_backout_the_peak_drops_by_its_kept_activation(capsys):
    """One (T, d) bf16 tensor of a rank's 65,536 tokens: 128 MiB, less the backout's scalar."""
    with_backout = peak_line(dry_run_output([], capsys)[0])[0]
    without = peak_line(dry_run_output(["--backout=false"], capsys)[0])[0]
    assert with_backout - without == 128


def test_no_peak_is_predicted_for_other_shapes(capsys):
    out, _ = dry_run_output(["--preset=tiny"], capsys)
    assert "predicted peak memory: none" in out


def test_a_peak_is_predicted_exactly_where_every_change_is_marked_peak_neutral():
    """The fields' own metadata decides (no list beside the table): a learning rate or the step count
    (peak_neutral) keeps the record's prediction; a width, a window or the batch (not) gives none."""
    record = tg.predicted_peak_mib(tg.make_config())
    assert tg.predicted_peak_mib(tg.make_config(muon_lr=0.02, num_iterations=4000)) == record
    for change in (dict(mlp_ratio=3), dict(max_window_tokens=4096), dict(document_cut_tokens=2048)):
        (name,) = change
        assert not tg.Hyperparameters.__dataclass_fields__[name].metadata["peak_neutral"]
        assert tg.predicted_peak_mib(tg.make_config(**change)) is None, change
    neutral = [f.name for f in tg.fields(tg.Hyperparameters) if f.metadata["peak_neutral"]]
    assert {"muon_lr", "num_iterations", "mudd", "bigram_embed", "fp8"} <= set(neutral)
