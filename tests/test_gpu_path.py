"""The GPU path, proven on the CPU: Muon's compiled per-matrix update against the eager one (the
CPU default), FlexAttention never run eagerly (equal to the dense SDPA mask in evaluation, refused
for CPU training), the CUDA allocator's expandable segments set before CUDA starts, and the peak
memory statistics restarted after the warm-up."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import train_gpt_medium as tg

FP32_EPS = torch.finfo(torch.float32).eps


# ---- Muon: one compiled function for every matrix


def muon_run(shapes, dtype, compile_update, steps, gradients, weight_decay=0.01):
    """Muon over one matrix of each shape; after each (lr, momentum) step, the fp32 master values
    (the weight, or bf16 weight + low bits) and the momentum buffers of every matrix."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype)) for s in shapes]
    opt = tg.Muon([dict(params=params, wd_mul=2.0)], lr=0.0, momentum=0.0, weight_decay=weight_decay,
                  compile_update=compile_update)
    history = []
    for (lr, momentum), grads in zip(steps, gradients):
        for group in opt.param_groups:
            group.update(lr=lr, momentum=momentum)
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        opt.step()
        history.append([(master(p, opt), opt.state[p]["momentum_buffer"].clone()) for p in params])
    return history


def master(p, opt):
    state = opt.state[p]
    return tg.fp32_from_halves(p.data, state["low_bits"]) if "low_bits" in state else p.data.clone()


def dyadic_gradients(shapes, num_steps, seed=1):
    """Entries k/8 with |k| <= 4: every partial sum of squares is exact in fp32 (at most 22 bits even
    after the momentum's halvings), so the Frobenius norm is the same in any summation order."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(-4, 5, s, generator=gen).float() / 8 for s in shapes] for _ in range(num_steps)]


def normal_gradients(shapes, num_steps, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(num_steps)]


# Square shapes, one of them batched like the merged attention weight: lr_eff = lr, a power of two,
# so lr_eff * update is exact and the last step rounds once whether fused (eager) or not (compiled).
# Momentum 0 and 0.5 make both lerps exact as well. With these, compiled and eager do the same
# arithmetic; otherwise they differ where ATen fuses a multiply-add (lerp, add with alpha) that
# Inductor's C++ does not (-ffp-contract=off), and in the order of the norm's sum.
SAME_ARITHMETIC_SHAPES = [(64, 64), (4, 32, 32)]
SAME_ARITHMETIC_STEPS = [(2.0**-6, 0.0), (2.0**-7, 0.5), (2.0**-5, 0.5)]


@pytest.fixture(scope="module")
def same_arithmetic_runs():
    """Eager and compiled Muon on the same fp32 problem, and what compiling cost in graphs."""
    torch._dynamo.reset()  # count this module's compilations from nothing
    grads = dyadic_gradients(SAME_ARITHMETIC_SHAPES, len(SAME_ARITHMETIC_STEPS))
    eager = muon_run(SAME_ARITHMETIC_SHAPES, torch.float32, False, SAME_ARITHMETIC_STEPS, grads)
    before = tg.compile_counts()
    compiled = muon_run(SAME_ARITHMETIC_SHAPES, torch.float32, True, SAME_ARITHMETIC_STEPS, grads)
    return eager, compiled, tg.compiled_since(before)


@pytest.mark.slow
def test_compiled_muon_update_is_bit_exact_in_fp32_where_the_arithmetic_is_the_same(same_arithmetic_runs):
    eager, compiled, _ = same_arithmetic_runs
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for (w_master, w_buf), (g_master, g_buf) in zip(want, got):
            assert torch.equal(g_master.view(torch.int32), w_master.view(torch.int32)), f"weights, step {step}"
            assert torch.equal(g_buf, w_buf), f"momentum, step {step}"
    assert not torch.equal(compiled[-1][0][0], compiled[0][0][0])  # the weights did move


@pytest.mark.slow
def test_compiled_muon_update_compiles_once_per_shape_not_per_lr_or_momentum(same_arithmetic_runs):
    """Two shapes, three steps with a new lr and momentum each: two graphs, the second one a recompile."""
    *_, added = same_arithmetic_runs
    assert added["graphs"] == len(SAME_ARITHMETIC_SHAPES)
    assert added["recompiles"] == len(SAME_ARITHMETIC_SHAPES) - 1


@pytest.mark.slow
def test_compiled_muon_update_agrees_with_eager_to_fp32_rounding():
    """The record's lr and momenta on a tall matrix (lr scale sqrt(3)): the fused multiply-adds and
    the norm's summation order round differently. Measured over these steps: weights within 3e-8
    (|w| <= 0.25, where an fp32 ulp is at most 1.5e-8), momentum within 6e-8 (|b| ~ 1). Asserted:
    weights 1e-7; momentum 4 ulps of the largest gradient entry."""
    shapes = [(96, 32), (64, 64)]
    steps = [(0.025, 0.85), (0.02, 0.9), (0.01, 0.95)]
    grads = normal_gradients(shapes, len(steps))
    eager = muon_run(shapes, torch.float32, False, steps, grads)
    compiled = muon_run(shapes, torch.float32, True, steps, grads)
    largest = max(g.abs().max().item() for gs in grads for g in gs)
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for (w_master, w_buf), (g_master, g_buf) in zip(want, got):
            torch.testing.assert_close(g_master, w_master, rtol=0, atol=1e-7, msg=f"weights, step {step}")
            torch.testing.assert_close(g_buf, w_buf, rtol=0, atol=4 * FP32_EPS * largest, msg=f"momentum, step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 32, 32), (96, 32)])
def test_compiled_muon_update_agrees_with_eager_within_bf16_rounding(shape):
    """bf16 weights, one step from the same state: the compiled Newton-Schulz keeps fused
    intermediates in fp32 where eager rounds each to bf16, so the two updates differ by about as
    much as eager bf16 iteration differs from fp32 iteration (measured: ratio 0.8-1.5 over 3 seeds
    and 3 shapes). Asserted: at most twice that bf16 error, and the same momentum buffer."""
    lr, gen = 2.0**-6, torch.Generator().manual_seed(3)
    grads = [[torch.randn(shape, generator=gen).to(torch.bfloat16).float()]]
    (eager,), (compiled,) = (muon_run([shape], torch.bfloat16, c, [(lr, 0.9)], grads, weight_decay=0.0)
                             for c in (False, True))
    (w_master, w_buf), (g_master, g_buf) = eager[0], compiled[0]
    step_size = lr * math.sqrt(max(1.0, shape[-2] / shape[-1]))
    update_difference = ((g_master - w_master) / step_size).abs().max().item()
    bf16_error = (tg.orthogonalize(grads[0][0], torch.bfloat16).float()
                  - tg.orthogonalize(grads[0][0], torch.float32)).abs().max().item()
    assert update_difference <= 2 * bf16_error, (update_difference, bf16_error)
    assert torch.equal(g_buf, w_buf)


def test_the_cpu_run_keeps_the_eager_update_and_a_compiled_run_compiles_it():
    eager = tg.Runner(tg.make_config("tiny"), torch.device("cpu"))
    compiled = tg.Runner(tg.make_config("tiny", compile=True), torch.device("cpu"))  # nothing compiles before a call
    assert eager.optimizers[1].update is tg.muon_update
    assert compiled.optimizers[1].update is tg.compiled(tg.muon_update, fullgraph=True)


# ---- FlexAttention: compiled on its own when the model is not compiled


def per_token_losses(attention, ids, window):
    """Per-token losses of the tiny model with every matrix random: at init the attention output
    projection and the head are zero, and the losses would not depend on attention at all."""
    config = tg.make_config("tiny", dtype="float32", attention=attention, compile=False)
    model = tg.build_model(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        return model(ids[:-1].to(torch.int32), ids[1:].to(torch.int64), torch.tensor(window), reduction="none")


def tokens_with_documents():
    ids = torch.randint(0, 499, (513,), generator=torch.Generator().manual_seed(4))
    ids[[90, 200, 333]] = 499  # documents that start inside blocks
    return ids


@pytest.mark.parametrize("window", [1, 2, 4])
def test_flex_without_compile_gives_the_windowed_result_of_the_dense_mask(window):
    """--attention=flex --compile=false on the CPU, in evaluation: the same losses as SDPA with the
    dense mask (measured: within 2e-6 of losses near 6.7; asserted: 1e-5)."""
    ids = tokens_with_documents()
    torch.testing.assert_close(per_token_losses("flex", ids, window), per_token_losses("sdpa", ids, window),
                               rtol=1e-5, atol=1e-5)


def test_flex_run_eagerly_would_ignore_the_window(monkeypatch):
    """Guards the test above: uncompiled, flex_attention attends beyond the window."""
    monkeypatch.setattr(tg, "compiled", lambda fn, **options: fn)
    ids = tokens_with_documents()
    eager = per_token_losses("flex", ids, 1)
    assert (eager - per_token_losses("sdpa", ids, 1)).abs().max() > 1e-3


@pytest.mark.parametrize("extra", [[], ["--bench_steps=1"]])
def test_flex_training_on_the_cpu_is_refused_before_anything_is_written(extra, tmp_path, capsys):
    """FlexAttention has no backward pass on the CPU: exit 2 naming the flag to use, no log."""
    log_dir = tmp_path / "logs"
    code = tg.main(["--preset=tiny", "--attention=flex", f"--log_dir={log_dir}", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert "--attention=flex" in err and "--attention=sdpa" in err
    assert not log_dir.exists()


# ---- the CUDA caching allocator


def test_expandable_segments_are_set_under_the_name_torch_reads_first():
    environ = {}
    tg.use_expandable_segments(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_an_allocator_configuration_set_by_the_user_is_kept(name):
    environ = {name: "max_split_size_mb:512"}
    assert tg.use_expandable_segments(environ) == f"{name}=max_split_size_mb:512"
    assert environ == {name: "max_split_size_mb:512"}  # the other name would override or add to it


class CudaCalled(Exception):
    pass


def test_run_training_sets_the_allocator_before_its_first_cuda_call(monkeypatch):
    for name in tg.ALLOC_CONF_VARIABLES:
        monkeypatch.setenv(name, "")  # unset for the run, restored afterwards
    seen = {}

    def set_device(device):
        seen["PYTORCH_ALLOC_CONF"] = os.environ.get("PYTORCH_ALLOC_CONF")
        raise CudaCalled

    monkeypatch.setattr(tg, "resolve_device", lambda config, local_rank: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(CudaCalled):
        tg.run_training(tg.make_config("tiny"), 0)
    assert seen == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


# ---- peak memory


def test_peak_memory_statistics_restart_after_the_warmup_restored_the_state(monkeypatch):
    events = []
    restore = tg.restore_state
    monkeypatch.setattr(tg, "restore_state", lambda *args: (restore(*args), events.append("restore")))
    monkeypatch.setattr(tg, "reset_peak_memory", lambda device: events.append(f"reset {device.type}"))
    tg.Runner(tg.make_config("tiny", warmup_steps=1), torch.device("cpu")).warmup()
    assert events == ["restore", "reset cpu"]


def test_reset_peak_memory_resets_the_cuda_statistics_and_leaves_the_cpu_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    tg.reset_peak_memory(torch.device("cpu"))
    assert calls == []
    tg.reset_peak_memory(torch.device("cuda", 3))
    assert calls == [torch.device("cuda", 3)]
