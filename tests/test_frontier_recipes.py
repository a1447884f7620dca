"""The claimed records after bulk (--recipe fp8_yarn: PR #248, --recipe bigram: PR #252, --recipe
mudd: PR #261) as whole recipes at tiny size, on test_bulk_recipe's short grid (24 steps, every phase): each learns
(mudd on its sixteen blocks, the others on six). mudd, whose state holds the others', on six blocks and half the
grid: a run killed after the split resumes bit for bit, and two processes train like one process accumulating two
micro-steps. Their parts are tested on their own in test_fp8_head.py, test_bigram.py, test_fused_ce.py,
test_unified_optimizer.py and test_mudd.py."""
import contextlib
import dataclasses
import functools
import io
import json
import re

import pytest

import train_gpt_medium as tg
from records import published
from test_bulk_model import FOUR_BLOCK_FLAGS
from test_bulk_recipe import N, PAIR_STEPS, SHORT_GRID
from test_checkpoint import kill_when_saved, log_text, resumed_step, run_argv
from test_distributed import assert_bit_identical, checkpoint_tensors, clean_env, launch, run_args

FRONTIER = ("fp8_yarn", "bigram", "mudd")


def grid(recipe: str, steps: int = N) -> tuple[str, ...]:
    # test_bulk_recipe's grid without its 4 blocks: the tiny preset's 16, or a layout a test adds
    flags = [f if not f.startswith("--recipe=") else f"--recipe={recipe}" for f in SHORT_GRID
             if f not in FOUR_BLOCK_FLAGS]
    return (*flags, f"--num_iterations={steps}")


# A recipe's layout (bulk's: the frontier recipes change no block of it but mudd's attention source)
# scaled from sixteen blocks to six, for the whole runs whose property does not depend on the depth:
# two value-embedding tables each read by an early and a late block, two skips into the middle, long
# windows at the ends and at the block that is the backout's h_b (mudd: MUDD's h_b, and the block the
# last two attend from, as block 11 is at sixteen; MUDD's early source, block 4, is another).
SIX_BLOCKS = ("--num_layers=6", "--value_embed_layout=0,1,-,-,0,1", "--skip_connections=2<1,3<0",
              "--long_window_layers=0,3,5", "--backout_layer=3")
MUDD_SIX_BLOCKS = (*SIX_BLOCKS, "--attn_input_from_layer=3")


@pytest.mark.parametrize("recipe", FRONTIER)
def test_six_blocks_keep_every_part_of_the_recipes_layout(recipe):
    six_blocks = MUDD_SIX_BLOCKS if recipe == "mudd" else SIX_BLOCKS
    config, sixteen = (tg.parse_args(["--preset=tiny", *grid(recipe), *layout]) for layout in (six_blocks, ()))
    changed = {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(sixteen, f.name)}
    assert changed == {"num_layers", "value_embed_layout", "skip_connections", "long_window_layers", "backout_layer",
                       *(["attn_input_from_layer"] if recipe == "mudd" else [])}
    assert sorted(config.value_embed_tables[:2] + config.value_embed_tables[-2:]) == [0, 0, 1, 1]
    assert len(config.skips) == 2 and config.long_layers == {0, config.backout_layer, config.num_layers - 1}
    assert config.backout != config.mudd  # h_b (backout_layer) feeds the backout, or MUDD in its place
    if config.mudd:
        assert config.attn_input_from_layer == config.backout_layer  # as block 11 is at sixteen
        assert config.num_layers - 1 - config.attn_input_from_layer == 2  # two blocks attend from it
        assert len({tg.MUDD_EARLY_LAYER, config.backout_layer, config.num_layers - 1}) == 3  # the final mix's sources


@functools.cache
def dry_run_output(recipe: str) -> str:
    """What --dry_run --recipe=recipe prints, made once for the tests that read it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tg.main(["--dry_run", f"--recipe={recipe}"]) == 0
    return out.getvalue()


# ---- the bigram recipe's values and step grid (PR #252)

def test_the_bigram_recipe_sets_every_value_of_pr_252_and_says_it_is_an_unmerged_claim():
    recipe, record = tg.RECIPES["bigram"], published.find("bigram")
    config = tg.make_config(recipe="bigram")
    assert (config.num_iterations, config.extension_steps, tg.untie_step(config)) == (4620, 40, 765)
    assert (config.fused_softcap_ce, config.fp8, config.fp8_ranges, config.head_transposed) == (
        True, True, (100.0, 1.6, 0.75), True)
    assert (config.bigram_embed, config.bigram_table_multiple, config.bigram_lambda_init) == (True, 5, 0.05)
    assert (config.gates_optimizer, config.small_params_betas, config.scalar_lr, config.adam_fp32_moments) == (
        "adam", "scalar", 0.004, True)
    assert (config.muon_lr_shape, config.muon_scalar_rounding, config.fp32_block_weights) == ("blocks", "pr252", False)
    assert (config.muon_lr, config.yarn_window_limit, config.coordinate_descent_tuning) == (0.015, 13, True)
    # one committed log: its time, n = 1 and no t-test
    assert recipe.claim_pr == record.pr == 252 and record.is_claim
    assert (recipe.runs, recipe.p_value, recipe.mean_time_s) == (record.log_stats.n, None, 950.425)
    assert "1 run, no t-test, unmerged claim PR #252" in tg.recipe_summary(config)


def test_the_bigram_step_grid_is_pr_252s():
    """S = 4580: YaRN at 382, 764, 1145 only; the one full-batch step at lr 1.73 is 1145 (1145/4580
    is exactly 1/4 and the slot needs step/S > 1/4); the cooldown starts at 1375."""
    config = tg.make_config(recipe="bigram")
    assert [step for step, _, _ in tg.yarn_changes(config)] == [382, 764, 1145]
    assert [tg.batch_tokens(s, config) for s in (381, 382, 764, 1145)] == [131072, 262144, 393216, 524288]
    assert [tg.lr_schedule(s, config) for s in (1145, 1146)] == [1.73, 2.0]
    assert tg.lr_schedule(1374, config) == 2.0 and tg.lr_schedule(1375, config) == pytest.approx(1.99941, abs=1e-5)
    assert tg.lr_schedule(4580, config) == 0.1
    assert sum(tg.batch_tokens(s, config) for s in range(4620)) == 2_121_924_608


def test_the_bigram_recipes_dry_run_counts_pr_252s_parameters():
    """870,976,936 on any world size here (the scalars are padded to 8 whatever the GPU count; PR
    #252's own script pads to its world size, 3 fewer on one GPU)."""
    out = dry_run_output("bigram")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["total_params"] == 870_976_936
    assert summary["params_in_use_before_split"] == 819_465_640
    assert re.search(r"predicted peak memory allocated: [\d,]+ MiB per GPU on 8 GPUs; the "
                     r"2026-04-07_BigramFusedCEUnifiedOpt record logged 59,288 MiB", out)


@pytest.mark.parametrize("recipe", FRONTIER)
def test_the_short_grid_keeps_each_frontier_recipes_switches_and_phases(recipe):
    config = tg.parse_args(["--preset=tiny", *grid(recipe)])
    for name, value in tg.RECIPES[recipe].values.items():
        if name not in tg.PRESETS["tiny"] and name != "num_iterations":
            assert getattr(config, name) == value, name
    assert tg.untie_step(config) == 5 and tg.scheduled_steps(config) == N - 2
    assert len(tg.yarn_changes(config)) == (8 if recipe == "fp8_yarn" else 3)


# ---- whole runs

@pytest.mark.slow
@pytest.mark.parametrize("recipe", FRONTIER)
def test_each_tiny_frontier_recipe_learns(recipe, synthetic_dir, tmp_path):
    """The whole short grid, each recipe's own values. fp8_yarn and bigram on six blocks: their layout
    is bulk's, which test_bulk_recipe's run trains at sixteen, and none of their switches (the FP8
    head, its transposed storage, YaRN, the fused loss, the bigram table on every block, #252's
    optimizer table) depends on the depth (their losses fall as far on six blocks as on sixteen).
    mudd on its sixteen: the one whole training run of a frontier recipe's own layout (blocks 12-15
    attending from block 11, MUDD's mixes reading blocks 4, 11 and 14)."""
    assert tg.main(run_argv(synthetic_dir, tmp_path, *grid(recipe), *(SIX_BLOCKS if recipe != "mudd" else ()), N=N)) == 0
    losses = [float(m[1]) for m in re.finditer(rf"^step:\d+/{N} val_loss:(\S+)", log_text(tmp_path), re.M)]
    assert len(losses) == N // 2 + 1
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses[2:], losses[3:]))


# ---- mudd on six blocks: the resume and the process pair
# Half the grid (PAIR_STEPS: batches 256, 512, 768, 1024 from steps 0-3, YaRN at 1, 2, 3, the split
# after step 3, checkpoints at 4, 8, 12, the last two steps the extension), Adam stepping every step:
# each cross-rank reduction is then one sum of two terms (exact in either order)
PAIR_FLAGS = (*grid("mudd", PAIR_STEPS), "--untie_embed_after_step=3", "--adam_odd_steps_only=false",
              *MUDD_SIX_BLOCKS)


def test_the_mudd_pair_runs_half_the_grid_with_adam_every_step():
    config = tg.parse_args(["--preset=tiny", *PAIR_FLAGS])
    assert (config.num_iterations, config.adam_odd_steps_only, tg.untie_step(config)) == (PAIR_STEPS, False, 3)
    assert [step for step, _, _ in tg.yarn_changes(config)] == [1, 2, 3]
    assert [tg.batch_tokens(s, config) for s in range(5)] == [256, 512, 768, 1024, 1024]
    assert config.num_layers == 6 and config.attn_input_from_layer == 3


@pytest.fixture(scope="module")
def mudd_one_process(synthetic_dir, tmp_path_factory):
    """The reference both tests read: one plain process, 2 micro-steps per step (in this process:
    neither test is about its launch)."""
    out = tmp_path_factory.mktemp("mudd_one_process")
    assert tg.main(run_args(synthetic_dir, out, *PAIR_FLAGS)) == 0
    return out


@pytest.mark.slow
def test_a_frontier_run_killed_after_the_split_resumes_bit_for_bit(mudd_one_process, synthetic_dir, tmp_path):
    """SIGKILL once the step-8 checkpoint (after the split) exists; --resume latest finishes the run
    (the extension) as the uninterrupted one, bit for bit. (Adam steps every step here: a resume on
    the odd-step schedule, whose checkpoints fall after odd steps, is test_bulk_recipe's.)"""
    argv = run_args(synthetic_dir, tmp_path, *PAIR_FLAGS)
    kill_when_saved(argv, tmp_path, 8)
    assert tg.main([*argv, "--resume=latest"]) == 0
    assert resumed_step(tmp_path) >= 8
    assert_bit_identical(checkpoint_tensors(tmp_path / f"ck/tiny/step_{PAIR_STEPS:06d}"),
                         checkpoint_tensors(mudd_one_process / f"ck/tiny/step_{PAIR_STEPS:06d}"))


@pytest.mark.slow
def test_two_processes_equal_accumulation_in_mudd(mudd_one_process, synthetic_dir, tmp_path):
    """./run.sh with NPROC_PER_NODE=2 (torchrun) against the one process: the two runs agree bit for
    bit, the exchange of every kind of tensor the frontier recipes have (Muon's bf16 blocks, Adam's
    sharded rows, the sparse bigram rows, the small tensors whole)."""
    two = launch([(["./run.sh", *run_args(synthetic_dir, tmp_path, *PAIR_FLAGS)], clean_env(NPROC_PER_NODE="2"))],
                  tmp_path)
    for step in (4, 8, PAIR_STEPS):
        assert_bit_identical(checkpoint_tensors(mudd_one_process / f"ck/tiny/step_{step:06d}"),
                             checkpoint_tensors(two / f"ck/tiny/step_{step:06d}"))


@pytest.mark.parametrize("recipe", FRONTIER)
def test_each_frontier_recipes_dry_run_predicts_its_peak_next_to_the_logged_one(recipe):
    """The prediction moves bulk's logged peak by what the recipe holds and keeps more; the line
    names the claim's own logged peak beside it."""
    out = dry_run_output(recipe)
    logged = f"{tg.RECIPES[recipe].peak_mib:,}"
    match = re.search(rf"predicted peak memory allocated: ([\d,]+) MiB per GPU on 8 GPUs; the \S+ record logged "
                      rf"{logged} MiB", out)
    assert match and int(match[1].replace(",", "")) > tg.RECIPES["bulk"].peak_mib
