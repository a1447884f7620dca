"""No host-device sync in a training step: every recipe's step, on the CPU path, calls none of the
operations that make the host wait for a GPU (a tensor's value read on the host: .item(), bool(),
float(), .tolist(); a data-dependent shape: nonzero; a tensor made from Python data, which on a
GPU is a blocking host-to-device copy), and the device branch of the FP8 product makes its scales
on the device.

Why the CPU path and not a faked CUDA device: torch's CPU build can fake CUDA tensors
(FakeTensorMode), but a training step on them stops at the first int index or .contiguous() of a
strided one ("PyTorch is not linked with support for cuda devices"). What only runs on CUDA is
checked on its own below: the FP8 product's _scaled_mm branch on the meta device, whose tensors,
like a GPU's, live away from the host. The Triton kernels' launches read shapes only."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCKS
from test_mudd_gate import SEVEN_BLOCK_GATES, SEVEN_BLOCKS, SEVEN_XSA

aten = torch.ops.aten
# reads of a tensor's value on the host, data-dependent shapes, tensors from Python data
SYNCING = {aten._local_scalar_dense.default: "a value read on the host (.item(), bool(), float())",
           aten.nonzero.default: "nonzero (a data-dependent shape)",
           aten.masked_select.default: "masked_select (a data-dependent shape)",
           aten.lift_fresh.default: "torch.tensor(data) (a host-to-device copy on a GPU)"}


class SyncRecorder(TorchDispatchMode):
    """Records each call of a syncing operation (and .tolist(), which no dispatch sees) with where
    in this project's code it was made."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.calls.append(f"{SYNCING[func]} at {caller()}")
        if func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0].device if func is aten.copy_.default else (kwargs or {}).get("device") or source.device
            if source.device.type == "cpu" and torch.device(target).type != "cpu":
                self.calls.append(f"a host-to-device copy at {caller()}")
        return func(*args, **(kwargs or {}))


def caller() -> str:
    import traceback
    frames = [f for f in traceback.extract_stack() if f.filename == tg.__file__]
    return f"train_gpt_medium.py:{frames[-1].lineno} ({frames[-1].name})" if frames else "(outside the trainer)"


@pytest.fixture
def recorder(monkeypatch):
    rec = SyncRecorder()
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: rec.calls.append(f".tolist() at {caller()}")
                        or real_tolist(t))
    return rec


# each recipe, and the FP8 MLP products (§17) alone and with §15's backward from post, each on its
# layout in miniature (a step's code per block is the same at any depth, and every kind of block is
# there): FOUR_BLOCKS for bulk's layout, SEVEN_BLOCKS for mudd's, and for transfer's with its XSA,
# gate and DC blocks
STEP_CONFIGS = {**{recipe: dict(recipe=recipe, **FOUR_BLOCKS) for recipe in ("bulk", "fp8_yarn", "bigram")},
                "mudd": dict(recipe="mudd", **SEVEN_BLOCKS),
                "transfer": dict(recipe="transfer", **SEVEN_BLOCKS, xsa_layers=SEVEN_XSA, **SEVEN_BLOCK_GATES),
                **{name: dict(**flags, **FOUR_BLOCKS) for name, flags in (
                    ("fp8_mlp_up", dict(fp8_mlp_up=True)),
                    ("fp8_mlp_up+from_post", dict(fp8_mlp_up=True, mlp_backward_from_post=True)),
                    ("fp8_mlp_down+from_post", dict(fp8_mlp_down=True, mlp_backward_from_post=True)))}}


@pytest.mark.parametrize("name", STEP_CONFIGS)
def test_a_training_step_reads_nothing_back_from_the_device(name, recorder, synthetic_dir):
    """Steps 0 and 1 (an even step leaves Adam's gradients waiting, an odd one steps Adam), each
    over its micro-batches: forward, backward, the gradient exchange, both optimizers, the schedules."""
    bytes_file = str(synthetic_dir / "synthetic_token_bytes.npy")  # the prefix table's (transfer)
    config = tg.make_config("tiny", dtype="float32", token_bytes_file=bytes_file, **STEP_CONFIGS[name])
    runner = tg.Runner(config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for step in (0, 1):
        batches = runner.random_batches(gen, tg.slice_tokens(step, config))
        with recorder:
            runner.train_step(step, batches)
    assert recorder.calls == []


def test_the_recorder_sees_each_kind_of_sync(recorder):
    """The check can fail: each syncing call is recorded."""
    x = torch.ones(3)
    with recorder:
        x.sum().item()
        bool(x.sum() > 0)
        x.nonzero()
        torch.tensor(2.0)
        x.tolist()
    assert [c.split(" at ")[0] for c in recorder.calls] == [
        SYNCING[aten._local_scalar_dense.default], SYNCING[aten._local_scalar_dense.default],
        SYNCING[aten.nonzero.default], SYNCING[aten.lift_fresh.default], ".tolist()"]


@pytest.mark.parametrize("transposed", [False, True])
def test_the_fp8_products_device_branch_makes_its_scales_on_the_device(transposed, recorder, monkeypatch):
    """torch._scaled_mm on meta tensors (it has a meta kernel): the scales are 0-d fp32 tensors of the
    operands' device, filled there, and the operands already in the layouts it takes are not copied.
    (A meta tensor made from Python data reaches no dispatch, so torch.tensor is watched itself.)"""
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: recorder.calls.append(f"torch.tensor at {caller()}")
                        or real_tensor(*a, **k))
    x8 = torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="meta")
    w8 = torch.empty((32, 96) if transposed else (96, 32), dtype=torch.float8_e4m3fn, device="meta")
    g8 = torch.empty(64, 96, dtype=torch.float8_e5m2, device="meta")
    with recorder:
        logits = kernels.scaled_mm(x8, w8 if transposed else w8.t(), 0.1, 0.01, torch.bfloat16, True)
        dw = (kernels.scaled_mm(x8.t(), g8.t().contiguous().t(), 0.1, 0.001, torch.float32, False) if transposed
              else kernels.scaled_mm(g8.t().contiguous(), x8, 0.001, 0.1, torch.float32, False))
    assert logits.shape == (64, 96) and dw.shape == ((32, 96) if transposed else (96, 32))
    assert recorder.calls == []
