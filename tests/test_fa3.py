"""--attention=fa3: the bulk record's FlashAttention-3 call, given the same documents and token
windows as the masks. No GPU and no `kernels` package here: a stand-in module supplies a plainly
written varlen attention (a loop over the documents), so these tests check what the trainer hands
FA3 (cumulative lengths, window, scale) against the SDPA path; the refusals are one line each."""
import importlib.util
import sys
import types

import pytest
import torch

import train_gpt_medium as tg
import triton_kernels as kernels
from test_inputs import refused


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_size):
    """(T, H, D) attention, each document [cu[i], cu[i+1]) on its own: causal, keys at most
    window_size[0] positions back, softmax(scale q k^T)."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and causal and window_size[1] == 0
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q[0] == 0 and cu_seqlens_q[-1] == q.size(0)
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        assert end - start <= max_seqlen_q
        pos = torch.arange(end - start)
        allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] <= window_size[0])
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * softmax_scale
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v[start:end])
    return out


def fake_gpu(capability, memory_gib=80) -> tg.GpuProperties:
    """A GPU's properties as tg.gpu_properties (the one place the trainer reads them) gives them."""
    return tg.GpuProperties(f"a GPU of compute capability {capability[0]}.{capability[1]}", capability,
                            memory_gib * 2**30)


@pytest.fixture
def fake_kernels(monkeypatch):
    calls = []

    def varlen(*args, **kwargs):
        calls.append(kwargs)
        return varlen_reference(*args, **kwargs)
    hub = types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(flash_attn_varlen_func=varlen))
    module = types.ModuleType("kernels")
    module.get_kernel = lambda name: hub if name == kernels.FA3_KERNEL else None
    monkeypatch.setitem(sys.modules, "kernels", module)
    monkeypatch.setattr(kernels, "_fa3_kernel", {})
    return calls


def bulk_config(**overrides):
    return tg.make_config("tiny", recipe="bulk", dtype="float32", seed=4, **overrides)


def documents(T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 499, (T + 1,), generator=gen)
    ids[torch.randperm(T, generator=gen)[:T // 40]] = 499  # end-of-text: documents of ~40 tokens
    ids[0] = 499
    return ids.to(torch.int32)


@pytest.mark.parametrize("step", [0, 40, 189, 190])  # windows 3/1, 7/3, 23/11 and the final 27/11
def test_fa3_computes_the_loss_and_gradients_of_the_token_window_masks(fake_kernels, step):
    config = bulk_config()
    model = tg.build_model(bulk_config(attention="fa3"))
    reference = tg.build_model(config)
    T = tg.slice_tokens(min(step, config.num_iterations - 1), config)
    ids = documents(T, seed=step)
    inputs, targets = ids[:-1], ids[1:].to(torch.int64)
    long, short = tg.attention_windows(step, config)
    fa3_loss = model(inputs, targets, (long, short))
    sdpa_loss = reference(inputs, targets, torch.tensor([long, short], dtype=torch.int32))
    fa3_loss.backward()
    sdpa_loss.backward()
    assert torch.allclose(fa3_loss, sdpa_loss, rtol=1e-5), (fa3_loss.item(), sdpa_loss.item())
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6), name
    reaches = {call["window_size"][0] for call in fake_kernels}
    assert reaches == {long * config.attn_block_size, short * config.attn_block_size}


def test_fa3_documents_start_at_each_end_of_text_token(fake_kernels):
    config = bulk_config(attention="fa3")
    ids = torch.tensor([5, 7, 499, 1, 2, 3, 499, 499, 9] + [4] * 7, dtype=torch.int32)
    long, short = tg.varlen_windows(ids, (3, 1), config, training=False)
    lengths = long.cu_seqlens.diff()
    assert lengths[:4].tolist() == [2, 4, 1, 9] and lengths[4:].sum() == 0
    assert (long.reach, short.reach) == (3 * config.attn_block_size, config.attn_block_size)
    assert long.max_seqlen == ids.numel()
    training = tg.varlen_windows(ids, (3, 1), tg.make_config("tiny", recipe="bulk", document_cut_tokens=8), True)
    assert training[0].max_seqlen == 8  # whole documents cut at 8 tokens


def test_the_runner_hands_fa3_its_windows_as_numbers(fake_kernels):
    runner = tg.Runner(bulk_config(attention="fa3"), torch.device("cpu"))
    assert runner.window(0) == tg.attention_windows(0, runner.config)
    assert runner.window(190) == (27, 11)


def test_fa3_on_the_cpu_is_refused_in_one_line(capsys):
    line = refused(["--preset=tiny", "--recipe=bulk", "--attention=fa3", "--device=cpu"], capsys)
    assert line.startswith("error: --attention: fa3 runs on Hopper GPUs only")


def test_fa3_without_the_kernels_package_names_it(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kernels" else real(name, *a))
    with pytest.raises(tg.ConfigError, match="pip install kernels"):
        tg.check_run_request(bulk_config(attention="fa3"), torch.device("cuda", 0))


def test_the_dry_run_says_what_the_real_run_of_fa3_would_refuse(capsys):
    """A plan that cannot run does not pass the dry run silently: it still prints its counts (exit 0)
    and says, in one line, what the real run would stop on (without CUDA's `kernels`: below)."""
    reason = "fa3 runs on Hopper GPUs only"
    assert tg.main(["--dry_run", "--attention=fa3", "--device=cpu", "--preset=tiny", "--recipe=bulk"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: a real run")]
    assert len(notes) == 1 and reason in notes[0]


def test_the_dry_run_of_fa3_names_the_missing_kernels_package(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kernels" else real_find_spec(name, *a))
    assert tg.main(["--dry_run", "--attention=fa3", "--recipe=bulk", "--device=cuda"]) == 0
    assert "needs the `kernels` package" in capsys.readouterr().out


@pytest.mark.parametrize("error", [OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your network."),
                                   ImportError("libcudart.so.12: cannot open shared object file")])
def test_fa3_whose_kernel_cannot_be_fetched_or_loaded_is_refused_in_one_line_naming_flex(error, monkeypatch):
    """No network on the machine (the hub's fetch fails) or a kernel that does not load: one line
    naming --attention=flex, raised before anything is built."""
    def get_kernel(name):
        raise error
    module = types.ModuleType("kernels")
    module.get_kernel = get_kernel
    monkeypatch.setitem(sys.modules, "kernels", module)
    monkeypatch.setattr(kernels, "_fa3_kernel", {})
    monkeypatch.setattr(tg, "gpu_properties", lambda device: fake_gpu((9, 0)))
    with pytest.raises(tg.ConfigError) as refusal:
        tg.check_fa3_device(torch.device("cuda", 0))
    line = str(refusal.value)
    assert "\n" not in line and "--attention=flex" in line and type(error).__name__ in line
    assert line.startswith(f"--attention: fa3's kernel {kernels.FA3_KERNEL} could not be fetched or loaded")


def test_fa3_whose_kernel_loads_passes_the_device_check(fake_kernels, monkeypatch):
    monkeypatch.setattr(tg, "gpu_properties", lambda device: fake_gpu((9, 0)))
    tg.check_fa3_device(torch.device("cuda", 0))
    assert "varlen" in kernels._fa3_kernel  # fetched once, before the Runner asks for it


def test_the_backends_of_a_machine_are_named_with_why_one_cannot_run(monkeypatch, fake_kernels):
    """What tools/gpu_check.sh prints: on the CPU sdpa only; on an A100 (8.0) flex and sdpa, fa3
    refused for its capability; on a Hopper with the kernel at hand, all three."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    here = tg.attention_backends_here()
    assert here["sdpa"] is None and "CPU" in here["flex"] and "Hopper" in here["fa3"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tg, "gpu_properties", lambda device: fake_gpu((8, 0)))
    monkeypatch.setattr(tg, "importable", lambda name: name == "kernels")
    assert tg.attention_backends_here()["flex"] == "needs triton (torch's CUDA builds bring it)"
    monkeypatch.setattr(tg, "importable", lambda name: name in ("kernels", "triton"))
    here = tg.attention_backends_here()
    assert here["flex"] is None and here["sdpa"] is None and here["fa3"].startswith("compute capability 8.0")
    monkeypatch.setattr(tg, "gpu_properties", lambda device: fake_gpu((9, 0)))
    assert tg.attention_backends_here() == dict(flex=None, sdpa=None, fa3=None)
    monkeypatch.setattr(tg, "gpu_properties", lambda device: fake_gpu((7, 5)))
    assert "8.0 or more" in tg.attention_backends_here()["flex"]
