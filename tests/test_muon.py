"""Muon's shared pieces (docs/bulk-optimizers.md): Newton-Schulz orthogonalization against an SVD,
the per-matrix treatment of the merged attention weight, the bf16 + low-16-bit storage of the fp32
master value, and Muon with its four switches at plain Muon's settings (Newton-Schulz, no row
normalization, decoupled decay, the lr factor of each block) against references written here.
The record's setting of each switch is tested in tests/test_bulk_optim.py, its schedules in
tests/test_bulk_data.py."""
import math

import pytest
import torch

import train_gpt_medium as tg

# Singular values of orthogonalize(G) for matrices whose singular values span a factor of at most
# 100 (so every singular value of G / ||G||_F is >= 0.003; measured 0.0030 for 96x96).
# Measured over 30 seeds for each of 64x128, 128x64, 96x96 (and Gaussian 64x128 / 128x64):
#   min 0.968, max 1.149.
# Why a band and not 1: the five quintic steps map a normalized singular value x through
# p(x) = a x + b x^3 + c x^5; composed in float64 that maps [0.003, 1] onto [0.978, 1.145]
# (the steps are tuned to overshoot, not to converge), and bf16 iteration adds about +-0.01.
# Asserted band, slightly wider than measured on both sides:
SV_LOW, SV_HIGH = 0.9, 1.2
# Singular vectors: with G = U S V^T (float64 SVD), U^T X V is diagonal up to bf16 noise: measured
# largest off-diagonal entry 0.027 (kappa 100) and 0.010 (kappa <= 30); asserted:
OFF_DIAGONAL_TOL = 0.05
SHAPES = [(64, 128), (128, 64), (96, 96)]


def with_spectrum(shape, kappa: float, seed: int) -> torch.Tensor:
    """U diag(s) V^T with random orthonormal U, V and singular values log-spaced over [1/kappa, 1]."""
    gen = torch.Generator().manual_seed(seed)
    m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(kappa), k, dtype=torch.float64)[torch.randperm(k, generator=gen)]
    return ((U * s) @ V.mT).float()


def singular_values(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(X.double())


# ---- orthogonalize


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orthogonalize_singular_values_lie_in_the_measured_band(shape, seed):
    X = tg.orthogonalize(with_spectrum(shape, kappa=100, seed=seed))
    assert X.shape == shape and X.dtype == torch.bfloat16
    s = singular_values(X)
    assert s.min() >= SV_LOW and s.max() <= SV_HIGH, (s.min().item(), s.max().item())


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
def test_orthogonalize_gaussian_wide_and_tall_matrices_land_in_the_band(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    s = singular_values(tg.orthogonalize(G))
    assert s.min() >= SV_LOW and s.max() <= SV_HIGH, (s.min().item(), s.max().item())


@pytest.mark.parametrize("shape", SHAPES)
def test_orthogonalize_keeps_the_singular_vectors_of_its_input(shape):
    """U^T X V is diagonal (positive diagonal in the band) and X has nothing outside span(U), span(V)."""
    G = with_spectrum(shape, kappa=100, seed=3)
    X = tg.orthogonalize(G).double()
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    M = U.mT @ X @ Vh.mT
    diagonal = M.diagonal()
    off = M - torch.diag_embed(diagonal)
    assert off.abs().max() < OFF_DIAGONAL_TOL
    assert diagonal.min() >= SV_LOW and diagonal.max() <= SV_HIGH
    assert (X - U @ M @ Vh).abs().max() < OFF_DIAGONAL_TOL


def test_orthogonalize_is_not_the_identity_map():
    """Guard for the tests above: a badly conditioned input's spread of singular values is removed."""
    G = with_spectrum((64, 64), kappa=100, seed=4)
    s_in = singular_values(G / G.norm())
    s_out = singular_values(tg.orthogonalize(G))
    assert s_in.max() / s_in.min() > 50
    assert s_out.max() / s_out.min() < SV_HIGH / SV_LOW


def test_merged_attention_weight_is_orthogonalized_matrix_by_matrix():
    """Four slices scaled 1e-3, 1, 1e3, 7: each comes out as if orthogonalized alone (bit-exact
    on CPU: the batched matmul runs the same per-matrix kernel), with singular values in the band.
    A norm over the whole (4, d, d) tensor would leave the 1e-3 slice near zero."""
    scales = [1e-3, 1.0, 1e3, 7.0]
    G = torch.stack([with_spectrum((96, 96), kappa=100, seed=20 + i) * s for i, s in enumerate(scales)])
    X = tg.orthogonalize(G)
    assert X.shape == G.shape
    for i in range(4):
        assert torch.equal(X[i], tg.orthogonalize(G[i])), f"slice {i}"
        s = singular_values(X[i])
        assert s.min() >= SV_LOW and s.max() <= SV_HIGH, (i, s.min().item(), s.max().item())


# ---- the fp32 master value as bf16 high half + int16 low half


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def interesting_floats() -> torch.Tensor:
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 1.4e-45, 1.1754944e-38, 3.4e38, -3.4e38,
                             float("inf"), float("-inf"), 0.1, -0.1, 12345.678, -2.5e-20], dtype=torch.float32)
    # low 16 bits with the top bit set (0x8000..0xFFFF): these are the values bf16 rounding bumps up
    high_bit = torch.tensor([0x3F808000, 0x3F80FFFF, -0x407F0001, 0x00018001, 0x7F7FFFFF], dtype=torch.int32)
    random_bits = torch.randint(-2**31, 2**31, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    return torch.cat([as_bits(specials), high_bit, random_bits.to(torch.int32)]).view(torch.float32)


def test_store_then_read_halves_round_trips_every_fp32_bit_pattern():
    master = interesting_floats()
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    low = torch.empty(master.shape, dtype=torch.int16)
    tg.store_halves(master, weight, low)
    assert torch.equal(as_bits(tg.fp32_from_halves(weight, low)), as_bits(master))


def test_bf16_half_is_the_truncated_fp32_value_not_the_rounded_one():
    master = interesting_floats()
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    low = torch.empty(master.shape, dtype=torch.int16)
    tg.store_halves(master, weight, low)
    bits = as_bits(master).to(torch.int64) & 0xFFFFFFFF  # unsigned view of the 32 bits
    assert torch.equal(weight.view(torch.int16).to(torch.int64) & 0xFFFF, bits >> 16)
    assert torch.equal(low.to(torch.int64) & 0xFFFF, bits & 0xFFFF)
    finite = torch.isfinite(master)
    rounded_differs = weight[finite].view(torch.int16) != master[finite].to(torch.bfloat16).view(torch.int16)
    assert rounded_differs.any()  # the data does distinguish truncation from rounding


# ---- the update


# Muon's four switches at plain Muon's settings (the record's defaults are the other settings)
PLAIN_MUON = dict(orthogonalization="newton_schulz", row_normalization=False, cautious_weight_decay=False,
                  lr_shape="blocks")


def muon_for(p: torch.nn.Parameter, lr: float, momentum: float, weight_decay: float, wd_mul: float) -> tg.Muon:
    return tg.Muon([dict(params=[p], wd_mul=wd_mul)], lr=lr, momentum=momentum, weight_decay=weight_decay,
                   **PLAIN_MUON)


ROWS, COLS = 96, 32  # tall: effective lr = lr * sqrt(3)
LR, WD, WD_MUL = 0.025, 0.1, 2.0
# (lr multiplier, momentum) per step, as the schedules would change them
STEPS = [(1.0, 0.85), (1.0, 0.87), (0.8, 0.9), (0.5, 0.95), (0.1, 0.95)]


def gradients(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, COLS, generator=gen).to(dtype) for _ in STEPS]


def initial_weight(dtype):
    return (torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)


def run_muon(dtype):
    p = torch.nn.Parameter(initial_weight(dtype))
    opt = muon_for(p, LR, 0.0, WD, WD_MUL)
    snapshots = []
    for (mult, m), g in zip(STEPS, gradients(dtype)):
        opt.param_groups[0].update(lr=LR * mult, momentum=m)
        p.grad = g.clone()
        opt.step()
        snapshots.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}))
    return snapshots


def reference_same_rounding(dtype):
    """Muon's update on a plain fp32 master tensor, with the same fp32 primitives (so the same roundings):
    b = m*b + (1-m)*g as b + (1-m)*(g - b) (torch.lerp); w -= lr_eff*u as one fused multiply-add
    (Tensor.add_ with alpha; on this CPU that differs in the last bit from w - (lr_eff*u) for
    about a quarter of entries, measured). Only the storage differs from Muon's bf16 path."""
    master = initial_weight(dtype).float()
    b = torch.zeros(ROWS, COLS)
    out = []
    for (mult, m), g in zip(STEPS, gradients(dtype)):
        lr, g = LR * mult, g.float()
        b = torch.lerp(b, g, 1 - m)
        u = tg.orthogonalize(torch.lerp(g, b, m), dtype)
        master = master * (1 - lr * WD * WD_MUL)
        master = master.add(u.float(), alpha=-lr * math.sqrt(max(1.0, ROWS / COLS)))
        out.append((master.clone(), b.clone()))
    return out


def test_bf16_weights_with_low_bits_update_like_an_fp32_master_bit_for_bit():
    got, want = run_muon(torch.bfloat16), reference_same_rounding(torch.bfloat16)
    for step, ((weight, state), (master, b)) in enumerate(zip(got, want)):
        assert weight.dtype == torch.bfloat16
        reconstructed = tg.fp32_from_halves(weight, state["low_bits"])
        assert torch.equal(as_bits(reconstructed), as_bits(master)), f"fp32 master, step {step}"
        assert torch.equal(weight.view(torch.int16), (as_bits(master) >> 16).to(torch.int16)), f"bf16, step {step}"
        assert torch.equal(state["momentum_buffer"], b), f"momentum, step {step}"
    assert not torch.equal(got[-1][0], initial_weight(torch.bfloat16))


def test_fp32_parameters_are_the_master_updated_in_place_with_the_same_arithmetic():
    p = torch.nn.Parameter(initial_weight(torch.float32))
    storage = p.data_ptr()
    opt = muon_for(p, LR, 0.0, WD, WD_MUL)
    for (mult, m), g, (master, b) in zip(STEPS, gradients(torch.float32), reference_same_rounding(torch.float32)):
        opt.param_groups[0].update(lr=LR * mult, momentum=m)
        p.grad = g.clone()
        opt.step()
        assert torch.equal(as_bits(p.detach()), as_bits(master))
        assert torch.equal(opt.state[p]["momentum_buffer"], b)
    assert p.data_ptr() == storage and p.dtype == torch.float32
    assert "low_bits" not in opt.state[p]


def test_update_matches_the_recipe_formulas_evaluated_in_float64():
    """The formulas read literally (b = m*b + (1-m)*g; u = orth(m*b + (1-m)*g); w *= 1 - lr*wd*wd_mul;
    w -= lr*sqrt(max(1, rows/cols))*u) in float64, for fp32 parameters (fp32 Newton-Schulz):
    agreement to fp32 rounding. Ignoring wd_mul would be off by ~1e-4, the lr scale by ~1e-2."""
    p = torch.nn.Parameter(initial_weight(torch.float32))
    opt = muon_for(p, LR, 0.0, WD, WD_MUL)
    w, b = initial_weight(torch.float32).double(), torch.zeros(ROWS, COLS, dtype=torch.float64)
    for (mult, m), g in zip(STEPS, gradients(torch.float32)):
        lr = LR * mult
        opt.param_groups[0].update(lr=lr, momentum=m)
        p.grad = g.clone()
        opt.step()
        g = g.double()
        b = m * b + (1 - m) * g
        u = tg.orthogonalize((m * b + (1 - m) * g).float(), torch.float32).double()
        w = w * (1 - lr * WD * WD_MUL)
        w = w - lr * math.sqrt(max(1, ROWS / COLS)) * u
        torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), b, rtol=1e-6, atol=1e-7)


def test_momentum_buffer_after_two_steps():
    """From b = 0: b1 = (1-m) g1, b2 = m (1-m) g1 + (1-m) g2."""
    m = 0.9
    p = torch.nn.Parameter(torch.zeros(8, 4))
    opt = muon_for(p, lr=0.01, momentum=m, weight_decay=0.0, wd_mul=1.0)
    gen = torch.Generator().manual_seed(5)
    g1, g2 = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
    want = m * (1 - m) * g1.double() + (1 - m) * g2.double()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), want, rtol=1e-6, atol=1e-7)


def test_step_leaves_the_gradient_unchanged():
    """An optimizer reads .grad, it does not rewrite it (fp32 and bf16 parameters alike)."""
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(initial_weight(dtype))
        opt = muon_for(p, LR, 0.9, WD, WD_MUL)
        for g in gradients(dtype)[:2]:
            p.grad = g.clone()
            opt.step()
            assert torch.equal(p.grad, g), f"{dtype}: step modified p.grad"


# ---- the Newton-Schulz input (--orthogonalization=newton_schulz) as the x01 records' compiled update computed it


def records_newton_schulz_input(G):
    """The records' Newton-Schulz opens with these lines (for torch.compile): the momentum cast to
    bf16, transposed if it has more rows than columns, then divided by its Frobenius norm + 1e-7."""
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def exact_norm_momentum(shape, seed):
    """A momentum whose squared Frobenius norm every summation order computes exactly: integers,
    mostly |k| <= 63 (bf16 holds them), one in ~128 an odd 257..511 (9 significant bits: bf16 rounds
    it), each matrix's sum of squares below 2**24 (fp32 holds every partial sum)."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.randint(-63, 64, shape, generator=gen).float()
    wide = torch.rand(shape, generator=gen) < 1 / 128
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    G[wide] = (sign * (torch.randint(128, 256, shape, generator=gen) * 2 + 1))[wide]
    assert G.double().square().sum(dim=(-2, -1)).max() < 2**24 and not torch.equal(G.bfloat16().float(), G)
    return G


def compiled_and_eager_normalization(G, monkeypatch):
    """(the records' compiled normalization, orthogonalize's with no iteration), the same way round."""
    want = torch.compile(records_newton_schulz_input, dynamic=False)(G)
    if G.size(-2) > G.size(-1):
        want = want.mT  # orthogonalize returns the matrix the right way round
    monkeypatch.setattr(tg, "NEWTON_SCHULZ_COEFFS", ())  # no iteration: orthogonalize returns its input
    return want, tg.orthogonalize(G, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 64, 64), (48, 24)])
def test_newton_schulz_input_is_what_the_records_compiled_update_normalizes(shape, monkeypatch):
    """The records cast the momentum to bf16 before dividing by its norm, inside a compiled update,
    where Inductor keeps the cast's value in fp32: they divide the fp32 momentum by its fp32 norm
    and round once, as orthogonalize does eagerly. Bit for bit on every CPU kind for a momentum
    whose norm is exact in any summation order (then every step is one correctly rounded IEEE
    operation: sqrt, + 1e-7, the division, the cast); the same lines run eagerly round the momentum
    and its norm to bf16 first and differ in a quarter to a third of the elements."""
    G = exact_norm_momentum(shape, seed=3)
    want, got = compiled_and_eager_normalization(G, monkeypatch)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    numerator_rounded = (G.bfloat16().float() / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)).bfloat16()
    assert numerator_rounded.ne(want).any()  # the compiled update divides the unrounded momentum
    eager = records_newton_schulz_input(G)
    assert (eager.mT if shape[0] > shape[1] else eager).ne(want).float().mean() > 0.2  # rounded before the norm


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 64, 64), (48, 24)])
def test_newton_schulz_input_of_a_random_momentum_differs_only_by_the_norms_summation_order(shape, monkeypatch):
    """A random momentum: Inductor's norm and aten's sum the squares in different orders, which
    differ by CPU kind (vector width), so the fp32 norms can differ by a few ulps and a quotient
    near a bf16 rounding boundary can round the other way. Measured over 40 seeds on an Intel Xeon
    under ATEN_CPU_CAPABILITY=avx512 / avx2 / default: at most 1, 2, 4 of the 16,384 elements of
    (4, 64, 64) and 0, 0, 1 of the 1,152 of (48, 24) differ, each by 1 bf16 ulp. Allowed: 1 ulp in
    1/256 of the elements (64 and 4: 16 and 4 times the most seen); rounding first differs in > 1/5."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    want, got = compiled_and_eager_normalization(G, monkeypatch)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()  # same sign: bit distance
    assert ulps.max() <= 1 and got.ne(want).sum() <= got.numel() / 256
    eager = records_newton_schulz_input(G)
    assert (eager.mT if shape[0] > shape[1] else eager).ne(want).float().mean() > 0.2  # rounded before the norm
