"""The whole bulk recipe (--recipe bulk) at tiny size, on a short step grid that puts every phase
within 24 steps: it learns; a run resumed before the embedding split and the last batch-size
change, or killed after the split, ends where the uninterrupted run does, bit for bit.

The short grid: 24 steps, the last 2 extension steps, so 22 scheduled steps in 12 slots. Batches
of 256, 512, 768 and then 1024 tokens from steps 0, 2, 4 and 6; the long window 3, 7, 11, 13, ...
blocks with YaRN at steps 2, 4 and 6; three multi-token weights until step 1, two until step 3;
the tied head and input table split after step 5 (the grid's odd split step). Checkpoints every 4
steps (odd-step Adam holds gradients after even steps, so checkpoints fall after odd ones).

The runs have 4 blocks (test_bulk_model.FOUR_BLOCKS: every layer pattern of the 16 once): a resume
ends bit for bit or not whatever the depth, the grid's events are the same, and a step costs about
half. The 16 blocks learn in the session's whole tiny run (conftest's tiny_seed0_run, the goldens).
"""
import re

import pytest

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCK_FLAGS
from test_checkpoint import kill_when_saved, log_text, resumed_step, run_argv
from test_distributed import assert_bit_identical, checkpoint_tensors

N = 24
SHORT_GRID = ("--recipe=bulk", f"--num_iterations={N}", "--extension_steps=2", "--untie_embed_after_step=5",
              "--save_every=4", "--seed=0", *FOUR_BLOCK_FLAGS)


def test_the_short_grid_puts_every_phase_of_the_recipe_in_24_steps():
    config = tg.parse_args(["--preset=tiny", *SHORT_GRID])
    assert config.untie_embed_after_step == tg.embedding_split_step(config) == 5
    assert [tg.batch_tokens(s, config) for s in (0, 2, 4, 6, N - 1)] == [256, 512, 768, 1024, 1024]
    assert [step for step, _, _ in tg.yarn_changes(config)] == [2, 4, 6]
    assert [len(tg.multi_token_weights(s, config)) for s in (1, 2, 3, 4)] == [3, 2, 2, 1]
    assert tg.scheduled_steps(config) == N - 2 and tg.grid_lr_multiplier(N - 1, config, 0.1) == 0.1


@pytest.fixture(scope="module")
def uninterrupted(synthetic_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bulk_uninterrupted")
    assert tg.main(run_argv(synthetic_dir, out, *SHORT_GRID, N=N)) == 0
    return out


@pytest.mark.slow
def test_the_tiny_bulk_recipe_learns(uninterrupted):
    losses = [float(m[1]) for m in re.finditer(r"^step:\d+/24 val_loss:(\S+)", log_text(uninterrupted), re.M)]
    assert len(losses) == N // 2 + 1
    assert losses[0] == pytest.approx(6.24, abs=0.01)  # about ln(512): the head starts N(0, 0.005^2)
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses[2:], losses[3:]))


@pytest.mark.slow
def test_a_resume_before_the_split_and_the_last_batch_change_ends_bit_for_bit(uninterrupted, synthetic_dir,
                                                                              tmp_path):
    """--resume=<the step-4 checkpoint>: the split after step 5, the last batch change and the last
    YaRN change at 6 and the extension are ahead of the resumed run (the short grid's test). The
    live recipe's (the tiny preset's) resume from a checkpoint before the split: this test is the
    suite's (one on a 12-step grid of the same recipe ran the same code path over fewer events)."""
    saved = uninterrupted / "ck" / "tiny" / "step_000004"
    assert tg.main(run_argv(synthetic_dir, tmp_path, *SHORT_GRID, f"--resume={saved}", N=N)) == 0
    assert f"resumed from {saved} at step 4/{N}" in log_text(tmp_path)
    assert_bit_identical(checkpoint_tensors(tmp_path / "ck/tiny/step_000024"),
                         checkpoint_tensors(uninterrupted / "ck/tiny/step_000024"))


@pytest.mark.slow
def test_a_run_killed_after_the_split_resumes_bit_for_bit(uninterrupted, synthetic_dir, tmp_path):
    """SIGKILL as soon as the step-8 checkpoint (after the split) exists; --resume latest finds the
    newest whole checkpoint the killed process left and finishes the run bit for bit. The suite's
    SIGKILL resume of the live recipe (one killed at step 2 of a 12-step grid of the same recipe
    ran the same code path)."""
    kill_when_saved(run_argv(synthetic_dir, tmp_path, *SHORT_GRID, N=N), tmp_path, 8)
    assert not (tmp_path / "ck" / "tiny" / f"step_{N:06d}").exists()
    assert tg.main(run_argv(synthetic_dir, tmp_path, *SHORT_GRID, "--resume=latest", N=N)) == 0
    assert resumed_step(tmp_path) >= 8
    assert_bit_identical(checkpoint_tensors(tmp_path / f"ck/tiny/step_{N:06d}"),
                         checkpoint_tensors(uninterrupted / f"ck/tiny/step_{N:06d}"))


# ---- world size 2 = world size 1 with 2 micro-steps: the tiny preset is this recipe's tiny form, and
# tests/test_distributed.py runs it on two processes against one (bit for bit, Adam every step, over
# the batch ramp, the split and the extension); with Adam on odd steps the order in which the ranks
# add their held gradients is tests/test_bulk_optim.py's (bit for bit), and tools/gpu_check's
# several-GPU check runs the default recipe on two processes (tests/test_bench.py)

# Half the grid for the frontier recipes' process pair (tests/test_frontier_recipes.py): 12 steps,
# 2 of them extension, the split after step 3; batches of 256, 512, 768, 1024 tokens from steps 0, 1,
# 2, 3 (checkpoints at 4, 8, 12).
PAIR_STEPS = 12


def test_the_bulk_recipes_flops_per_token_are_weighted_by_the_tokens_of_each_step():
    """With a batch ramp a short-window step trains fewer tokens: the per-token average weights each
    step's attention FLOPs by its batch (the matmul weights' FLOPs are the same for every token)."""
    config = tg.make_config(recipe="bulk")
    model = tg.build_model(config, "meta")
    tokens = [tg.batch_tokens(s, config) for s in range(config.num_iterations)]
    per_step = [tg.attention_flops_per_token(config, *tg.attention_windows(s, config))
                for s in range(config.num_iterations)]
    want = sum(t * f for t, f in zip(tokens, per_step)) / sum(tokens)
    assert tg.flops_per_token(config, model)["attention"] == pytest.approx(want, rel=1e-12)
    assert want > sum(per_step) / len(per_step)  # the long-window steps carry the full batch
