"""--fp8_mlp_down (PR #342, docs/short-track-transfer.md section 8): the MLP output projection from
e4m3 codes with delayed scales. The product against an emulation from the formula (exactly), its
saturation past the headrooms; the delay (each slice's activation scale from its previous forward,
the weight's from the previous step, the current weight for the first 16 steps); the backward is the
bf16 backward at the FP8 output (alone and with §15); training only; the scales are model state
(warm-up restore, checkpoint round trip, resume after SIGKILL) and per slice (two processes equal
one accumulating); one traced graph; the config rules."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCKS, fill_random
from test_checkpoint import train_loader_of
from test_distributed import on_ranks
from test_fp8_mlp import AtValue
from test_training import all_state, assert_same_state, random_batches

E4M3 = torch.float8_e4m3fn


def lifted(t, fraction):
    """t with every value below fraction x its largest set to 0: each remaining code >= 8 in size, an
    integer of e4m3, so the fp32 sum of the codes' products is exact in any order."""
    return torch.where(t.abs() < t.abs().max() * fraction, torch.zeros_like(t), t)


def test_the_product_is_the_formulas_emulation_exactly():
    """post >= 0 (2, 12, 64) and W2 (32, 64) in bf16, scales with the headrooms: s_a = 1.80 max / 448,
    s_w = 1.12 max / 448 (codes up to 249 and 400; 64 of their products stay below 2^24)."""
    gen = torch.Generator().manual_seed(0)
    post = lifted(torch.randn(2, 12, 64, generator=gen).square(), 1 / 30).bfloat16()
    w2 = lifted(torch.randn(32, 64, generator=gen) * 0.05, 1 / 45).bfloat16()
    s_a = torch.tensor(post.float().max().item() * 1.80 / 448, dtype=torch.float32)
    s_w = torch.tensor(w2.float().abs().max().item() * 1.12 / 448, dtype=torch.float32)
    post8 = (post.float() * (1 / s_a)).to(E4M3)  # #342's kernel: post times the fp32 reciprocal
    w8 = (w2.float() / s_w).to(E4M3)
    assert (post8.float().eq(0) | post8.float().ge(8)).all() and (w8.float().eq(0) | w8.float().abs().ge(8)).all()
    assert 240 <= post8.float().max() <= 256 and 384 <= w8.float().abs().max() <= 416  # the headrooms
    product = (post8.double().reshape(-1, 64) @ w8.double().t()).float()
    want = (product * (s_a * s_w)).bfloat16().view(2, 12, 32)
    got = tg.fp8_down_product(post, w2, s_a, s_w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # within FP8's error of the bf16 product
    exact = F.linear(post.double(), w2.double())
    assert ((got.double() - exact).norm() / exact.norm()) < 0.06


def test_post_past_the_headroom_and_a_grown_weight_saturate_at_448():
    post = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).bfloat16()
    w2 = torch.tensor([[0.75, -2.0, 1.5, 3.0]]).bfloat16()
    s_a, s_w = torch.tensor(1.0 * 1.80 / 448), torch.tensor(1.0 * 1.12 / 448)  # the last maxima: 1 and 1
    got = tg.fp8_down_product(post, w2, s_a, s_w)
    # codes: post 0, 248.9 (rounded to 256), 448, 448; W2 300 (rounded to 288), -448, 448, 448
    codes_post, codes_w = torch.tensor([0.0, 256, 448, 448]), torch.tensor([288.0, -448, 448, 448])
    want = ((codes_post * codes_w).sum() * (s_a * s_w)).bfloat16()
    assert torch.equal(got.view(()), want)


def tiny(**overrides):
    return tg.make_config("tiny", **{"dtype": "bfloat16", "seed": 3, "fp8_mlp_down": True, **overrides})


def four_blocks(**overrides):
    """tiny() on FOUR_BLOCKS, for the training runs: the scales are each block's own, read and written
    by its MLP alike at any depth, so 4 blocks (every layer pattern of the 16) show what 16 would."""
    return tiny(**{**FOUR_BLOCKS, **overrides})


def test_the_state_is_buffers_of_each_block_and_off_builds_none():
    config = tiny(batch_slices=4)
    model = tg.build_model(config)
    names = [n for n in model.state_dict() if "fp8_down" in n]
    assert names == [f"blocks.{i}.mlp.fp8_down.{k}" for i in range(16) for k in ("act", "weight")]
    down = model.blocks[0].mlp.fp8_down
    assert torch.equal(down.act, torch.ones(4)) and torch.equal(down.weight, torch.tensor([1.0, 0.0, 1.0]))
    assert not any(n.startswith("blocks.0.mlp.fp8_down") for n, _ in model.named_parameters())
    plain = tg.build_model(tiny(fp8_mlp_down=False, batch_slices=4))
    assert not any("fp8_down" in n for n in plain.state_dict()) and plain.blocks[0].mlp.fp8_down is None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())


def recorded_calls(monkeypatch):
    """Each fp8_down_product call's (s_a, s_w, max post, max|W2|), in call order."""
    calls = []
    real = tg.fp8_down_product

    def spy(post, w2, s_a, s_w):
        calls.append((s_a.clone(), s_w.clone(), post.float().max(), w2.float().abs().max()))
        return real(post, w2, s_a, s_w)
    monkeypatch.setattr(tg, "fp8_down_product", spy)
    return calls


@pytest.mark.parametrize("from_post", [False, True])
def test_each_slices_scale_is_its_previous_forwards_and_the_weights_the_previous_steps(from_post, monkeypatch):
    """The tiny model, 2 slices as 2 micro-steps: the activation scale block b slice j uses at step k
    is max(its largest post at step k-1, 1e-12) x fp32(1.80 / 448) (1.0 at step 0); the weight scale
    is #342's: the current bf16 max|W2| / 448 in bf16 where pr342_bootstrap(k), else max(max|W2| of
    the previous step, 1e-12) x fp32(1.12 / 448). The bootstrap cut from the record's 16 steps
    (test_the_record_bootstraps_steps_0_to_16) to 2, as the checkpoint round trip below does: 5 steps
    then cross it, steps 0-2 with the current weight's scale and 3-4 with the delayed one (the
    record's 19 steps would cross the same switch at 16). On FOUR_BLOCKS (four_blocks), every block
    checked."""
    monkeypatch.setattr(tg, "FP8_DOWN_BOOTSTRAP_STEPS", 2)
    calls = recorded_calls(monkeypatch)
    config = four_blocks(mlp_backward_from_post=from_post)
    runner = tg.Runner(config, torch.device("cpu"))
    L, slices = config.num_layers, config.batch_slices
    assert runner.micro_steps == slices == 2
    gen = torch.Generator().manual_seed(0)
    steps = 5
    for step in range(steps):
        runner.train_step(step, runner.random_batches(gen))
    assert len(calls) == steps * slices * L
    by = lambda k, j, b: calls[(k * slices + j) * L + b]
    for k in range(steps):
        for j in range(slices):
            for b in range(L):
                s_a, s_w, _, w_max = by(k, j, b)
                want_a = torch.tensor(1.0) if k == 0 else fp32_product(by(k - 1, j, b)[2], 1.80 / 448)
                assert torch.equal(s_a, want_a), (k, j, b)
                if pr342_bootstrap(k, 2):
                    assert torch.equal(s_w, bf16_quotient(w_max, 448)), (k, j, b)
                else:
                    assert torch.equal(s_w, fp32_product(by(k - 1, j, b)[3], 1.12 / 448)), (k, j, b)
    assert sum(not torch.equal(by(k, 0, b)[0], by(k, 1, b)[0]) for k in range(1, steps) for b in range(L)) > L
    assert not torch.equal(by(4, 0, 3)[1], bf16_quotient(by(4, 0, 3)[3], 448))  # delayed: not the current weight's
    assert [k for k in range(steps) if pr342_bootstrap(k, 2)] == [0, 1, 2]


def test_the_record_bootstraps_steps_0_to_16():
    """#342's bootstrap_down=(s < 16): the forwards of steps 0..16 use the current weight's scale."""
    assert tg.FP8_DOWN_BOOTSTRAP_STEPS == 16
    assert [k for k in range(19) if pr342_bootstrap(k, tg.FP8_DOWN_BOOTSTRAP_STEPS)] == list(range(17))


def pr342_bootstrap(k: int, bootstrap_steps: int) -> bool:
    """Whether step k's forwards quantize W2 with its current maximum, by #342's calls: it
    requantizes once before training with bootstrap_down=True and after each optimizer step s with
    bootstrap_down=(s < bootstrap_steps) (16 in the record), and step k's forward reads the codes of
    the last requantization before it."""
    last_call = None if k == 0 else k - 1  # the step the requantization before step k followed (None: the first)
    return True if last_call is None else last_call < bootstrap_steps


def fp32_product(a: torch.Tensor, constant: float) -> torch.Tensor:
    """max(a, 1e-12) x fp32(constant), one fp32 product (#342's kernels, numpy's arithmetic)."""
    return torch.tensor(np.float32(max(a.item(), 1e-12)) * np.float32(constant))


def bf16_quotient(w_max: torch.Tensor, top: float) -> torch.Tensor:
    """#342's bootstrap scale, eager on the bf16 bank: bf16(fp32(max) / fp32(448)), as fp32, the max
    clamped at 1e-12 in bf16 first (W2 starts at zero)."""
    floor = torch.tensor(1e-12).bfloat16().item()
    return torch.tensor(float(np.float32(max(w_max.item(), floor)) / np.float32(top))).bfloat16().float()


def test_the_bootstrap_weight_scale_is_bf16_as_pr342_forms_it():
    """For a maximum of 1: bf16(1/448) = 0.0022277832 (fp32's is 0.0022321430), then used in fp32."""
    down = tg.FP8DownScales(2)
    _, s_w = down.scales(torch.tensor([[1.0, -0.5]]).bfloat16())
    assert s_w.dtype == torch.float32 and s_w.item() == 146 * 2 ** -16 == 0.002227783203125
    assert down.weight[1].item() == 1.0  # the recorded maximum, exact


def test_the_backward_is_the_bf16_backward_at_the_fp8_output():
    """dx, dW1, dW2 of the MLP (alone and with §15) equal autograd's through the plain bf16 MLP whose
    output is replaced by the FP8 output's value."""
    for from_post in (False, True):
        config = tiny(mlp_backward_from_post=from_post, fp32_block_weights=False)
        mlp = tg.MLP(config, torch.bfloat16)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            mlp.fc_w.copy_(torch.randn(mlp.fc_w.shape, generator=gen) * 0.125)
            mlp.proj_w.copy_(torch.randn(mlp.proj_w.shape, generator=gen) * 0.1)
            mlp.fp8_down.reset()
            mlp.fp8_down.act.fill_(0.02)
            mlp.fp8_down.weight.copy_(torch.tensor([0.0008, 0.3, 0.0]))  # a delayed weight scale
        x = tg.rms_norm(torch.randn(2, 24, 64, generator=gen)).bfloat16()
        grad = torch.randn(2, 24, 64, generator=gen).bfloat16()

        def run(forward):
            mlp.zero_grad()
            a = x.clone().requires_grad_()
            out = forward(a)
            out.backward(grad)
            return out.detach(), a.grad, mlp.fc_w.grad.clone(), mlp.proj_w.grad.clone()

        def reference(a):
            hidden = F.relu(F.linear(a, mlp.fc_w)).square()
            w2 = mlp.proj_w.T
            fp8 = tg.fp8_down_product(hidden.detach(), w2.detach(), torch.tensor(0.02), torch.tensor(0.0008))
            return AtValue.apply(F.linear(hidden, w2), fp8)

        got = run(mlp.train())
        down = mlp.fp8_down  # slice 0's forward recorded its next scale; the one it used is kept until the step
        assert down.act_next[0] != torch.tensor(0.02) and down.act_next[1] == torch.tensor(1.0)
        assert torch.equal(down.act, torch.tensor([0.02, 0.02]))
        want = run(reference)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        plain = run(mlp.eval())
        assert not torch.equal(got[0], plain[0])


def test_validation_is_the_plain_product_and_leaves_the_scales():
    model, plain = tg.build_model(tiny(dtype="float32")), tg.build_model(tiny(dtype="float32", fp8_mlp_down=False))
    fill_random(model), fill_random(plain)  # the same values by name, W2 not zero
    before = {k: v.clone() for k, v in model.state_dict().items() if "fp8_down" in k}
    ids = torch.randint(0, 500, (257,), generator=torch.Generator().manual_seed(0))
    args = (ids[:-1].int(), ids[1:], torch.tensor([3, 1], dtype=torch.int32), "none")
    with torch.no_grad():
        assert torch.equal(model.eval()(*args), plain.eval()(*args))
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert not torch.equal(model.train()(*args), plain.train()(*args))
    assert not all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_warm_up_restores_the_starting_scales():
    config = four_blocks(warmup_steps=2)
    runner = tg.Runner(config, torch.device("cpu"))
    runner.warmup()
    for block in runner.model.blocks:
        assert torch.equal(block.mlp.fp8_down.act, torch.ones(2))
        assert torch.equal(block.mlp.fp8_down.weight, torch.tensor([1.0, 0.0, 1.0]))


def test_a_checkpoint_round_trip_keeps_the_scales_and_the_next_steps(synthetic_dir, tmp_path, monkeypatch):
    """As tests/test_checkpoint.py's round trip, saved after step 3 (before the split), with a
    bootstrap of 2 steps so that the delayed weight scale is in use: the resumed runner has the same
    scales and its next two steps are the same. On FOUR_BLOCKS (four_blocks)."""
    monkeypatch.setattr(tg, "FP8_DOWN_BOOTSTRAP_STEPS", 2)
    config = four_blocks(warmup_steps=0, checkpoint_dir=str(tmp_path / "ck"),
                  train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    batch = lambda loader, step: loader.next_batch(tg.slice_tokens(step, config))
    runner, loader = tg.Runner(config, torch.device("cpu")), train_loader_of(config)
    for step in range(4):
        runner.train_step(step, batch(loader, step))
    assert (runner.model.blocks[2].mlp.fp8_down.weight[2] == 0).item()  # delayed now
    path = tg.save_checkpoint(runner, loader, 4, 1.0)
    resumed, resumed_loader = tg.Runner(config, torch.device("cpu")), train_loader_of(config)
    tg.load_checkpoint(resumed, resumed_loader, path, tg.validate_checkpoint(path))
    for a, b in zip(runner.model.blocks, resumed.model.blocks):
        assert torch.equal(a.mlp.fp8_down.act, b.mlp.fp8_down.act)
        assert torch.equal(a.mlp.fp8_down.weight, b.mlp.fp8_down.weight)
    for step in (4, 5):
        assert torch.equal(runner.train_step(step, batch(loader, step)),
                           resumed.train_step(step, batch(resumed_loader, step)))
    assert_same_state(all_state(resumed), all_state(runner))


# A SIGKILL resume with the scales: the round trip above (past the bootstrap, the next steps the same)
# and tests/test_transfer_recipe.py's killed candidate, which has --fp8_mlp_down on.


def run_down_steps(rank: int, world_size: int):
    """The tiny --fp8_mlp_down runner (2 slices) on world_size processes (each its slices of fixed
    random batches), 3 steps, on FOUR_BLOCKS: every block's activation scales after each step."""
    config = four_blocks(dtype="float32")
    runner = tg.Runner(config, torch.device("cpu"), rank, world_size)
    acts = []
    for step in range(3):
        batches = random_batches(config, seed=step)
        runner.train_step(step, batches[rank * runner.micro_steps:(rank + 1) * runner.micro_steps])
        acts.append(torch.stack([block.mlp.fp8_down.act.clone() for block in runner.model.blocks]))
    return acts


@pytest.mark.slow
def test_two_processes_keep_the_scales_of_the_slices_they_run(tmp_path):
    """Per-slice scales: rank r runs slice r and writes slice r's scale only (the other stays 1.0
    there). After step 0 (the same initial weights) it is the one-process run's bit for bit; later
    the two runs' weights differ by the order of the gradient sums (the plain tiny model on 2
    processes is not bit for bit the accumulating one either), so the scales agree closely."""
    results = on_ranks(run_down_steps, 2, tmp_path)
    want = run_down_steps(0, 1)
    assert all((w != 1.0).all() for w in want)
    for rank, got in enumerate(results):
        assert torch.equal(got[0][:, rank], want[0][:, rank])
        for g, w in zip(got, want):
            assert (g[:, 1 - rank] == 1.0).all()
            assert torch.allclose(g[:, rank], w[:, rank], rtol=1e-2)


def test_the_mlp_traces_as_one_graph_with_the_same_bits_and_state():
    """fullgraph aot_eager with the scales read and the slice's written inside: the eager outputs,
    gradients and updated scales."""
    for from_post in (False, True):
        results = []
        for compiled in (False, True):
            mlp = tg.MLP(tiny(mlp_backward_from_post=from_post), torch.float32).train()
            gen = torch.Generator().manual_seed(2)
            with torch.no_grad():
                mlp.fc_w.copy_(torch.randn(mlp.fc_w.shape, generator=gen) * 0.125)
                mlp.proj_w.copy_(torch.randn(mlp.proj_w.shape, generator=gen) * 0.1)
            mlp.fp8_down.slice.fill_(1)
            forward = torch.compile(mlp, backend="aot_eager", fullgraph=True, dynamic=False) if compiled else mlp
            x = tg.rms_norm(torch.randn(2, 24, 64, generator=gen)).bfloat16().requires_grad_()
            out = forward(x)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), x.grad, mlp.fc_w.grad, mlp.proj_w.grad, mlp.fp8_down.act_next.clone()))
        assert results[0][4][0] == 1.0 and results[0][4][1] != 1.0  # slice 1's scale was recorded
        assert all(torch.equal(a, b) for a, b in zip(*results))


def test_activation_checkpointing_recomputes_with_the_scales_the_forward_used():
    """The recomputed forward of a checkpointed block reads the scale its first forward read (the
    recorded one waits in act_next until the step): two steps give the plain run's loss, weights
    and scales, bit for bit. On FOUR_BLOCKS (four_blocks)."""
    results = []
    for checkpointing in (False, True):
        config = four_blocks(activation_checkpointing=checkpointing, warmup_steps=0, seed=5)
        runner = tg.Runner(config, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        losses = [runner.train_step(step, runner.random_batches(gen, tg.slice_tokens(step, config)))
                  for step in (0, 1)]
        scales = {k: v.clone() for k, v in runner.model.state_dict().items() if ".fp8_down." in k}
        results.append((losses, all_state(runner), scales))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert_same_state(results[1][1], results[0][1])
    assert results[0][2].keys() == results[1][2].keys()
    assert all(torch.equal(results[0][2][k], results[1][2][k]) for k in results[0][2])
    assert not torch.equal(results[0][2]["blocks.3.mlp.fp8_down.act"], torch.ones(2))  # recorded and in use


def test_odd_widths_are_refused_in_one_line():
    with pytest.raises(tg.ConfigError) as refusal:
        tg.parse_args(["--preset=tiny", "--fp8_mlp_down", "--model_dim=72", "--num_heads=1", "--head_dim=72"])
    assert str(refusal.value).startswith("--fp8_mlp_down: ") and "multiples of 16" in str(refusal.value)
    tg.parse_args(["--preset=tiny", "--fp8_mlp_down"])
