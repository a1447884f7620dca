"""Configuration and command line: the --dry_run accounting against the record's numbers
(docs/bulk.md and docs/bulk-model.md, "Counts and FLOPs") recomputed here from the shapes, flag parsing, errors that name the flag (exit code 2), and an import
without side effects. Everything runs in-process through tg.main / tg.parse_args."""
import json
import os
import re
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCK_FLAGS

ROOT = Path(__file__).resolve().parent.parent

# the record model's shapes (docs/bulk-model.md): attention on all 16 layers, every table padded to
# 50,304 rows, value embeddings on 10 layers, 8 heads
V_PAD, D, L, HIDDEN, HEADS, GATE_IN = 50304, 1024, 16, 4096, 8, 16
ATTENTION_LAYERS = list(range(L))
LONG_LAYERS = {0, 4, 11, 15}
VALUE_EMBED_LAYERS = 10
RECIPE_GROUPS = dict(
    head=V_PAD * D,
    embed=2 * V_PAD * D,  # the input table x00 and the second one x01
    value_embed=5 * V_PAD * D,
    # residual weights, 2 attention lambdas per layer, smear, 3 skip gains, backout; padded to 56 (8 GPUs)
    scalar=56,
    muon_attn=len(ATTENTION_LAYERS) * 4 * D * D,
    muon_mlp=L * 2 * HIDDEN * D,
    x0_lambdas=L * 2,
    gates=GATE_IN + 3 * GATE_IN,  # the smear gate and the three skip gates
    muon_gates=(L + VALUE_EMBED_LAYERS) * HEADS * GATE_IN,  # attention output gates, value-embedding gates
)
# the record's step grid (docs/bulk-data.md): 4700 scheduled + 40 extension steps, 12 slots
SCHEDULED, EXTENSION, BLOCK = 4700, 40, 128
BATCHES = (131072, 262144, 393216) + (524288,) * 9
LONG_WINDOWS = (3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23)


def dry_run_summary(capsys) -> dict:
    assert tg.main(["--dry_run"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def error_of(argv, capsys) -> str:
    """Run main, require exit code 2, return what it wrote to stderr."""
    assert tg.main(argv) == 2
    return capsys.readouterr().err


# ---- --dry_run


def test_dry_run_parameter_count_is_the_recipe_total(capsys):
    summary = dry_run_summary(capsys)
    assert summary["total_params"] == 613_420_440 == sum(RECIPE_GROUPS.values())
    assert sum(summary["params_by_group"].values()) == summary["total_params"]
    assert summary["params_by_group"] == RECIPE_GROUPS


def test_dry_run_flops_per_token_is_the_recipe_figure(capsys):
    """docs/bulk.md and docs/bulk-model.md ("Counts and FLOPs"): about 1.792e9 averaged over the run's
    tokens = 1.5170e9 (6 x matmul weights) + 0.275e9 (attention)."""
    summary = dry_run_summary(capsys)
    assert summary["flops_per_token"] == pytest.approx(1.792e9, rel=1e-3)
    assert summary["flops_per_token_weights"] == pytest.approx(1.5170e9, rel=1e-4)
    assert summary["flops_per_token_attention"] == pytest.approx(0.275e9, rel=3e-3)  # 3 significant digits
    assert summary["flops_per_token"] == pytest.approx(
        summary["flops_per_token_weights"] + summary["flops_per_token_attention"], rel=1e-12)


def test_dry_run_flops_equal_a_recount_from_the_shapes_and_the_window_schedule(capsys):
    """Weights: 6 x (head + attention + MLP matrices + the head gates' matrices). Attention: per
    step, per attention layer, 12 x attn_dim x keys per query (a token window of W blocks: the
    query and the W x 128 tokens before it), averaged over the run's tokens: each step weighs its
    batch. Slot k of the 12-slot grid holds steps with floor(12 step / 4700) = k; the 40 extension
    steps keep the last slot's batch and windows; the short window is min(11, long // 2)."""
    summary = dry_run_summary(capsys)
    weights = 6 * (RECIPE_GROUPS["head"] + RECIPE_GROUPS["muon_attn"] + RECIPE_GROUPS["muon_mlp"]
                   + RECIPE_GROUPS["muon_gates"])
    assert summary["flops_per_token_weights"] == weights
    total = tokens = 0
    for step in range(SCHEDULED + EXTENSION):
        slot = min(12 * step // SCHEDULED, 11)
        long = LONG_WINDOWS[slot]
        per_token = sum(12 * D * ((long if layer in LONG_LAYERS else min(11, long // 2)) * BLOCK + 1)
                        for layer in ATTENTION_LAYERS)
        total += BATCHES[slot] * per_token
        tokens += BATCHES[slot]
    assert summary["flops_per_token_attention"] == pytest.approx(total / tokens, rel=1e-9)


def test_the_readmes_dry_run_figures_are_the_dry_runs():
    """The record's parameters and FLOPs per token and transfer's parameters and predicted peak, as the
    README quotes them, from the functions the dry run prints (a changed model cannot leave them stale)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    figures = {}
    for recipe in ("bulk", "transfer"):
        config = tg.make_config(recipe=recipe)
        with torch.device("meta"):
            model = tg.GPT(config, tg.weight_dtype(config, "cuda"))
        figures[recipe] = (tg.parameter_counts(model)["total"], tg.flops_per_token(config, model),
                           tg.predicted_peak_mib(config))
    params, flops, _ = figures["bulk"]
    assert (f"in total ({params:,} for the record) and model FLOPs per token ({flops['total'] / 1e9:.4f}e9: "
            f"{flops['weights'] / 1e9:.4f}e9 from the matmul weights, {flops['attention'] / 1e9:.4f}e9 from "
            "attention)") in readme
    params, _, peak = figures["transfer"]
    assert f"The dry run counts {params:,} parameters and predicts a peak of {peak:,} MiB per GPU on 8xH100" in readme


# ---- errors: exit code 2 and a message naming the flag


def test_unknown_flag_exits_2_naming_it_with_did_you_mean_and_a_pointer_to_help(capsys):
    """Issue 9 replaced the flat list of every flag name by a suggestion and --help."""
    err = error_of(["--num_iteration=5"], capsys)
    assert "unknown flag --num_iteration;" in err
    assert "did you mean --num_iterations?" in err and "--help" in err


@pytest.mark.parametrize("argv,flag,bad", [
    (["--num_iterations=abc"], "--num_iterations", "abc"),
    (["--embed_lr=x"], "--embed_lr", "x"),
    (["--dry_run=maybe"], "--dry_run", "maybe"),
    (["--num_iterations", "1.5"], "--num_iterations", "1.5"),
])
def test_badly_typed_value_exits_2_naming_the_flag_and_the_value(capsys, argv, flag, bad):
    err = error_of(argv, capsys)
    assert flag in err and repr(bad) in err


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_refused_as_not_allowed_with_the_bounds(text):
    """float() reads these; a bound compares false with nan, so the refusal says what is allowed."""
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args([f"--prefix_loss_weight={text}"])
    assert str(refusal.value) == f"--prefix_loss_weight: {text} is not allowed; it must be a finite number >= 0 and <= 10.0"


def test_unknown_preset_exits_2_naming_the_flag_and_the_presets(capsys):
    err = error_of(["--preset", "nope"], capsys)
    assert "--preset" in err and "nope" in err and "tiny" in err and "medium" in err


def test_value_flag_without_a_value_exits_2(capsys):
    assert "--num_iterations" in error_of(["--num_iterations"], capsys)


# ---- parsing


def test_equals_and_space_forms_are_the_same():
    assert tg.parse_args(["--num_iterations=77"]).num_iterations == 77
    assert tg.parse_args(["--num_iterations", "77"]).num_iterations == 77
    assert tg.parse_args(["--embed_lr", "0.5", "--run_id=abc"]) == tg.parse_args(["--embed_lr=0.5", "--run_id", "abc"])


def test_bare_boolean_flag_is_true_and_takes_no_value():
    config = tg.parse_args(["--dry_run", "--num_iterations", "99"])
    assert config.dry_run is True and config.num_iterations == 99
    assert tg.parse_args([]).dry_run is False


@pytest.mark.parametrize("text,value", [("false", False), ("0", False), ("true", True), ("on", True),
                                        ("auto", None)])
def test_compile_is_tri_state(text, value):
    assert tg.parse_args([f"--compile={text}"]).compile is value


def test_compile_defaults_to_none_and_bare_compile_is_true():
    assert tg.parse_args([]).compile is None
    assert tg.parse_args(["--compile"]).compile is True


def test_overrides_apply_on_top_of_the_preset_in_any_order():
    tiny = tg.make_config("tiny")
    for argv in (["--preset", "tiny", "--num_iterations=7"], ["--num_iterations=7", "--preset=tiny"]):
        config = tg.parse_args(argv)
        assert config.preset == "tiny" and config.num_iterations == 7
        assert config.model_dim == tiny.model_dim == 64 and config.vocab_size == 500  # the rest: the preset
    assert tg.make_config().num_iterations == 4740 and tiny.num_iterations == 190


@pytest.mark.parametrize("override,flag", [
    (dict(train_seq_len=500), "--train_seq_len"),
    (dict(val_seq_len=0), "--val_seq_len"),
    (dict(eot_token=500), "--eot_token"),
    (dict(value_embed_layout="0,1,2,3,4,-,-,-,-,-,-,0,1,2,3"), "--value_embed_layout"),
    (dict(attention_free_layers=(7,), value_embed_layout="0,1,2,3,4,-,-,0,-,-,-,0,1,2,3,4"),
     "--value_embed_layout"),  # layer 7: no attention
    (dict(skip_connections="9<10"), "--skip_connections"),
    (dict(val_tokens=1000), "--val_tokens"),
])
def test_make_config_validation_names_the_flag(override, flag):
    with pytest.raises(tg.ConfigError) as err:
        tg.make_config("tiny", **override)
    assert str(err.value).startswith(flag)


def test_validation_errors_from_the_command_line_exit_2(capsys):
    assert "--train_seq_len" in error_of(["--preset=tiny", "--train_seq_len=500"], capsys)


# ---- process-level behaviour


@pytest.fixture(scope="module")
def imported_alone(tmp_path_factory):
    """`import train_gpt_medium` in a fresh process, in an empty folder: (the finished process, the
    folder); the process writes whether torch's compiler was loaded to a file descriptor of its own."""
    folder = tmp_path_factory.mktemp("import_alone")
    read_end, write_end = os.pipe()
    code = (f"import os, sys, train_gpt_medium\n"
            f"os.write({write_end}, str('torch._dynamo' in sys.modules).encode())")
    result = subprocess.run([sys.executable, "-c", code], cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120, pass_fds=(write_end,))
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        return result, folder, pipe.read()


def test_importing_the_module_prints_nothing_and_writes_nothing(imported_alone):
    result, folder, _ = imported_alone
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert list(folder.iterdir()) == []


def test_importing_the_module_leaves_torchs_compiler_unloaded(imported_alone):
    """torch._dynamo costs about 1.7 s of CPU to import: every process that does not compile (the
    dry run, a CPU run, the tools, each trainer process of the tests) would pay it at start."""
    result, _, compiler_loaded = imported_alone
    assert result.returncode == 0, result.stderr
    assert compiler_loaded == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_medium_preset_without_a_gpu_exits_2_pointing_to_the_tiny_preset(capsys):
    assert "--preset tiny" in error_of([], capsys)


def test_missing_train_shards_exit_2_naming_the_flag(tmp_path, capsys):
    pattern = str(tmp_path / "nothing_*.bin")
    err = error_of(["--preset", "tiny", f"--train_files={pattern}", f"--val_files={pattern}",
                    "--synthetic_data=false", f"--log_dir={tmp_path}"], capsys)
    assert "--train_files" in err


# ---- documentation and notes in the log


def test_every_field_is_a_row_of_the_readme_switch_table():
    readme = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| `--(\w+)` \|", readme, re.M))
    missing = [f.name for f in tg.fields(tg.Hyperparameters) if f.name not in rows]
    assert not missing, f"README switch table lacks {missing}"
    assert rows <= {f.name for f in tg.fields(tg.Hyperparameters)}, "README lists flags that do not exist"


def test_a_shorter_sequence_is_logged_as_a_change_of_training():
    assert tg.recipe_notes(tg.make_config("tiny")) == []
    assert tg.recipe_notes(tg.make_config("tiny", activation_checkpointing=True)) == []
    # the batch ramp's larger steps do not fit 8 slices of 16384 tokens: every step the full batch
    (note,) = tg.recipe_notes(tg.make_config("medium", train_seq_len=16384, batch_schedule=()))
    assert "--train_seq_len=16384" in note and "65536" in note and "changes training" in note
    assert "131,072 tokens instead of 524,288" in note and "--activation_checkpointing" in note


def test_the_readme_switch_table_is_the_one_made_from_the_dataclass():
    """Defaults, meanings and allowed values in the README come from the same metadata as --help;
    after changing a field, `python tools/switch_table.py --write` updates the README."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("switch_table", ROOT / "tools" / "switch_table.py")
    switch_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(switch_table)
    readme = (ROOT / "README.md").read_text()
    assert switch_table.readme_with_table(readme) == readme, "run: python tools/switch_table.py --write"


def test_help_lists_every_field_with_its_default_and_exits_0(capsys):
    assert tg.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in tg.fields(tg.Hyperparameters):
        assert f"--{f.name}" in out, f.name
    assert "[default 4740; >= 1]" in out and "[default 0.015; >= 0 and <= 1.0]" in out


def test_the_log_says_when_a_choice_changes_training_and_how_many_cpu_threads(synthetic_dir, tmp_path):
    """(This and the next run on FOUR_BLOCKS: what the log notes does not depend on the depth.)"""
    argv = ["--preset=tiny", f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
            f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false", "--num_iterations=3",
            "--val_every=0", "--val_tokens=1024", "--warmup_steps=0", "--train_seq_len=256", "--batch_schedule=",
            "--threads=1", *FOUR_BLOCK_FLAGS, f"--log_dir={tmp_path}"]
    assert tg.main(argv) == 0
    (log,) = tmp_path.glob("*.txt")
    body = log.read_text().split("=" * 100 + "\n")[-1]
    assert "note: --train_seq_len=256 differs from the tiny preset's 512" in body
    assert "CPU threads: 1 (--threads)" in body


@pytest.mark.parametrize("recipe", sorted(tg.RECIPES))
def test_the_recipe_line_is_one_short_line(recipe):
    """The run's first recipe line names the record and its published result; the values it sets are
    the config lines, not this line."""
    line = tg.recipe_summary(tg.make_config(recipe=recipe))
    assert "\n" not in line and len(line) <= 160 and tg.RECIPES[recipe].folder in line


def test_a_value_whose_switch_is_off_is_noted_once():
    """--mudd_nets without --mudd, --fused_ce_variant without --fused_softcap_ce: one note each; a
    value left at the preset's, or whose switch is on, is not noted."""
    notes = tg.recipe_notes(tg.make_config("tiny", mudd_nets="final", fused_ce_variant="pr261"))
    assert notes == ["note: --mudd_nets=final has no effect without --mudd",  # in the table's order
                     "note: --fused_ce_variant=pr261 has no effect without --fused_softcap_ce"]
    assert tg.inert_setting_notes(tg.make_config("tiny", recipe="mudd", mudd_nets="final", backout=False)) == []
    # the recipe's own value, once its switch is turned off (an ablation): noted too
    assert tg.inert_setting_notes(tg.make_config("tiny", recipe="mudd", fused_softcap_ce=False)) == [
        "note: --fused_ce_variant=pr261 has no effect without --fused_softcap_ce"]
    for recipe in tg.RECIPES:  # no recipe sets a value it does not use
        assert tg.inert_setting_notes(tg.make_config("medium", recipe=recipe)) == []
        assert tg.inert_setting_notes(tg.make_config("tiny", recipe=recipe)) == []


def test_a_note_on_a_value_without_effect_is_in_the_log_and_on_the_screen(synthetic_dir, tmp_path, capsys):
    argv = ["--preset=tiny", f"--train_files={synthetic_dir / 'synthetic_train_*.bin'}",
            f"--val_files={synthetic_dir / 'synthetic_val_*.bin'}", "--synthetic_data=false", "--num_iterations=3",
            "--val_every=0", "--val_tokens=1024", "--warmup_steps=0", "--batch_schedule=", "--mudd_nets=final",
            *FOUR_BLOCK_FLAGS, f"--log_dir={tmp_path}"]
    assert tg.main(argv) == 0
    note = "note: --mudd_nets=final has no effect without --mudd"
    assert capsys.readouterr().out.count(note) == 1
    (log,) = tmp_path.glob("*.txt")
    assert log.read_text().split("=" * 100 + "\n")[-1].count(note) == 1


@pytest.mark.parametrize("flag,value", [("head_lr", "2"), ("muon_lr", "1.5"), ("mudd_lr", "10"), ("ve_coeff_lr", "5")])
def test_a_learning_rate_past_any_sane_bound_is_refused_with_the_bound(flag, value):
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args([f"--{flag}={value}"])
    assert str(refusal.value) == f"--{flag}: {float(value)} is not allowed; it must be >= 0 and <= 1.0"
    tg.parse_args([f"--{flag}=1"])  # the bound itself trains (badly, but it is a number)


@pytest.mark.parametrize("ranges", ["1e-40,1.6,0.75", "100,1e31,0.75", "100,1.6,1e-35"])
def test_an_fp8_range_whose_scale_leaves_float32_is_refused_with_the_bounds(ranges):
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args(["--preset=tiny", "--fp8", f"--fp8_ranges={ranges}"])
    message = str(refusal.value)
    assert message.startswith("--fp8_ranges: ") and "[1e-30, 1e+30]" in message
    low = tg.FP8_RANGE_BOUNDS[0] / kernels.FP8_E4M3_MAX / 8  # the smallest gradient scale the bounds allow (8 slices)
    assert low > torch.finfo(torch.float32).tiny and 1 / low < torch.finfo(torch.float32).max


CLAIM_FIELDS = (
    # §8
    "fp8", "fp8_ranges", "head_transposed",
    # §9
    "bigram_embed", "bigram_table_multiple", "bigram_lambda_init", "fused_softcap_ce", "gates_optimizer",
    "small_params_betas", "muon_scalar_rounding", "adam_fp32_moments",
    # §10
    "attn_input_from_layer", "mudd", "mudd_nets", "mudd_lr", "fused_ce_variant",
    # §12
    "xsa_layers", "xsa_lr",
    # §13
    "muon_qk_group_heads",
    # §14
    "bigram_sign_rows",
    # §15
    "mlp_backward_from_post",
    # §16
    "prefix_loss_weight",
    # §17
    "fp8_mlp_up", "fp8_mlp_down",
    # §18
    "attn_gate_layers", "mudd_gate", "mudd_gate_layer", "mudd_gate_lr", "mudd_gate_start", "dc_layers",
    "dc_window",
)


def test_the_claims_fields_are_one_block_of_the_table_each_meaning_at_most_two_lines_of_help():
    """Part II's switches sit together in the flag table (in chapter order), and --help says each in at
    most two lines of its column (the details are the chapter's docs)."""
    names = [f.name for f in tg.fields(tg.Hyperparameters)]
    start = names.index(CLAIM_FIELDS[0])
    assert tuple(names[start:start + len(CLAIM_FIELDS)]) == CLAIM_FIELDS
    column = tg.HELP_WIDTH - 32  # the help formatter's width less its help position
    for f in tg.fields(tg.Hyperparameters):
        if f.name in CLAIM_FIELDS:
            assert len(textwrap.wrap(f.metadata["meaning"], column)) <= 2, f.name
