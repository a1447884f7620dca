"""--recipe transfer: the candidate for the next record (mudd plus Part II's sections 12-18). It is a
recipe like the records' except that nothing was published for it: every place that shows a
recipe's record says instead that it is a candidate that has not run on a GPU."""
from pathlib import Path

import pytest

import train_gpt_medium as tg
from test_checkpoint import kill_when_saved, resumed_step, run_argv
from test_distributed import assert_bit_identical, checkpoint_tensors, clean_env, launch
from test_frontier_recipes import MUDD_SIX_BLOCKS


def test_the_candidate_is_mudd_plus_its_ideas_and_each_idea_is_off_in_the_record():
    config, mudd, record = (tg.make_config(recipe=r) for r in ("transfer", "mudd", "bulk"))
    ideas = tg.TRANSFER_IDEAS
    assert ideas, "the candidate adds at least one idea to mudd"
    for name, value in tg.RECIPES["mudd"].values.items():
        if name not in ideas:
            assert getattr(config, name) == value, name
    for name, value in ideas.items():
        field = tg.Hyperparameters.__dataclass_fields__[name]
        assert getattr(config, name) == tg._as_field_value(field, value), name
        assert getattr(record, name) != getattr(config, name), f"{name}: the record must have it off"
        assert name not in tg.RECIPES["mudd"].values, f"{name}: an idea beyond mudd"
    assert config.num_iterations == mudd.num_iterations and config.extension_steps == mudd.extension_steps
    assert tg.make_config("tiny", recipe="transfer").num_iterations == tg.make_config("tiny", recipe="mudd").num_iterations


def test_the_candidate_sets_no_value_without_effect():
    for preset in ("medium", "tiny"):
        assert tg.inert_setting_notes(tg.make_config(preset, recipe="transfer")) == []


def test_the_recipe_line_and_help_say_candidate_with_no_published_time():
    line = tg.recipe_summary(tg.make_config(recipe="transfer"))
    assert "\n" not in line and len(line) <= 160
    assert line.startswith("recipe transfer: a candidate, not a record: not run on a GPU, no claim, no published time")
    epilog = tg.help_epilog()
    assert "transfer (CANDIDATE, docs/short-track-transfer.md)" in epilog
    assert epilog.count(tg.CANDIDATE_NOTE) == 1


def test_the_dry_run_predicts_its_peak_without_a_record_to_compare(capsys):
    assert tg.main(["--recipe=transfer", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "recipe transfer: a candidate, not a record" in out
    peak = [line for line in out.splitlines() if line.startswith("predicted peak memory allocated:")]
    assert len(peak) == 1 and "recipe transfer is a candidate" in peak[0] and "record logged" not in peak[0]
    assert any(line.lstrip().startswith("transfer ") and "MiB" in line for line in out.splitlines())


def test_an_unknown_recipe_names_the_candidates_too():
    with pytest.raises(tg.ConfigError) as refusal:
        tg.make_config(recipe="tranfser")
    assert "transfer" in str(refusal.value) and "mudd" in str(refusal.value)


def test_gpu_check_compares_a_candidate_with_no_record():
    from tools import gpu_check
    assert not gpu_check.is_record_shape(tg.make_config(recipe="transfer"))
    assert gpu_check.is_record_shape(tg.make_config(recipe="mudd"))


def test_the_candidates_parameters_and_the_gate_nets_kept_activations():
    """1,000,031,557 parameters: mudd's 871,110,088, the 7.5 x table's 128,778,240 more rows x 1024, the
    gate nets' 145,373, less the 2,144 static weights and gates they replace. The memory model keeps
    both nets' hidden layers (before and after GELU) and their 82 + 110 outputs per token, and DC's
    P (T, H, W) fp32 and k and v padded by W - 1 rows (bf16) at block 15 (what DCBand keeps)."""
    config = tg.make_config(recipe="transfer")
    assert sum(p.numel() for p in tg.build_model(config, "meta").parameters()) == 1_000_031_557
    T, H, W = 65_536, 8, 112
    without = tg.peak_parts(tg.make_config(recipe="transfer", mudd_gate=False, dc_layers=(), attn_gate_layers=None))
    assert tg.peak_parts(config)["training"] - without["training"] == (2 * 2 * T * 64 * 2 + T * (82 + 110) * 2
                                                                       + T * H * W * 4 + 2 * (T + W - 1) * 1024 * 2)


# ---- the whole candidate, every idea on at once: a short tiny run (DC's window cut to the tiny slices)
# on six blocks (a bit-for-bit equality does not depend on the depth): mudd's layout scaled as in
# test_frontier_recipes, XSA on the blocks up to the one the last two attend from, the gate net's
# output gates on the long-window blocks and DC at the last (as the candidate's at sixteen)

RUN_STEPS = 8
SIX_BLOCKS_IDEAS = (*MUDD_SIX_BLOCKS, "--xsa_layers=0,1,2,3", "--attn_gate_layers=0,3,5", "--dc_layers=5")


def candidate_argv(synthetic_dir, out) -> list[str]:
    return run_argv(synthetic_dir, out, "--recipe=transfer", "--dc_window=20", "--seed=0", "--adam_odd_steps_only=false",
                    "--untie_embed_after_step=0", f"--token_bytes_file={synthetic_dir / 'synthetic_token_bytes.npy'}",
                    "--save_every=4", *SIX_BLOCKS_IDEAS, N=RUN_STEPS)


def test_six_blocks_keep_every_idea_of_the_candidate():
    config = tg.parse_args(candidate_argv(Path("data"), Path("out")))
    assert config.num_layers == 6 and config.mudd and config.mudd_gate and config.prefix_loss_weight > 0
    assert config.xsa_layers == tuple(range(config.attn_input_from_layer + 1))
    assert config.attn_gate_layers == tuple(sorted(config.long_layers)) and config.dc_layers == (config.num_layers - 1,)
    assert 0 < tg.mudd_gate_layer(config) < config.num_layers - 1
    assert tg.inert_setting_notes(config) == []
    candidate = tg.make_config("tiny", recipe="transfer")
    assert {name for name in tg.TRANSFER_IDEAS if getattr(config, name) != getattr(candidate, name)} == {
        "xsa_layers", "attn_gate_layers", "dc_layers"}


@pytest.fixture(scope="module")
def candidate_run(synthetic_dir, tmp_path_factory):
    """The uninterrupted run both tests read: one plain process, 2 micro-steps per step (in this
    process: neither test is about its launch)."""
    out = tmp_path_factory.mktemp("candidate_run")
    assert tg.main(candidate_argv(synthetic_dir, out)) == 0
    return out


@pytest.mark.slow
def test_the_candidate_killed_with_sigkill_resumes_bit_for_bit(candidate_run, synthetic_dir, tmp_path):
    """Every idea's state (XSA alphas, the grouped NorMuon statistics, the gate nets, the FP8 scales,
    the prefix weight's schedule) comes back from the checkpoint: the resumed run ends as the
    uninterrupted one, bit for bit."""
    argv = candidate_argv(synthetic_dir, tmp_path)
    kill_when_saved(argv, tmp_path, 4)
    assert tg.main([*argv, "--resume=latest"]) == 0
    assert resumed_step(tmp_path) >= 4
    final = f"ck/tiny/step_{RUN_STEPS:06d}"
    assert_bit_identical(checkpoint_tensors(tmp_path / final), checkpoint_tensors(candidate_run / final))


@pytest.mark.slow
def test_two_candidate_processes_equal_one_accumulating_two_micro_steps(candidate_run, synthetic_dir, tmp_path):
    """./run.sh with NPROC_PER_NODE=2 (torchrun) against the one process, Adam stepping every step:
    bit for bit at both checkpoints."""
    two = launch([(["./run.sh", *candidate_argv(synthetic_dir, tmp_path)], clean_env(NPROC_PER_NODE="2"))], tmp_path)
    for step in (4, RUN_STEPS):
        assert_bit_identical(checkpoint_tensors(candidate_run / f"ck/tiny/step_{step:06d}"),
                             checkpoint_tensors(two / f"ck/tiny/step_{step:06d}"))
