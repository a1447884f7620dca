"""The bulk record's optimizers (docs/bulk-optimizers.md), each part against a reference written
here: Polar Express against a float64 loop, an SVD polar factor and Newton-Schulz (the same
polynomial with Newton-Schulz's coefficients); Muon's momentum, row normalization and cautious
step against plain float64 loops with the record's roundings; Muon with its switches at plain
Muon's settings against a plain loop of plain Muon; the cautious bf16 Adam against a plain-Python
loop of its formula; Adam on odd steps = one Adam step on the summed gradients; Muon sharded over
2 processes = 1 process; gradients held by a rank
until the odd step are reduced once; checkpoints of the new state; the accounting.

Rounding references: `f32`/`bf16` round a Python float (float64) the way a kernel that computes in
fp32 stores fp32/bf16 (round to nearest even); `fma32` rounds an exact a*b + c once to fp32
(`add32`: as this CPU's add with alpha does, fused on the CPUs with AVX2 or AVX512). The
references compute each operation exactly (or in float64) and round where the record's operation
stores its result, with its scalars in fp32, as PyTorch's CUDA kernels take them."""
import copy
import dataclasses
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCKS
from test_distributed import on_ranks
from test_muon import with_spectrum
from test_training import all_state, assert_same_state, runner_and_loader


# ---- rounding helpers for the references


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16(x: float) -> float:
    """x rounded to fp32, then to bf16 (nearest, ties to even), by bit arithmetic."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def fma32(a: float, b: float, c: float) -> float:
    """a*b + c computed exactly, rounded once to fp32 (nearest, ties to even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    x = np.float32(f32(float(exact)))
    candidates = [x, np.nextafter(x, np.float32(-np.inf)), np.nextafter(x, np.float32(np.inf))]
    return float(min(candidates, key=lambda y: (abs(Fraction(float(y)) - exact), int(y.view(np.uint32)) & 1)))


def add_with_alpha_is_fused() -> bool:
    """Whether torch's fp32 t.add_(other, alpha=a) on this CPU rounds t + a*other once, as CUDA's
    kernel does: aten's kernels built for a vector instruction set (AVX2, AVX512) use a fused
    multiply-add; its kernels without vectors (ATEN_CPU_CAPABILITY=default) round a*other first.
    Probed on a whole vector's worth: -1 + (1 + 2^-23)(1 - 2^-23) is -2^-46 fused, 0 rounded first."""
    t = torch.full((64,), -1.0)
    t.add_(torch.full((64,), 1 + 2**-23), alpha=1 - 2**-23)
    return bool((t == -2**-46).all())


ADD_IS_FUSED = add_with_alpha_is_fused()


def add32(a: float, b: float, c: float) -> float:
    """c + a*b in fp32 as this CPU's t.add_(b, alpha=a) stores it: fma32, or the product rounded first."""
    return fma32(a, b, c) if ADD_IS_FUSED else f32(f32(a * b) + c)


def elementwise(fn, *tensors) -> list:
    """fn applied to the Python floats of tensors, element by element (flattened)."""
    return [fn(*values) for values in zip(*(t.double().flatten().tolist() for t in tensors))]


def bf16_tensor(values, shape) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


# ---- Polar Express


def polar_express_loop(G: torch.Tensor, coeffs=tg.POLAR_EXPRESS_COEFFS, scale=1.02, eps=1e-6) -> torch.Tensor:
    """The record's iteration in float64, no rounding: transpose a tall matrix, divide by
    scale*|G|_F + eps, then X <- a X + (b A + c A A) X with A = X X^T."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.square().sum(dim=(-2, -1), keepdim=True).sqrt() * scale + eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(8, 16), (16, 8), (12, 12), (3, 8, 16)])
@pytest.mark.parametrize("split", [False, True])
def test_polar_express_in_float64_is_the_records_iteration(shape, split):
    """Run in float64 the only differences left are float64 roundings: measured 5.5e-15."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = tg.polar_express(G, dtype=torch.float64, split_last_product=split)
    assert (got - polar_express_loop(G)).abs().max() < 1e-12
    assert (got - polar_express_loop(G, scale=1.0)).abs().max() > 1e-3  # the 1.02 is in it


def polar_express_bf16_reference(G: torch.Tensor, coeffs, split: bool) -> torch.Tensor:
    """The record's bf16 iteration with every rounding where its operations store bf16: the
    cast, the norm, norm*1.02, +1e-6, the division, A = X X^T, B = b A + c A A^T (one rounding),
    a X + B X (one rounding; split: B X, then + a X, as this CPU's add with alpha rounds it: add32).
    Products and sums exact (float64) between roundings; scalars in fp32."""
    rnd = lambda t: t.float().bfloat16().double()
    s = lambda v: f32(v)
    X = rnd(G.double())
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    norm = rnd(X.square().sum(dim=(-2, -1), keepdim=True).sqrt())
    X = rnd(X / rnd(rnd(norm * s(1.02)) + s(1e-6)))
    for a, b, c in coeffs:
        A = rnd(X @ X.mT)
        B = rnd(s(b) * A + s(c) * (A @ A.mT))
        aX = s(a) * X if ADD_IS_FUSED else X.mul(s(a)).float().double()  # add_as_cuda_(BX, X, alpha=a)
        X = rnd(rnd(B @ X) + aX) if split else rnd(s(a) * X + B @ X)
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(8, 16), (16, 8), (32, 32), (2, 16, 32)])
@pytest.mark.parametrize("split", [False, True])
def test_polar_express_in_bf16_rounds_where_the_records_operations_round(shape, split):
    """bf16 matmuls accumulate in fp32 and round once; on these small shapes that equals the
    exact product rounded (measured: every element equal, 5 steps)."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = tg.polar_express(G, split_last_product=split)
    assert got.dtype == torch.bfloat16 and got.shape == G.shape
    want = polar_express_bf16_reference(G, tg.POLAR_EXPRESS_COEFFS, split)
    mismatched = (got.double() != want).float().mean().item()
    assert mismatched <= 0.002, mismatched
    # the roundings matter: rounding the linear coefficient to bf16 (what PyTorch's CPU add
    # would do with alpha=a) changes most elements
    rounded_a = tuple((float(torch.tensor(a).bfloat16()), b, c) for a, b, c in tg.POLAR_EXPRESS_COEFFS)
    assert (polar_express_bf16_reference(G, rounded_a, split) != want).float().mean() > 0.3


def test_polar_express_with_newton_schulz_coefficients_and_normalization_is_orthogonalize():
    """The identity: Newton-Schulz's coefficients, norm scale 1 and eps 1e-7 make Polar Express
    compute orthogonalize's polynomial. In fp32 only the roundings of the fused steps differ
    (measured max 6e-7). In bf16 every rounding is bf16's, and Polar Express normalizes after the
    cast where orthogonalize normalizes before it (measured mean |difference| 0.0012-0.0026,
    max 0.016). With its own coefficients Polar Express differs far more (fp32 max 0.034-0.070,
    bf16 mean 0.006-0.015)."""
    for shape, seed in [((64, 128), 0), ((128, 64), 1), ((96, 96), 2), ((4, 32, 32), 3)]:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        same32 = tg.polar_express(G, tg.NEWTON_SCHULZ_COEFFS, norm_scale=1.0, eps=1e-7, dtype=torch.float32)
        ns32 = tg.orthogonalize(G, torch.float32)
        assert (same32 - ns32).abs().max() < 1e-5
        assert (tg.polar_express(G, dtype=torch.float32) - ns32).abs().max() > 0.02
        same16 = tg.polar_express(G, tg.NEWTON_SCHULZ_COEFFS, norm_scale=1.0, eps=1e-7).float()
        ns16 = tg.orthogonalize(G).float()
        assert (same16 - ns16).abs().mean() < 0.004 and (same16 - ns16).abs().max() < 0.03
        assert (tg.polar_express(G).float() - ns16).abs().mean() > 0.005


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96)])
def test_polar_express_approximates_the_svd_polar_factor(shape):
    """Against U V^T from a float64 SVD, for singular values spanning a factor of 100: the five
    tuned steps leave every singular value in [0.857, 1.142] (measured, float64 and bf16; the
    band the coefficients are designed for) and entries within 0.041 of U V^T (bf16). Asserted:
    [0.84, 1.16] and 0.06."""
    for seed in range(3):
        G = with_spectrum(shape, kappa=100, seed=seed)
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        for dtype in (torch.bfloat16, torch.float64):
            X = tg.polar_express(G, dtype=dtype).double()
            s = torch.linalg.svdvals(X)
            assert s.min() > 0.84 and s.max() < 1.16, (dtype, s.min().item(), s.max().item())
        assert (tg.polar_express(G).double() - U @ Vh).abs().max() < 0.06


def test_polar_express_lifts_small_singular_values_further_than_newton_schulz():
    """What the tuned steps buy: with singular values spanning 1000, Newton-Schulz leaves the
    smallest at 0.14 and Polar Express at 0.31 (measured, bf16, 3 shapes x 5 seeds)."""
    pe, ns = [], []
    for shape in [(64, 128), (128, 64), (96, 96)]:
        for seed in range(5):
            G = with_spectrum(shape, kappa=1000, seed=seed)
            pe.append(torch.linalg.svdvals(tg.polar_express(G).double()).min().item())
            ns.append(torch.linalg.svdvals(tg.orthogonalize(G).double()).min().item())
    assert min(pe) > 0.25 and min(ns) < 0.2 and min(pe) > 1.5 * min(ns)


# ---- Muon's parts (NorMuon's, as the record runs it)


def test_momentum_of_a_bf16_buffer_is_the_bf16_lerp_with_python_float_weights():
    """The record's gate momentum: bf16 lerps with Python-float weights (here PyTorch's own bf16
    kernel, called as the record calls it). A tensor weight would be rounded to bf16 first."""
    gen = torch.Generator().manual_seed(0)
    grad, buf = (torch.randn(8, 16, generator=gen).bfloat16() for _ in range(2))
    m = 0.9123
    want_buf = buf.clone().lerp_(grad, 1 - m)
    want = grad.clone().lerp_(want_buf, m)
    mom, one_minus = torch.tensor(m), torch.tensor(1 - m)
    got = tg.nesterov_momentum(grad, buf, mom, one_minus)
    assert torch.equal(buf, want_buf) and torch.equal(got, want) and got.dtype == torch.bfloat16
    assert not torch.equal(grad.clone().lerp_(want_buf, mom), want)  # the trap the function avoids


def row_normalize_loop(update: torch.Tensor, state: torch.Tensor, beta2: float, reduce_dim: int):
    """NorMuon's row normalization of one matrix in float64: r_i = mean_j u_ij^2 (rows along
    reduce_dim), S <- S + (1 - beta2)(r - S), d_i = 1/sqrt(max(S_i, 1e-10)), then the rows scaled
    by d_i and the matrix by |u|_F / |diag(d) u|_F. Returns (new update, new S)."""
    u = update.double() if reduce_dim == -1 else update.double().mT
    S = state.double().flatten().tolist()
    rows = u.tolist()
    r = [sum(x * x for x in row) / len(row) for row in rows]
    S = [s + (1 - beta2) * (ri - s) for s, ri in zip(S, r)]
    d = [1 / math.sqrt(max(s, 1e-10)) for s in S]
    norm = math.sqrt(sum(x * x for row in rows for x in row))
    scaled_norm = math.sqrt(sum((di * x) ** 2 for di, row in zip(d, rows) for x in row))
    out = torch.tensor([[di * norm / scaled_norm * x for x in row] for di, row in zip(d, rows)], dtype=torch.float64)
    return (out if reduce_dim == -1 else out.mT), torch.tensor(S, dtype=torch.float64)


@pytest.mark.parametrize("shape,reduce_dim", [((16, 8), -1), ((8, 32), -2), ((8, 8), -1)])
def test_row_normalization_of_an_fp32_update_matches_a_float64_loop(shape, reduce_dim):
    gen = torch.Generator().manual_seed(2)
    state_shape = (shape[0], 1) if reduce_dim == -1 else (1, shape[1])
    state = torch.rand(state_shape, generator=gen) * 1e-2
    for step in range(2):
        update = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)  # uneven rows
        want, want_state = row_normalize_loop(update, state, 0.95, reduce_dim)
        got = tg.normuon_row_normalize(update.clone(), state, 0.95, reduce_dim)
        assert torch.allclose(got.double(), want, rtol=2e-6, atol=0)
        assert torch.allclose(state.double().flatten(), want_state, rtol=2e-6, atol=0)
        assert got.norm().item() == pytest.approx(update.norm().item(), rel=1e-5)


def test_row_normalization_from_zero_state_gives_every_row_the_same_rms():
    """S starts at 0, so after the first step S_i = 0.05 r_i and every row's mean square
    becomes r_i / (0.05 r_i) scaled back to the matrix's norm: all rows equal."""
    update = torch.randn(32, 16, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 1, 32)[:, None]
    got = tg.normuon_row_normalize(update.clone(), torch.zeros(32, 1), 0.95, -1)
    rms = got.square().mean(dim=1).sqrt()
    assert (rms.max() / rms.min()).item() == pytest.approx(1.0, abs=1e-5)
    assert got.norm().item() == pytest.approx(update.norm().item(), rel=1e-5)


def test_row_normalization_of_a_bf16_gate_update_keeps_a_bf16_statistic():
    """The record's gates: a bf16 update and a bf16 running statistic S, checked exactly: the
    loop's lerp with each step rounded to bf16 (r rounded to bf16 first). The row factor
    1/sqrt(S) is a bf16 result, the norms fp32, the final scale and the product bf16. The fp32
    reciprocal square root is not always correctly rounded (CUDA's rsqrtf is approximate), and one
    row factor one bf16 step off would move the norm ratio of the whole matrix. Asserted: S exact,
    the update within 2^-6 relative (two ulps) and almost every entry exact (measured: all; with
    the CPU's own bf16 rsqrt of the 8 statistics, 75% in one step)."""
    gen = torch.Generator().manual_seed(4)
    state = torch.zeros(8, 1, dtype=torch.bfloat16)
    S = [0.0] * 8
    for step in range(3):
        update = (torch.randn(8, 16, generator=gen) * torch.rand(8, 1, generator=gen)).bfloat16()
        rows = update.double().tolist()
        r = [sum(x * x for x in row) / len(row) for row in rows]
        S = [bf16(fma32(f32(1 - 0.95), bf16(ri) - s, s)) for ri, s in zip(r, S)]
        d = [bf16(1 / math.sqrt(max(s, 1e-10))) for s in S]
        norm = f32(math.sqrt(f32(sum(r) * 16)))
        scaled_norm = f32(math.sqrt(f32(sum(16 * ri * di * di for ri, di in zip(r, d)))))
        ratio = f32(norm / scaled_norm)
        want = torch.tensor([[bf16(x * bf16(di * ratio)) for x in row] for di, row in zip(d, rows)],
                            dtype=torch.float64)
        got = tg.normuon_row_normalize(update.clone(), state, 0.95, -1)
        assert state.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
        assert state.flatten().double().tolist() == S
        assert ((got.double() - want).abs() <= want.abs() * 2**-6).all()
        assert (got.double() == want).float().mean() >= 0.95


def test_a_gates_row_factors_are_the_fp32_reciprocal_square_root_rounded_once():
    """A gate's statistic has one value per head, too few to fill a vector register: PyTorch's CPU
    kernel computes such a bf16 tensor's rsqrt in bf16 arithmetic (a quarter of its results one
    step off), CUDA's in fp32. as_cuda.rsqrt_, which the row normalization uses, computes in fp32
    and rounds once: against 1/sqrt in float64 rounded to fp32 and then to bf16, as CUDA stores it
    (allowed: one result one step off, where fp32's own rounding of 1/sqrt sits on a bf16 tie)."""
    x = (torch.rand(4096, generator=torch.Generator().manual_seed(12)) * 0.05 + 1e-6).bfloat16()
    want = (1 / x.double().sqrt()).float().bfloat16()
    got = torch.cat([kernels.as_cuda.rsqrt_(x[i:i + 2].clone()) for i in range(0, x.numel(), 2)])  # (H, 1), H = 2
    off = (got != want).nonzero().flatten()
    assert off.numel() <= 1
    assert ((got[off].double() - want[off].double()).abs() <= want[off].double().abs() * 2**-7).all()



@pytest.mark.parametrize("has_bf16_gemm", [True, False], ids=["torch_bf16_product", "fp32_product_rounded"])
@pytest.mark.parametrize("batched", [False, True])
def test_bf16_products_sum_in_fp32_and_round_once_on_either_cpu_route(monkeypatch, has_bf16_gemm, batched):
    """as_cuda.addmm / matmul in bf16 (Polar Express's products): beta t + alpha (a @ b) with the
    scalars in fp32, summed in fp32 and rounded once to bf16, as cuBLAS computes it, whichever route
    the CPU takes (torch's bf16 product where oneDNN has one, else the fp32 product of the same
    values). Against the exact value (float64: bf16 inputs, their products and these sums are
    exact there): an fp32 sum of n terms is within n 2^-24 of sum |term| of it (Higham's gamma_n),
    and rounding is monotonic: each result lies between the two ends' roundings to bf16 (the
    same value for most elements)."""
    monkeypatch.setattr(kernels, "cpu_has_bf16_gemm", lambda: has_bf16_gemm)
    gen = torch.Generator().manual_seed(13)
    lead = (3,) if batched else ()
    t, a, b = (torch.randn(*lead, *shape, generator=gen).bfloat16() for shape in ((64, 256), (64, 64), (64, 256)))
    beta, alpha = 3.8916678022926607, -2.772484153217685  # a Polar Express step's a and b
    beta32, alpha32 = f32(beta), f32(alpha)
    exact = beta32 * t.double() + alpha32 * (a.double() @ b.double())
    bound = (a.size(-1) + 2) * 2.0**-24 * (abs(beta32) * t.double().abs() + abs(alpha32) * (a.double().abs() @ b.double().abs()))
    low, high = ((exact - bound).bfloat16(), (exact + bound).bfloat16())  # float64 -> bf16 rounds monotonically
    got = kernels.as_cuda.addmm(t, a, b, beta=beta, alpha=alpha)
    assert got.dtype == torch.bfloat16 and got.shape == t.shape
    assert ((low <= got) & (got <= high)).all()
    assert (low == high).float().mean() > 0.5  # not vacuous: the interval pins most elements to one value
    product = kernels.as_cuda.matmul(a, b)
    exact_product, product_bound = a.double() @ b.double(), a.size(-1) * 2.0**-24 * (a.double().abs() @ b.double().abs())
    assert (((exact_product - product_bound).bfloat16() <= product) & (product <= (exact_product + product_bound).bfloat16())).all()

def cautious_loop(weight: torch.Tensor, update: torch.Tensor, wd_factor: float, lr_factor: float) -> torch.Tensor:
    """The record's compiled cautious step element by element: every operation in fp32 with the
    fp32 factors (mask = update*w >= 0; (w - ((w*mask)*wd)*lr) - update*lr), rounded once to the
    weight's dtype at the end, as the compiler's fused kernel computes it on the GPU (a bf16 update
    or gate weight widened as loaded, the factors' cast to a gate's bf16 dropped)."""
    w_round = bf16 if weight.dtype == torch.bfloat16 else f32

    def one(w, u):
        keep = 1.0 if f32(u * w) >= 0 else 0.0  # a negative product that underflows is -0.0: kept
        decay = f32(f32(f32(w * keep) * wd_factor) * lr_factor)
        return w_round(f32(f32(w - decay) - f32(u * lr_factor)))
    return bf16_tensor(elementwise(one, weight, update), weight.shape)


def cautious_case(weight_dtype, update_dtype, seed=5):
    """A weight, an update and the two fp32 factors, with zeros in weight and update to test the
    mask's >= (zero products are decayed: nothing to decay)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, 16, generator=gen).to(weight_dtype)
    update = torch.randn(16, 16, generator=gen).to(update_dtype)
    weight[0, :4], update[1, :4] = 0, 0
    return weight, update, torch.tensor(f32(1.2 * 0.03)), torch.tensor(f32(0.06))


CAUTIOUS_DTYPES = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


@pytest.mark.parametrize("weight_dtype, update_dtype", CAUTIOUS_DTYPES)
def test_cautious_step_matches_the_loop_bit_for_bit(weight_dtype, update_dtype):
    """fp32 weights (the record's blocks, a bf16 matrix's master) and bf16 gates, each with Polar
    Express's bf16 update; fp32 weight and update (Newton-Schulz in fp32). Uncompiled PyTorch would
    round a bf16 update times an fp32 0-d factor to bf16 (and each of a gate's products): on these
    entries 94% of the fp32 results and 28% of the bf16 ones would differ."""
    weight, update, wd_factor, lr_factor = cautious_case(weight_dtype, update_dtype)
    want = cautious_loop(weight, update, wd_factor.item(), lr_factor.item())
    tg.cautious_step(weight, update, wd_factor, lr_factor)
    assert weight.dtype == weight_dtype and torch.equal(weight.double(), want)


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="torch 2.13's CPU compiler builds this kernel wrongly for AVX2 (half the entries come "
                           "out as garbage, measured under ATEN_CPU_CAPABILITY=avx2): the compiled side is no "
                           "reference there; the uncompiled step is still checked against its fp32 formula")
@pytest.mark.parametrize("weight_dtype, update_dtype", CAUTIOUS_DTYPES)
def test_cautious_step_uncompiled_equals_its_compiled_step_bit_for_bit(weight_dtype, update_dtype):
    """The CPU runs the cautious step uncompiled and a GPU compiled (Muon's compile_update): the
    CPU's compiler fuses the chain as the GPU's does (fp32 intermediates, one rounding; it contracts
    no multiply-add, so the bits can be compared), and the uncompiled step must compute the same.
    On AVX512 CPUs only (the skip says why)."""
    weight, update, wd_factor, lr_factor = cautious_case(weight_dtype, update_dtype, seed=7)
    eager, compiled = weight.clone(), weight.clone()
    tg.cautious_step(eager, update, wd_factor, lr_factor)
    tg.compiled(tg.cautious_step, fullgraph=True)(compiled, update, wd_factor, lr_factor)
    assert not torch.equal(eager, weight)  # the step moved the weights
    assert torch.equal(eager.view(torch.int16 if weight_dtype == torch.bfloat16 else torch.int32),
                       compiled.view(torch.int16 if weight_dtype == torch.bfloat16 else torch.int32))


def test_cautious_decay_applies_only_where_update_and_weight_agree_in_sign():
    """All agree (w = 2u): the step is plain decoupled decay w - lr*u - wd*lr*w on every entry;
    the entries where they disagree only take the step, the others decay too."""
    gen = torch.Generator().manual_seed(6)
    update = torch.randn(32, 8, generator=gen)
    wd, lr = 0.5, 0.1
    weight = 2 * update
    plain = weight.double() - lr * update.double() - wd * lr * weight.double()
    w = weight.clone()
    tg.cautious_step(w, update, torch.tensor(wd), torch.tensor(lr))
    assert torch.allclose(w.double(), plain, rtol=1e-6, atol=1e-7)
    flip = torch.rand(32, 8, generator=gen) < 0.5
    weight = torch.where(flip, -weight, weight)
    w = weight.clone()
    tg.cautious_step(w, update, torch.tensor(wd), torch.tensor(lr))
    want = weight.double() - lr * update.double() - torch.where(flip, 0.0, wd * lr) * weight.double()
    assert torch.allclose(w.double(), want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(w.double(), weight.double() - lr * update.double() - wd * lr * weight.double(),
                              rtol=1e-3)


# ---- Muon, the optimizer

PLAIN_MUON = dict(orthogonalization="newton_schulz", row_normalization=False, cautious_weight_decay=False,
                  lr_shape="blocks")


def matrices(dtype, seed=0) -> list[torch.nn.Parameter]:
    """A merged attention weight (4 blocks), an MLP pair (the output one stored transposed, lr_mul 2),
    and two gates (lr_mul 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    attn = torch.nn.Parameter((torch.randn(4, 16, 16, generator=gen) * 0.1).to(dtype))
    fc, proj = (torch.nn.Parameter((torch.randn(64, 16, generator=gen) * 0.1).to(dtype)) for _ in range(2))
    proj.lr_mul = 2.0
    gates = [torch.nn.Parameter((torch.randn(8, 16, generator=gen) * 0.1).to(dtype)) for _ in range(2)]
    for g in gates:
        g.lr_mul = 0.1
    return [attn, fc, proj, *gates]


def groups_of(params) -> list[dict]:
    attn, fc, proj, *gates = params
    return [dict(params=[attn], name="muon_attn", wd_mul=1.0, blocks=4),
            dict(params=[fc, proj], name="muon_mlp", wd_mul=1.0, split_last_product=True),
            dict(params=gates, name="muon_gates", wd_mul=1.0, gate=True)]


def set_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def run_optimizer(make, params, steps=3):
    opt = make(groups_of(params))
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    index = {p: i for i, p in enumerate(params)}
    return opt, [p.detach().clone() for p in params], {index[p]: s for p, s in opt.state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_muon_at_plain_muons_settings_is_a_plain_loop_of_muon_bit_for_bit(dtype):
    """Newton-Schulz, no row normalization, decoupled decay, the lr factor of each block: Muon's
    parameters, momentum and low bits against plain Muon written out here matrix by matrix with the
    same fp32 primitives (so the same roundings): b <- lerp(b, g, 1-m); u = orthogonalize(lerp(g, b, m))
    of each block, iterating in the weight's dtype; w <- w * (1 - lr*wd*wd_mul), then
    w - lr*lr_mul*sqrt(max(1, rows/cols)) u in one fused multiply-add on the fp32 master (a bf16
    weight's: its bits and low bits). The attention's blocks are 16 x 16 (factor 1; its stored
    64 x 16 would give 2); the MLP group has wd_mul 2. Gates excluded: Muon keeps those in their
    own dtype, without a master (tested below with the record's settings)."""
    lr, m, wd = 0.02, 0.9, 0.01
    params = matrices(dtype)
    groups = groups_of(params)[:2]
    groups[1]["wd_mul"] = 2.0
    opt = tg.Muon(groups, lr=lr, momentum=m, weight_decay=wd, **PLAIN_MUON)
    plan = {0: ((4, 16, 16), 1.0, 1.0), 1: ((64, 16), 1.0, 2.0), 2: ((64, 16), 2.0, 2.0)}  # blocks, lr_mul, wd_mul
    master = {i: params[i].detach().float().reshape(shape).clone() for i, (shape, _, _) in plan.items()}
    buf = {i: torch.zeros(shape) for i, (shape, _, _) in plan.items()}
    for step in range(3):
        set_grads(params, step)
        opt.step()
        for i, (shape, lr_mul, wd_mul) in plan.items():
            g = params[i].grad.float().reshape(shape)
            buf[i] = torch.lerp(buf[i], g, 1 - m)
            u = tg.orthogonalize(torch.lerp(g, buf[i], m), dtype)
            step_size = -lr * lr_mul * math.sqrt(max(1.0, shape[-2] / shape[-1]))
            master[i] = (master[i] * (1 - lr * wd * wd_mul)).add(u.float(), alpha=step_size)
            state, weight = opt.state[params[i]], params[i].detach()
            assert set(state) == ({"momentum_buffer", "low_bits"} if dtype == torch.bfloat16 else {"momentum_buffer"})
            got = tg.fp32_from_halves(weight, state["low_bits"]) if dtype == torch.bfloat16 else weight
            assert torch.equal(got.reshape(shape).view(torch.int32), master[i].view(torch.int32)), (step, i)
            assert torch.equal(state["momentum_buffer"].reshape(shape), buf[i]), (step, i)
    assert not torch.equal(params[0], matrices(dtype)[0])  # the steps did move the weights


def test_muon_lr_and_decay_factors_are_the_records_fp32_products():
    """lr_factor = lr * lr_mul * sqrt(max(1, rows/cols)) and wd_factor = wd_mul * wd * lr, each
    product rounded to fp32. Stored shape: the (4, 16, 16) attention counts as 64 x 16 (factor 2),
    fc 64 x 16 (2), proj stored transposed 64 x 16 with lr_mul 2 (4), gates 8 x 16 with lr_mul 0.1
    (0.1). Each block: attention 16 x 16 (1)."""
    lr, params = 0.015 * 1.73, matrices(torch.float32)
    for lr_shape, factors in [("stored", [2.0, 2.0, 4.0, 0.1]), ("blocks", [1.0, 2.0, 4.0, 0.1])]:
        opt = tg.Muon(groups_of(params), lr=0.015, momentum=0.95, weight_decay=1.2, lr_shape=lr_shape)
        got = {}
        for group, scalars in zip(opt.param_groups, opt.scalars):
            group["lr"], group["momentum"] = lr, 0.95
            opt._fill_scalars(group, scalars)
            for p in group["params"]:
                got[id(p)] = (scalars["lr_factor"].item(), scalars["wd_factor"].item())
        for p, factor in zip([params[0], params[1], params[2], params[3]], factors):
            assert got[id(p)] == (f32(f32(factor) * f32(lr)), f32(f32(f32(1.0) * f32(1.2)) * f32(lr))), lr_shape


def test_muon_step_of_a_gate_and_a_matrix_equals_the_records_steps_composed():
    """Two steps of every part, against the record's sequence built from the references above:
    momentum (bf16 for the gate: the bf16 lerps with Python floats), Polar Express, the row
    normalization, the cautious loop with the fp32 factors. Gates: bf16 state, no low bits."""
    params = matrices(torch.float32)
    params[3:] = [torch.nn.Parameter(g.detach().bfloat16()) for g in params[3:]]
    for g in params[3:]:
        g.lr_mul = 0.1
    reference = [p.detach().clone() for p in params]
    ref_state = {i: dict(buf=torch.zeros_like(p), rows=None) for i, p in enumerate(params)}
    opt = tg.Muon(groups_of(params), lr=0.015, momentum=0.95, weight_decay=1.2)
    lr, m = 0.015 * 1.52, 0.87
    shapes = {0: 2.0, 1: 2.0, 2: 4.0, 3: 0.1, 4: 0.1}
    for step in range(2):
        set_grads(params, step)
        for group in opt.param_groups:
            group["lr"], group["momentum"] = lr, m
        for i, p in enumerate(params):
            st = ref_state[i]
            grad = p.grad.clone()
            st["buf"].lerp_(grad, 1 - m)  # the record's lines, in the gradient's dtype
            g = grad.lerp_(st["buf"], m)
            g = g.view(4, 16, 16) if i == 0 else g
            U = tg.polar_express(g, split_last_product=i in (1, 2))
            if st["rows"] is None:
                st["rows"] = torch.zeros(*U.shape[:-1], 1, dtype=p.dtype if i >= 3 else torch.float32)
            U = tg.normuon_row_normalize(U, st["rows"], 0.95, -1)
            w = reference[i].view(U.shape)
            new = cautious_loop(w, U, f32(f32(f32(1.0) * f32(1.2)) * f32(lr)), f32(f32(shapes[i]) * f32(lr)))
            reference[i] = new.to(p.dtype).view(p.shape)
        opt.step()
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), reference[i]), i
        assert torch.equal(opt.state[p]["row_mean_square"].flatten(), ref_state[i]["rows"].flatten()), i
    assert {opt.state[g]["momentum_buffer"].dtype for g in params[3:]} == {torch.bfloat16}
    assert {opt.state[g]["row_mean_square"].dtype for g in params[3:]} == {torch.bfloat16}
    assert not any("low_bits" in opt.state[g] for g in params[3:])
    assert opt.state[params[0]]["row_mean_square"].shape == (4, 16, 1)  # one value per stored row


def test_muon_keeps_the_fp32_master_of_bf16_matrices_but_not_of_gates():
    params = matrices(torch.bfloat16)
    opt = tg.Muon(groups_of(params), lr=0.015, momentum=0.95, weight_decay=1.2)
    assert all("low_bits" in opt.state[p] and opt.state[p]["momentum_buffer"].dtype == torch.float32
               for p in params[:3])
    assert all("low_bits" not in opt.state[p] for p in params[3:])


# Muon sharded over processes: groups of 1 (attention), 2 (fc, proj: one each, split by lr_mul)
# and 3 gates, plus a second attention so that one group has fewer matrices than processes.
def sharded_params():
    params = matrices(torch.float32, seed=7)
    extra = torch.nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(8)).bfloat16())
    extra.lr_mul = 0.1
    return params + [extra]


def run_muon(rank: int = 0, world_size: int = 1):
    params = sharded_params()
    params[3:] = [torch.nn.Parameter(g.detach().bfloat16()) for g in params[3:]]
    for g in params[3:]:
        g.lr_mul = 0.1
    attn, fc, proj, *gates = params
    groups = [dict(params=[attn], name="muon_attn", blocks=4),
              dict(params=[fc, proj], name="muon_mlp", split_last_product=True),
              dict(params=gates, name="muon_gates", gate=True)]
    opt = tg.Muon(groups, lr=0.015, momentum=0.95, weight_decay=1.2, rank=rank, world_size=world_size)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    index = {p: i for i, p in enumerate(params)}
    return [p.detach().clone() for p in params], {index[p]: s for p, s in opt.state.items()}


def on_two_ranks(rank: int, world_size: int):
    """Both of this file's jobs for a gloo group (run_muon, then run_held_gradients): one group of
    processes serves both tests (each process's start, an import of torch, costs more than its job)."""
    return run_muon(rank, world_size), run_held_gradients(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's (run_muon, run_held_gradients) of one 2-process gloo group, by rank."""
    return on_ranks(on_two_ranks, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.slow
def test_muon_sharded_over_two_processes_equals_one_process_bit_for_bit(two_ranks):
    results = [muon for muon, _ in two_ranks]
    want_params, want_state = run_muon()
    owners = {}
    for rank, (params, state) in enumerate(results):
        for i, (got, want) in enumerate(zip(params, want_params)):
            assert torch.equal(got, want), f"rank {rank}, matrix {i}"
        for i, s in state.items():
            owners.setdefault(i, []).append(rank)
            assert_same_state(s, want_state[i])
    assert sorted(owners) == list(range(6)) and all(len(r) == 1 for r in owners.values())
    assert set(owners[i][0] for i in (3, 4, 5)) == {0, 1}  # the gates are shared out


# ---- the cautious bf16 Adam


def adam_loop(p: torch.Tensor, grads: list[torch.Tensor], lr: float, betas, eps: float, wd: float, wd_mul: float):
    """The record's Adam element by element over several steps: moments in the weight's dtype
    (the record's timed run: see the dtype test below), eps added to sqrt(v), the bias corrections
    in the step size, cautious decay lr^2 * wd * wd_mul where the update and the weight agree in
    sign (strictly), each operation rounded as its kernel stores it (scalars fp32; a*b + c in one
    rounding where the kernel's expression is that and this CPU's kernel fuses it: add32). The
    square roots are torch's fp32 ones of the whole vector (its vectorized fp32 sqrt is not always
    correctly rounded on every CPU)."""
    b1, b2 = betas
    r = bf16 if p.dtype == torch.bfloat16 else f32  # the weight's, the moments' and the update's rounding
    weights, m, v = p.double().flatten().tolist(), [0.0] * p.numel(), [0.0] * p.numel()
    for t, grad in enumerate(grads, start=1):
        step_size = f32(lr * ((1 - b2 ** t) ** 0.5 / (1 - b1 ** t)))
        decay = f32(lr * wd * wd_mul * lr)
        for j, g in enumerate(grad.double().flatten().tolist()):
            m[j] = r(add32(f32(1 - b1), g, r(m[j] * f32(b1))))
            v[j] = r(add32(f32(1 - b2), f32(g * g), r(v[j] * f32(b2))))
        roots = torch.tensor(v, dtype=torch.float32).sqrt().tolist()
        for j in range(len(v)):
            denom = r(r(roots[j]) + f32(eps))
            u = r(r(m[j] / denom) * step_size)
            same_sign = u * weights[j] > 0
            u = r(add32(decay, weights[j] if same_sign else 0.0, u))
            weights[j] = r(weights[j] - u)
    return torch.tensor(weights, dtype=torch.float64).reshape(p.shape), m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cautious_adam_matches_a_plain_python_loop_of_the_records_formula(dtype):
    """Three steps with lr_mul 75 and wd_mul 5 (the record's value embeddings); some gradients
    are tiny (where eps decides the step) and some weights zero (no decay: the mask is strict)."""
    gen = torch.Generator().manual_seed(9)
    p = torch.nn.Parameter((torch.randn(6, 16, generator=gen) * 0.5).to(dtype))
    p.data[0, :5] = 0
    p.lr_mul, p.wd_mul = 75.0, 5.0
    grads = []
    for _ in range(3):
        g = torch.randn(6, 16, generator=gen) * 30  # a token-sum loss: large gradients
        g[1] *= 1e-9
        grads.append(g.to(dtype))
    want, m, v = adam_loop(p.detach(), grads, lr=0.004 * 1.73 * 75, betas=(0.8, 0.95), eps=1e-8, wd=0.005, wd_mul=5.0)
    opt = tg.CautiousAdam([dict(params=[p])], lr=0.004 * 1.73, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.005)
    for g in grads:
        p.grad = g
        opt.step()
    assert torch.equal(p.detach().double(), want)
    state = opt.state[p]
    assert state["step"] == 3 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
    assert state["exp_avg"].double().flatten().tolist() == m and state["exp_avg_sq"].double().flatten().tolist() == v


def test_cautious_adam_moments_have_the_dtypes_the_records_warmup_restore_leaves():
    """The record's Adam creates bf16 moments for every weight, but its timed run starts after its
    warm-up put the initial optimizer state back with load_state_dict, which casts each state
    tensor to its weight's dtype. Here that round trip is done on an optimizer holding bf16
    moments for the bulk model's Adam weights (bf16 tables, head and gates; fp32 scalars, backout
    weight and x0 weights): the cautious Adam's moments must have the dtypes it leaves."""
    config = tg.make_config("tiny", dtype="bfloat16")
    model = tg.build_model(config)
    adam = tg.build_optimizers(model, config, 0, 1)[0]
    params = [p for g in adam.param_groups for p in g["params"]]

    class BF16Moments(torch.optim.Optimizer):  # the record's construction: bf16 whatever the weight
        def __init__(self, params):
            super().__init__(params, {})
            for p in params:
                moment = torch.zeros_like(p, dtype=torch.bfloat16)
                self.state[p] = dict(step=0, exp_avg=moment, exp_avg_sq=torch.zeros_like(moment))

    record_like = BF16Moments(params)
    record_like.load_state_dict(copy.deepcopy(record_like.state_dict()))  # the record's warm-up restore
    names = {p: n for n, p in model.named_parameters()}
    want = {names[p]: (s["exp_avg"].dtype, s["exp_avg_sq"].dtype) for p, s in record_like.state.items()}
    got = {names[p]: (adam.state[p]["exp_avg"].dtype, adam.state[p]["exp_avg_sq"].dtype) for p in params}
    assert got == want
    assert want["scalars"] == want["x0_lambdas"] == want["backout.weight"] == (torch.float32, torch.float32)
    assert want["head.weight"] == want["value_embeds.tables.0.weight"] == (torch.bfloat16, torch.bfloat16)


def test_cautious_adam_puts_eps_inside_the_bias_correction():
    """One step on gradients of 1e-9 (sqrt(v) ~ eps): the record's u = lr*sqrt(1-b2)/(1-b1) *
    m/(sqrt(v)+eps) is much smaller than with eps outside (lr * m_hat / (sqrt(v_hat) + eps))."""
    p = torch.nn.Parameter(torch.zeros(64))
    p.grad = torch.full((64,), 1e-9)
    tg.CautiousAdam([dict(params=[p])], lr=1.0, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0).step()
    m, v = bf16(0.2 * 1e-9), bf16(bf16(f32(0.05) * f32(1e-18)))
    inside = math.sqrt(0.05) / 0.2 * m / (math.sqrt(v) + 1e-8)
    outside = (m / 0.2) / (math.sqrt(v / 0.05) + 1e-8)
    assert -p[0].item() == pytest.approx(inside, rel=2e-2)
    assert outside > 2 * inside


def test_cautious_adam_skips_parameters_without_a_gradient():
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = tg.CautiousAdam([dict(params=[p, q])], lr=0.1, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0)
    p.grad = torch.ones(4)
    opt.step()
    assert opt.state[q]["step"] == 0 and torch.equal(q.detach(), torch.ones(4))
    assert opt.state[p]["step"] == 1 and not torch.equal(p.detach(), torch.ones(4))


# ---- Adam on odd steps only, in the training step


def tiny(**overrides) -> tg.Hyperparameters:
    return tg.make_config("tiny", dtype="float32", warmup_steps=0, **overrides)


def random_step(runner: tg.Runner, seed: int):
    return runner.random_batches(torch.Generator().manual_seed(seed))


def test_on_an_even_step_adam_waits_and_its_gradients_stay():
    """On four blocks (FOUR_BLOCKS: which optimizer waits does not depend on the depth)."""
    runner = tg.Runner(tiny(adam_odd_steps_only=True, **FOUR_BLOCKS), torch.device("cpu"))
    adam, muon = runner.optimizers
    adam_params = [p for g in adam.param_groups for p in g["params"]]
    muon_params = [p for g in muon.param_groups for p in g["params"]]
    before = all_state(runner)
    runner.train_step(0, random_step(runner, 0))
    after = all_state(runner)
    names = {p: n for n, p in runner.model.named_parameters()}
    unread = runner.model.embeds[0].weight  # the input table: the head stands in for it until the split
    assert runner.model.embed_tied and unread.grad is None
    for p in adam_params:
        assert torch.equal(after[f"param/{names[p]}"], before[f"param/{names[p]}"])
        assert p is unread or p.grad is not None
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(before[k])) for k, v in after.items()
                   if k.startswith(f"opt0/{names[p]}/"))
    assert all(p.grad is None for p in muon_params)
    assert any(not torch.equal(after[f"param/{names[p]}"], before[f"param/{names[p]}"]) for p in muon_params)
    assert runner.model.head.weight.grad.abs().sum() > 0  # the head (also the input table) has a gradient to wait with
    runner.train_step(1, random_step(runner, 1))
    assert all(p.grad is None for p in runner.model.parameters())
    assert not torch.equal(runner.model.head.weight, before["param/head.weight"])


def test_adam_on_odd_steps_equals_one_adam_step_on_the_two_steps_summed_gradients():
    """The reference steps Muon at steps 0 and 1 and Adam once at step 1, on gradient(step 0) +
    gradient(step 1) added by hand (the step's multi-token loss, the tied head as input table; the
    unread input table has no gradient). One micro-step per step (1024-token slices, the batch
    ramp's largest step), so the sums are the same two terms. On four blocks (FOUR_BLOCKS: a
    bit-for-bit equality that does not depend on the depth)."""
    config = tiny(batch_slices=1, train_seq_len=1024, adam_odd_steps_only=True, **FOUR_BLOCKS)
    runner = tg.Runner(config, torch.device("cpu"))
    reference = tg.Runner(dataclasses.replace(config, adam_odd_steps_only=False), torch.device("cpu"))
    adam, muon = reference.optimizers
    adam_params = [p for g in adam.param_groups for p in g["params"]]
    waiting = {}
    for step in (0, 1):
        batches = random_step(runner, step)
        runner.train_step(step, batches)
        (inputs, targets), = batches
        reference.set_embedding_tie(step)
        mtp = reference.mtp_input(tg.multi_token_weights(step, config))
        reference.forward(inputs, targets, reference.window(step), mtp_weights=mtp).backward()
        tg.set_schedules(reference.optimizers, step, config)
        if step == 0:
            waiting = {p: p.grad.clone() for p in adam_params if p.grad is not None}
        else:
            assert waiting.keys() == {p for p in adam_params if p.grad is not None}
            for p in waiting:
                p.grad = waiting[p] + p.grad
            adam.step()
        muon.step()
        reference.model.zero_grad(set_to_none=True)
    assert_same_state(all_state(runner), all_state(reference))


def test_the_warmup_leaves_no_gradient_waiting_for_adam():
    """Three warm-up steps end on an even step, whose Adam gradients wait: the restore drops them.
    On four blocks (FOUR_BLOCKS: the restore does not depend on the depth)."""
    config = tg.make_config("tiny", dtype="float32", warmup_steps=3, adam_odd_steps_only=True, **FOUR_BLOCKS)
    warmed, fresh = tg.Runner(config, torch.device("cpu")), tg.Runner(config, torch.device("cpu"))
    warmed.warmup()
    assert all(p.grad is None for p in warmed.model.parameters())
    assert_same_state(all_state(warmed), all_state(fresh))


def run_held_gradients(rank: int, world_size: int):
    """A Linear(4, 3) on each rank: step 0 holds the weight's gradient (the bias is reduced), step 1
    reduces everything; returns both gradients after each step, as train_step leaves them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    exchange = tg.GradientExchange([dict(params=list(model.parameters()), name="linear")], [], rank, world_size,
                                   tg.Collectives(world_size, rank))
    data = torch.randn(world_size, 2, 5, 4, generator=torch.Generator().manual_seed(1))
    seen = []
    for step in (0, 1):
        exchange.held = frozenset([model.weight]) if step == 0 else frozenset()
        exchange.armed = True
        model(data[rank, step]).square().sum().backward()
        exchange.wait()
        seen.append((model.weight.grad.clone(), model.bias.grad.clone()))
        model.bias.grad = None
    return seen


@pytest.mark.slow
def test_held_gradients_are_summed_on_each_rank_and_reduced_once(two_ranks):
    """The record's order: on the odd step each rank's own two gradients are added, then the sum
    over ranks is taken once (two processes: the exact sums, bit for bit)."""
    results = [held for _, held in two_ranks]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    data = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(1))

    def local(rank, step):
        model.zero_grad(set_to_none=True)
        model(data[rank, step]).square().sum().backward()
        return model.weight.grad.clone(), model.bias.grad.clone()
    g = {(r, s): local(r, s) for r in range(2) for s in range(2)}
    for rank, ((w0, b0), (w1, b1)) in enumerate(results):
        assert torch.equal(w0, g[rank, 0][0])  # held: this rank's own, unreduced
        assert torch.equal(b0, g[0, 0][1] + g[1, 0][1])
        assert torch.equal(w1, (g[0, 0][0] + g[0, 1][0]) + (g[1, 0][0] + g[1, 1][0]))
        assert torch.equal(b1, g[0, 1][1] + g[1, 1][1])


# ---- checkpoints of the new state


def test_checkpoint_round_trip_of_the_bulk_optimizers_is_bit_for_bit(synthetic_dir, tmp_path):
    """bf16 matrices (--fp32_block_weights off: Muon keeps their low bits), the gates' bf16 state,
    the row statistics, the bf16 Adam moments with their step counts; saved after an odd step
    (nothing waits for Adam), resumed, then an even and an odd step on both runs. 128-token
    slices every step (no batch ramp) and four blocks (FOUR_BLOCKS: every kind of state above is
    there; a bit-for-bit resume does not depend on the depth) keep it small."""
    config = tg.make_config("tiny", dtype="bfloat16", train_seq_len=128, batch_schedule=(), warmup_steps=0,
                            fp32_block_weights=False, checkpoint_dir=str(tmp_path / "ck"), **FOUR_BLOCKS,
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"))
    runner, loader = runner_and_loader(config)
    for step in range(2):
        runner.train_step(step, loader.next_batch())
    adam, muon = runner.optimizers
    assert isinstance(adam, tg.CautiousAdam) and isinstance(muon, tg.Muon)
    gates = {p for g in muon.param_groups if g.get("gate") for p in g["params"]}
    assert gates and all("row_mean_square" in s and ("low_bits" in s) == (p not in gates)
                         and s["momentum_buffer"].dtype == (torch.bfloat16 if p in gates else torch.float32)
                         for p, s in muon.state.items())
    unread = runner.model.embeds[0].weight  # tied: no gradient, no Adam step before the split
    assert {s["step"] for p, s in adam.state.items() if p is not unread} == {1} and adam.state[unread]["step"] == 0
    path = tg.save_checkpoint(runner, loader, 2, 1.0)
    resumed, resumed_loader = runner_and_loader(config)
    tg.load_checkpoint(resumed, resumed_loader, path, tg.validate_checkpoint(path))
    assert_same_state(all_state(resumed), all_state(runner))
    for step in (2, 3):
        assert torch.equal(runner.train_step(step, loader.next_batch()),
                           resumed.train_step(step, resumed_loader.next_batch()))
    assert_same_state(all_state(resumed), all_state(runner))
    assert {s["step"] for p, s in resumed.optimizers[0].state.items() if p is not resumed.model.embeds[0].weight} == {2}


def test_an_odd_save_every_is_refused_with_adam_on_odd_steps():
    with pytest.raises(tg.ConfigError, match="--save_every: 3 is odd"):
        tg.make_config("tiny", adam_odd_steps_only=True, save_every=3)
    with pytest.raises(tg.ConfigError, match="--save_every: 3 is odd"):
        tg.make_config("tiny", save_every=3)  # the record's default
    tg.make_config("tiny", adam_odd_steps_only=True, save_every=4)
    tg.make_config("tiny", adam_odd_steps_only=False, save_every=3)


# ---- wiring: which optimizers a config builds, multipliers, schedules


MUON_SWITCHES = {"orthogonalization": "orthogonalization", "muon_row_normalization": "row_normalization",
                 "muon_row_beta2": "row_beta2", "muon_cautious_weight_decay": "cautious_weight_decay",
                 "muon_lr_shape": "lr_shape"}


def test_the_default_builds_the_cautious_adam_and_the_records_muon_and_each_muon_field_reaches_muon():
    model = tg.build_model(tiny())
    adam, muon = tg.build_optimizers(model, tiny(), 0, 1)
    assert type(adam) is tg.CautiousAdam and type(muon) is tg.Muon
    assert {attr: getattr(muon, attr) for attr in MUON_SWITCHES.values()} == dict(
        orthogonalization="polar_express", row_normalization=True, row_beta2=0.95, cautious_weight_decay=True,
        lr_shape="stored")
    for field, value in [("orthogonalization", "newton_schulz"), ("muon_row_normalization", False),
                         ("muon_row_beta2", 0.9), ("muon_cautious_weight_decay", False), ("muon_lr_shape", "blocks")]:
        config = tiny(**{field: value})
        adam, muon = tg.build_optimizers(tg.build_model(config), config, 0, 1)
        assert getattr(muon, MUON_SWITCHES[field]) == value, field


def test_scalar_betas_parse_as_auto_or_a_number():
    defaults = tg.parse_args(["--preset=tiny"])
    assert (defaults.scalar_adam_beta1, defaults.scalar_adam_beta2) == (0.9, 0.99)  # the record's
    assert tg.parse_args(["--preset=tiny", "--scalar_adam_beta1=auto"]).scalar_adam_beta1 is None
    assert tg.parse_args(["--preset=tiny", "--scalar_adam_beta2=0.97"]).scalar_adam_beta2 == 0.97
    with pytest.raises(tg.ConfigError, match="--scalar_adam_beta1"):
        tg.parse_args(["--preset=tiny", "--scalar_adam_beta1=1.5"])


def test_the_scalar_group_has_its_own_betas_when_given():
    config = tiny(scalar_adam_beta1=None, scalar_adam_beta2=None)  # auto: adam_beta1, adam_beta2
    adam, _ = tg.build_optimizers(tg.build_model(config), config, 0, 1)
    assert {g["name"]: g["betas"] for g in adam.param_groups}["scalar"] == (0.8, 0.95)
    config = tiny()  # the record's: 0.9, 0.99
    adam, _ = tg.build_optimizers(tg.build_model(config), config, 0, 1)
    betas = {g["name"]: g["betas"] for g in adam.param_groups}
    assert betas.pop("scalar") == (0.9, 0.99) and set(betas.values()) == {(0.8, 0.95)}


def test_lr_mul_and_wd_mul_attributes_reach_every_optimizer():
    """The cautious Adam reads each parameter's multipliers when it steps (its group keeps the base
    lr); Muon groups matrices by multiplier and forms its factors from the group's."""
    config = tiny()
    model = tg.build_model(config)
    ve = list(model.value_embeds.tables.parameters())
    ve[0].lr_mul, ve[0].wd_mul = 3.0, 7.0  # the other tables keep the record's 75 and 5
    proj = model.blocks[0].mlp.proj_w
    proj.lr_mul, proj.wd_mul = 2.5, 3.0
    adam, muon = tg.build_optimizers(model, config, 0, 1)
    (group,) = [g for g in adam.param_groups if g["name"] == "value_embed"]
    assert group["lr"] == config.embed_lr and len(group["params"]) == len(ve)
    gen = torch.Generator().manual_seed(13)
    want = []
    for p in ve[:2]:
        with torch.no_grad():  # nonzero weights (the tables start at zero), so that the decay acts
            p.copy_(torch.randn(p.shape, generator=gen))
        p.grad = torch.randn(p.shape, generator=gen)
        w, state = p.detach().clone(), dict(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        tg.cautious_adam_step(w, p.grad, state, config.embed_lr * p.lr_mul, config.adam_beta1, config.adam_beta2,
                              config.adam_eps, config.adam_weight_decay, p.wd_mul)
        want.append(w)
    adam.step()
    assert torch.equal(ve[0].detach(), want[0]) and torch.equal(ve[1].detach(), want[1])
    assert (ve[1].lr_mul, ve[1].wd_mul) == (75.0, 5.0)
    for cautious in (True, False):
        config = tiny(muon_cautious_weight_decay=cautious)
        adam, muon = tg.build_optimizers(model, config, 0, 1)
        (group,) = [g for g in muon.param_groups if any(q is proj for q in g["params"])]
        assert len(group["params"]) == 1 and group["lr_mul"] == 2.5 and group["wd_mul"] == 3.0 * config.mlp_weight_decay_mul
        scalars = muon.scalars[muon.param_groups.index(group)]
        group["lr"], group["momentum"] = 0.02, 0.9
        muon._fill_scalars(group, scalars)
        rows, cols = proj.shape  # stored (hidden, model_dim): factor 2 either way
        if cautious:
            assert scalars["lr_factor"].item() == f32(f32(2.5 * max(1.0, rows / cols) ** 0.5) * f32(0.02))
            assert scalars["wd_factor"].item() == f32(f32(f32(3.0) * f32(config.muon_weight_decay)) * f32(0.02))
        else:
            assert scalars["step_size"].item() == f32(-0.02 * 2.5 * max(1.0, rows / cols) ** 0.5)
            assert scalars["decay"].item() == f32(1 - 0.02 * config.muon_weight_decay * 3.0)


def test_set_schedules_gives_muon_the_momentum_of_the_momentum_schedule():
    config = tiny(num_iterations=100, muon_momentum_cooldown_steps=10)
    runner = tg.Runner(config, torch.device("cpu"))
    for step in (10, 95):
        tg.set_schedules(runner.optimizers, step, config)
        assert {g["momentum"] for g in runner.optimizers[1].param_groups} == {tg.momentum_schedule(step, config)}
    assert tg.momentum_schedule(95, config) < config.muon_momentum  # in the cool-down


# ---- accounting


def test_the_accounting_counts_moments_in_the_weights_dtype_gate_state_and_row_statistics():
    config = tg.make_config()
    model = tg.build_model(config, "meta")  # bf16 tables and head, fp32 block weights, as on a GPU
    head, scalars, attn = model.head.weight, model.scalars, model.blocks[0].attn.qkvo_w
    assert tg.optimizer_state_parts("head", head, config) == {"adam moments bfloat16": 2 * head.numel() * 2}
    assert tg.optimizer_state_parts("scalar", scalars, config) == {"adam moments float32": 2 * scalars.numel() * 4}
    assert attn.dtype == torch.float32
    assert tg.optimizer_state_parts("muon_attn", attn, config) == {
        "muon momentum float32": attn.numel() * 4, "normuon row statistics float32": 4 * 1024 * 4}
    bf16_blocks = tg.make_config(fp32_block_weights=False)
    attn16 = tg.build_model(bf16_blocks, "meta").blocks[0].attn.qkvo_w
    assert attn16.dtype == torch.bfloat16
    assert tg.optimizer_state_parts("muon_attn", attn16, bf16_blocks) == {
        "muon momentum float32": attn.numel() * 4, "muon low bits int16": attn.numel() * 2,
        "normuon row statistics float32": 4 * 1024 * 4}
    gate = torch.nn.Parameter(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))
    assert tg.optimizer_state_parts("muon_gates", gate, config) == {
        "muon momentum bfloat16": 128 * 2, "normuon row statistics bfloat16": 8 * 2}
    no_rows = tg.make_config(muon_row_normalization=False)
    assert tg.optimizer_state_parts("muon_gates", gate, no_rows) == {"muon momentum bfloat16": 128 * 2}
    assert tg.optimizer_state_parts("muon_attn", attn, no_rows) == {"muon momentum float32": attn.numel() * 4}
    lines = tg.accounting_lines(model, config)
    (kinds,) = [line for line in lines if line.startswith("optimizer state by kind:")]
    assert "adam moments bfloat16" in kinds and "adam moments float32" in kinds
    assert "normuon row statistics float32" in kinds and "normuon row statistics bfloat16" in kinds


@pytest.mark.parametrize("overrides", [{}, dict(fp32_block_weights=False), dict(muon_row_normalization=False)])
def test_the_accounting_is_the_bytes_of_the_optimizers_own_state(overrides):
    """Against the state tensors the optimizers create (tiny, bf16 as on a GPU), parameter by parameter."""
    config = tg.make_config("tiny", dtype="bfloat16", **overrides)
    model = tg.build_model(config)
    for opt in tg.build_optimizers(model, config, 0, 1):
        for group in opt.param_groups:
            for p in group["params"]:
                held = {}
                for v in opt.state[p].values():
                    if torch.is_tensor(v):
                        held[str(v.dtype)] = held.get(str(v.dtype), 0) + v.numel() * v.element_size()
                by_dtype = {}
                for kind, nbytes in tg.optimizer_state_parts(group["name"], p, config).items():
                    dtype = "torch." + kind.rsplit(" ", 1)[1]
                    by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
                assert by_dtype == held, (group["name"], tuple(p.shape))


# Two processes against one with two micro-steps, every bulk optimizer on: tests/test_bulk_recipe.py
# runs the whole recipe that way (bit for bit with Adam every step; odd-step Adam to the order of a
# four-term sum, which a chaotic few steps amplify past any fixed per-tensor tolerance).


def test_a_parameters_own_betas_replace_its_groups_in_adam():
    """declare(..., betas=...) gives one parameter its own Adam betas; its neighbours in the group
    keep the group's."""
    config = tiny()
    model = tg.build_model(config)
    tables = list(model.value_embeds.tables.parameters())
    tables[0].betas = (0.75, 0.95)
    adam, _ = tg.build_optimizers(model, config, 0, 1)
    gen = torch.Generator().manual_seed(5)
    want = []
    for p, betas in zip(tables[:2], [(0.75, 0.95), (config.adam_beta1, config.adam_beta2)]):
        p.grad = torch.randn(p.shape, generator=gen)
        w, state = p.detach().clone(), dict(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        tg.cautious_adam_step(w, p.grad, state, config.embed_lr * p.lr_mul, *betas, config.adam_eps,
                              config.adam_weight_decay, p.wd_mul)
        want.append(state["exp_avg"])
    adam.step()
    assert torch.equal(adam.state[tables[0]]["exp_avg"], want[0])
    assert torch.equal(adam.state[tables[1]]["exp_avg"], want[1])
    assert not torch.equal(want[0], want[1])
