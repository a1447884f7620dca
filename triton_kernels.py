"""How numbers are computed on a device, beside train_gpt_medium.py (upstream's triton_kernels.py):
the fused cross-entropy's Triton kernels and their torch references, FP8 codes and products, the
arithmetic that rounds as CUDA rounds on any device, and FlashAttention-3's fetch.

A leaf: it never imports the trainer. Triton is imported only where a kernel is first made (a CPU
build of torch has none; TRITON_INTERPRET=1 then runs the kernels on the CPU, which the tests do).
Importing this file has no side effects; the fused loss's custom ops are registered when a model
that uses them is built (fused_ce_ops). Its name is not kernels.py because --attention=fa3 imports
the Hugging Face package of that name, which a file beside the trainer would hide.

Every log of the trainer embeds this file after the trainer's own source, under its own header.

Contents:
  1. CUDA's rounding on any device   as_cuda (torchs_product_is_fast, cpu_has_bf16_gemm), fp32_product,
                                     fp32_quotient, cast, fp32_sum
  2. FP8                             to_fp8 (saturating codes), fp8_matmul (_scaled_mm on CUDA, the
                                     codes' exact product elsewhere), the head's products, fp8_transpose
  3. The fused softcapped loss       the torch references, the Triton kernels, the custom ops
  4. FlashAttention-3                its fetch from the kernels hub
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


# =============================================================================
# 1. CUDA's rounding on any device
#
# The records' arithmetic where its rounding matters, so a CPU computes what the GPU does
# (and the tests can check the records' numbers on a CPU).


class as_cuda:
    """In-place arithmetic rounded as CUDA's kernels round it, on any device: the optimizers' math
    calls these where the record's bf16 arithmetic is sensitive to rounding, so the CPU computes
    what the GPU does (and the tests can check the record's numbers on a CPU). On CUDA each is the
    plain torch call. PyTorch's CPU kernels differ for a bf16 tensor t:
    - add_: t += alpha * other. CUDA forms it in fp32 with alpha (and a number `other`) in fp32,
      one fused multiply-add, rounded once; the CPU rounds alpha or the number to bf16 first
      (0.2 becomes 0.2002, 8.1566 becomes 8.1875, 1e-8 becomes 1.0012e-8).
    - addcmul_: t += value * (a * b). CUDA forms a*b in fp32, then one fused multiply-add with
      value; the CPU forms (value*a)*b (any dtype).
    - rsqrt_: t = 1/sqrt(t). CUDA computes in fp32 and rounds once; the CPU computes the elements
      of a bf16 tensor that do not fill a vector register (a gate's statistic: one value per head)
      in bf16 arithmetic, a quarter of them one bf16 step off.
    - matmul, addmm: the same arithmetic on every device (fp32 sums, one rounding); on a CPU
      without oneDNN's bf16 kernels they take the fp32 product for speed (addmm says why)."""

    @staticmethod
    def add_(t: torch.Tensor, other, alpha: float = 1.0) -> torch.Tensor:
        if t.is_cuda or t.dtype != torch.bfloat16:
            return t.add_(other, alpha=alpha)
        return t.copy_(t.float().add_(other.float() if torch.is_tensor(other) else other, alpha=alpha))

    @staticmethod
    def addcmul_(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float) -> torch.Tensor:
        if t.is_cuda:
            return t.addcmul_(a, b, value=value)
        return t.copy_(t.float().add_(a.float() * b.float(), alpha=value))

    @staticmethod
    def rsqrt_(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda or t.dtype != torch.bfloat16:
            return t.rsqrt_()
        return t.copy_(t.float().rsqrt_())

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b; bf16 as cuBLAS forms it: products summed in fp32, rounded once (see addmm)."""
        if torchs_product_is_fast(a):
            return a @ b
        return (a.float() @ b.float()).to(a.dtype)

    @staticmethod
    def addmm(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
        """beta t + alpha (a @ b) for matrices or batches of them, rounded once; beta and alpha in
        fp32 (cuBLAS's scalars). Same arithmetic on every device: a CPU without oneDNN's bf16
        kernels would run torch's bf16 product as a scalar loop (6-20x slower than fp32 on the
        tiny preset's shapes, most of a tiny run on such a CPU), so there it runs as the fp32
        product of the same bf16 values, rounded once to bf16. Both sum in fp32, in orders that
        differ as BLAS libraries' do. A compiled graph keeps torch's product (torchs_product_is_fast)."""
        product = torch.baddbmm if a.ndim > 2 else torch.addmm
        if torchs_product_is_fast(t):
            return product(t, a, b, beta=beta, alpha=alpha)
        return product(t.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(t.dtype)


def torchs_product_is_fast(t: torch.Tensor) -> bool:
    """as_cuda's products call torch's own: on CUDA, for any dtype but bf16, inside a compiled graph
    (which cannot ask the CPU; Inductor picks its own kernels), and where the CPU has oneDNN's."""
    return t.is_cuda or t.dtype != torch.bfloat16 or torch.compiler.is_compiling() or cpu_has_bf16_gemm()


@functools.cache  # asked once per process, never inside a graph (torchs_product_is_fast asks it last)
def cpu_has_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 matrix products run oneDNN's kernels (torch asks for AVX-512 BW, VL
    and DQ); elsewhere ATen computes them in plain loops."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def fp32_product(*factors: float) -> float:
    """The product of numbers as fp32 arithmetic forms it: each factor rounded to fp32, then each
    product rounded, left to right (a Python float holding that fp32 value). The records form their
    per-step fp32 factors (the optimizers' lr and decay, the loss's gradient slope) so."""
    total = np.float32(factors[0])
    for f in factors[1:]:
        total = np.float32(total * np.float32(f))
    return float(total)


def fp32_quotient(a: float, b: float) -> float:
    """a / b as fp32 arithmetic forms it (both rounded to fp32, the quotient rounded once)."""
    return float(np.float32(a) / np.float32(b))


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself where it already is, never a no-op .to(). What an autograd Function
    returns goes through this: under torch.compile, torch 2.11 gives zero gradients to the inputs
    of a Function whose forward returns a no-op .to() of a tensor (fixed by 2.13)."""
    return t if t.dtype == dtype else t.to(dtype)


def fp32_sum(dtype: torch.dtype, *terms, gain: float = 1.0) -> torch.Tensor:
    """gain x the sum of weight x tensor over the (weight, tensor) pairs (weight None: 1), computed
    in fp32 and rounded once to dtype: what the records' compiled (fused) pointwise code does with a
    bf16 expression (eager bf16 would round after every operation). Left to right, as written there."""
    total = None
    for w, t in terms:
        term = t.float() if w is None else w.float() * t.float()
        total = term if total is None else total + term
    return (total if gain == 1.0 else gain * total).to(dtype)


# =============================================================================
# 2. FP8
#
# Each operand quantized with a fixed scale: codes = fp8(t / scale), rounded once from fp32 (the
# records divide and cast inside compiled code, which does not round the quotient to bf16 first).


FP8_E4M3_MAX = 448.0


def to_fp8(t: torch.Tensor, scale, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """FP8 codes of t / scale (a float, or a 0-d fp32 tensor on t's device: a scale computed on the
    device, no host sync), one round-to-nearest-even from fp32, saturating at the format's
    largest value (e4m3fn 448, e5m2 57344) on every torch and device, as the records' casts inside
    compiled code do. The clamp is explicit because eager casts differ: torch 2.11 turns e4m3fn values
    past about 464 into NaN, torch 2.12+ saturates, and e5m2 overflows to inf. NaN stays NaN."""
    top = torch.finfo(dtype).max
    return (t.float() / scale).clamp(-top, top).to(dtype)


def fp8_matmul(a8: torch.Tensor, b8: torch.Tensor, scale_a, scale_b, out_dtype: torch.dtype,
               fast_accum: bool = False) -> torch.Tensor:
    """(a8 @ b8) * scale_a * scale_b, (m, k) @ (k, n), accumulated in fp32 and rounded once to
    out_dtype. CUDA: torch._scaled_mm (fast_accum: Hopper's faster, less often renormalized fp32
    accumulation, as the records' forward); elsewhere the same product of the codes' exact values
    in fp32 (an FP8 code is exact in fp32), times the two scales' product formed in fp32 from
    their fp32 values, as _scaled_mm takes them. Each scale is a float or a 0-d fp32 tensor on the
    codes' device (per-tensor scales computed there, read by neither host)."""
    if a8.is_cuda:
        return scaled_mm(a8, b8, scale_a, scale_b, out_dtype, fast_accum)
    scale = fp32_scale(scale_a, a8.device) * fp32_scale(scale_b, a8.device)  # fp32, as the GPU
    return cast((a8.float() @ b8.float()) * scale, out_dtype)


def fp32_scale(s, device) -> torch.Tensor:
    """A scale as the 0-d fp32 tensor _scaled_mm takes: a tensor as it is, a float filled in on the
    device (torch.tensor(s, device=...) would be a blocking host-to-device copy, a stream sync)."""
    if isinstance(s, torch.Tensor):
        return s if s.dtype == torch.float32 and s.dim() == 0 else s.float().reshape(())
    return torch.full((), s, dtype=torch.float32, device=device)


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a, scale_b, out_dtype: torch.dtype,
              fast_accum: bool) -> torch.Tensor:
    """fp8_matmul on a device: torch._scaled_mm, a row-major and b column-major (callers pass them so,
    and the layouts below then copy nothing). Its 0-d scales are made on the device by a fill kernel
    (fp32_scale), or are the caller's device tensors."""
    scale = lambda s: fp32_scale(s, a8.device)
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=scale(scale_a), scale_b=scale(scale_b),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


def fp8_head_codes(x: torch.Tensor, weight: torch.Tensor, scales: tuple[float, float, float]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 codes of the head's input x (T, d) and of its weight as stored."""
    return to_fp8(x, scales[0]), to_fp8(weight, scales[1])


def fp8_head_logits(x8: torch.Tensor, w8: torch.Tensor, transposed: bool, scales: tuple[float, float, float],
                    out_dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T (weight stored (V, d)) or x @ H (stored (d, V)) from the codes: (T, V) in out_dtype,
    fast accumulation as the records' forward."""
    return fp8_matmul(x8, w8 if transposed else w8.t(), scales[0], scales[1], out_dtype, fast_accum=True)


def fp8_head_backward(g8: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, transposed: bool,
                      scales: tuple[float, float, float], x_dtype: torch.dtype, weight_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the e5m2 codes g8 of the logits' gradient (T, V): the input's gradient (T, d) in x_dtype
    and the weight's in its stored layout, accumulated in fp32 and then cast to weight_dtype."""
    s_x, s_w, s_g = scales
    dx = fp8_matmul(g8, w8.t() if transposed else w8, s_g, s_w, x_dtype)
    # both layouts of the weight's gradient contract over the tokens, so FP8's product needs the codes
    # token-major: (V, T) made once by a tiled transpose (CUDA), not by an eager copy of a strided view
    g8_t = fp8_transpose(g8)
    dw = (fp8_matmul(x8.t(), g8_t.t(), s_x, s_g, torch.float32) if transposed
          else fp8_matmul(g8_t, x8, s_g, s_x, torch.float32))
    return dx, cast(dw, weight_dtype)


def fp8_transpose(codes: torch.Tensor) -> torch.Tensor:
    """The (n, m) row-major transpose of (m, n) FP8 codes (the same bits). CUDA: a Triton kernel in
    square tiles (each read and written in whole rows); elsewhere torch's copy."""
    if not codes.is_cuda:
        return codes.t().contiguous()
    m, n = codes.shape
    out = torch.empty((n, m), dtype=codes.dtype, device=codes.device)
    kernel = fp8_transpose_kernel()
    kernel[(-(-m // TRANSPOSE_TILE), -(-n // TRANSPOSE_TILE))](codes.contiguous().view(torch.uint8),
                                                                out.view(torch.uint8), m, n, TILE=TRANSPOSE_TILE)
    return out


TRANSPOSE_TILE = 64
_TRANSPOSE_KERNEL = None


def fp8_transpose_kernel():
    """fp8_transpose's Triton kernel, made on first use (triton is imported only here). A compiled
    step must find it made: made inside a traced backward, triton.jit's reading of its settings breaks
    the graph (the trainer makes it before compiling: prepare_device_kernels)."""
    global _TRANSPOSE_KERNEL
    if _TRANSPOSE_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def transpose_kernel(src, dst, M, N, TILE: tl.constexpr):
            # one program per TILE x TILE tile: read its rows of src, write them as columns of dst
            rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
            cols = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
            inside = (rows[:, None] < M) & (cols[None, :] < N)
            tile = tl.load(src + rows[:, None] * N + cols[None, :], mask=inside)
            tl.store(dst + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(inside))

        _TRANSPOSE_KERNEL = transpose_kernel
    return _TRANSPOSE_KERNEL


# =============================================================================
# 3. The fused softcapped cross-entropy


# the record's logit cap: 23 sigmoid((z + 5) / 7.5), values in (0, 23)
SIGMOID_CAP, SIGMOID_SHIFT, SIGMOID_TEMPERATURE = 23.0, 5.0, 7.5


# PR #252's training loss as one op (--fused_softcap_ce, docs/fused-ce.md). From the final
# normed rows h (T, d) and the head H: logits l (the model dtype; bf16 from FP8 codes with --fp8),
# then in fp32 the sigmoid cap, each row's log-sum-exp over all padded columns and the multi-token
# sum. The backward writes dL/dl once (model dtype, or e5m2 codes of dL/dl / s_g) and multiplies it
# into dh and dH. CUDA: a Triton kernel does the fp32 part; elsewhere the same arithmetic in torch
# ops, a block of rows at a time, so no (T, V) fp32 tensor is ever whole. The logits are kept for
# the backward (in l's dtype), as the kernel keeps them.
# variant "pr261" (PR #261's kernel): sigma rounded to bf16, dL/dl made in the forward for an upstream
# gradient fixed in advance (grad_scale) and kept instead of the logits, the backward's input ignored,
# S_w over all multi-token weights, e5m2 codes saturating (below).
FUSED_CE_CHUNK = 1 << 22  # elements of one fp32 temporary of the CPU path (16 MiB)
FUSED_CE_VARIANTS = ("pr252", "pr261")


def fused_ce_terms(targets: torch.Tensor, weights: torch.Tensor, n_cols: int,
                   prefix_targets: Optional[torch.Tensor] = None, prefix_weight: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's loss terms as (T, K) target columns and weights: term k of row t is
    w_k (LSE_t - z_t[y_(t+k)]) when t+k < T, w_k > 0 and 0 <= y_(t+k) < n_cols; any other gets
    column -1 and weight 0, so the loss and its gradient (whose S_w sums the same weights) agree.
    prefix_targets (T,) and prefix_weight (1,) (--prefix_loss_weight, #337): a last column, term
    w (LSE_t - z_t[p_t]) where 0 <= p_t < n_cols (K + 1 columns)."""
    T, K = targets.numel(), weights.numel()
    ahead = torch.arange(T, device=targets.device)[:, None] + torch.arange(K, device=targets.device)[None, :]
    y = targets[ahead.clamp_max(T - 1)].long()
    valid = (ahead < T) & (weights[None, :] > 0) & (y >= 0) & (y < n_cols)
    cols, wts = torch.where(valid, y, -1), torch.where(valid, weights.float()[None, :], 0.0)
    if prefix_targets is None:
        return cols, wts
    p = prefix_targets.long()[:, None]
    has = (p >= 0) & (p < n_cols)
    return (torch.cat([cols, torch.where(has, p, -1)], 1),
            torch.cat([wts, torch.where(has, prefix_weight.float().reshape(1, 1), 0.0)], 1))


def _fused_ce_sigmoid(l: torch.Tensor, variant: str = "pr252") -> torch.Tensor:
    """sigma(u), u = l (1/C) + B (1/C), in fp32 (the cap is z = A sigma). pr261: 0.5 + 0.5 tanh(u/2) in
    fp32 rounded to bf16 (returned as fp32), as #261's kernel; its GPU tanh is an approximate
    instruction (fast math), which this does not reproduce."""
    u = l.float() * (1 / SIGMOID_TEMPERATURE) + SIGMOID_SHIFT / SIGMOID_TEMPERATURE
    if variant == "pr261":
        return (torch.tanh(u * 0.5) * 0.5 + 0.5).bfloat16().float()
    return torch.sigmoid(u)


def _fused_ce_pr261_factors(scale: float) -> tuple[float, float]:
    """#261's two fp32 factors of the logits' gradient, (fp32(1/C) A, 1/scale), each rounded to fp32
    as its kernel forms them (Python floats holding those fp32 values)."""
    return fp32_product(1 / SIGMOID_TEMPERATURE, SIGMOID_CAP), fp32_quotient(1, scale)


def _fused_ce_pr261_coef(g: torch.Tensor, scale: float) -> torch.Tensor:
    """#261's factor of the logits' gradient in its fp32 order, g (1/C A) (1/scale) (fp32 0-d)."""
    slope, inv_scale = _fused_ce_pr261_factors(scale)
    return g.float() * slope * inv_scale


def _fused_ce_rows_torch(logits: torch.Tensor, cols: torch.Tensor, wts: torch.Tensor,
                         chunk: int = FUSED_CE_CHUNK, variant: str = "pr252") -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, LSE), both fp32 (T,): the forward's fp32 part, `chunk` elements at a time."""
    T, V = logits.shape
    lse, loss = (torch.empty(T, dtype=torch.float32, device=logits.device) for _ in range(2))
    step = max(1, chunk // V)
    for a in range(0, T, step):
        z = SIGMOID_CAP * _fused_ce_sigmoid(logits[a:a + step], variant)
        lse[a:a + step] = m = torch.logsumexp(z, dim=1)
        z_target = z.gather(1, cols[a:a + step].clamp_min(0))
        loss[a:a + step] = (wts[a:a + step] * (m[:, None] - z_target)).sum(1)
    return loss, lse


def _fused_ce_dlogits_torch(logits: torch.Tensor, lse: torch.Tensor, cols: torch.Tensor, wts: torch.Tensor,
                            g: torch.Tensor, scale: float, out_dtype: torch.dtype,
                            chunk: int = FUSED_CE_CHUNK, variant: str = "pr252",
                            s_w_all: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(dL/dl) / scale in out_dtype (T, V): g (A/C) (S_w p - sum_k w_k [v = y_(t+k)]) sigma (1 - sigma),
    p = exp(z - LSE), S_w = the row's weights; computed in fp32 and rounded once (e5m2 codes with
    scale = s_g, the model dtype with scale 1, fp32 to look at it unrounded). pr261: sigma rounded to
    bf16, S_w = s_w_all (the sum of all the weights, every row; one per row (T,) with #337's prefix
    term), #261's fp32 order (the factor g (A/C) (1/scale) first), and values past out_dtype's largest
    saturate to it (torch's e5m2 cast would give inf)."""
    T, V = logits.shape
    out = torch.empty(T, V, dtype=out_dtype, device=logits.device)
    pr261 = variant == "pr261"
    coef = _fused_ce_pr261_coef(g, scale) if pr261 else g.float() * (SIGMOID_CAP / SIGMOID_TEMPERATURE)
    s_w = s_w_all.float().reshape(-1, 1) if pr261 else wts.sum(1, keepdim=True)
    top = torch.finfo(out_dtype).max
    step = max(1, chunk // V)
    for a in range(0, T, step):
        s = _fused_ce_sigmoid(logits[a:a + step], variant)
        p = torch.exp(SIGMOID_CAP * s - lse[a:a + step, None])
        hit = torch.zeros_like(p).scatter_add_(1, cols[a:a + step].clamp_min(0), wts[a:a + step])
        if pr261:
            s_w_rows = s_w if s_w.shape[0] == 1 else s_w[a:a + step]  # one for all rows, or one per row
            d = (coef * (s_w_rows * p - hit) * s * (1 - s)).clamp(-top, top)
        else:
            d = coef * (s_w[a:a + step] * p - hit) * s * (1 - s) / scale
        out[a:a + step] = d.to(out_dtype)
    return out


def _fused_ce_kernels():
    """The Triton kernels of the CUDA path, made on first use (triton is imported only here: a CPU
    build of torch has none). TRITON_INTERPRET=1 at that moment runs them on the CPU (tests)."""
    global _FUSED_CE_KERNELS, bf16_rounded, row_lse_and_loss, block_terms, pr261_gradient
    if _FUSED_CE_KERNELS is not None:
        return _FUSED_CE_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def bf16_rounded(s):
        # s rounded to bf16 and back, to nearest even, through its bits: the same on a GPU and in the
        # interpreter, whose own fp32 -> bf16 cast truncates; a NaN stays NaN. A global of this module
        # (the `global` above): the interpreter finds the kernels' helpers there, not in this closure
        b = s.to(tl.int32, bitcast=True)
        return tl.where(s == s, ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True), s)

    # PR261 (constexpr): sigma rounded to bf16 (bf16_rounded). sigma itself is tl.sigmoid (#261:
    # 0.5 + 0.5 tanh(u/2) by fast-math instructions; equal up to fp32 rounding).
    @triton.jit
    def row_lse_and_loss(row, cols_ptr, wts_ptr, t, V, inv_c, shift, cap, K: tl.constexpr, BLOCK: tl.constexpr,
                         PR261: tl.constexpr):
        # a row's LSE (a running max and sum of exp over blocks of columns) and its K terms' loss
        offsets = tl.arange(0, BLOCK)
        top = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            c = start + offsets
            s = tl.sigmoid(tl.load(row + c, mask=c < V, other=0.0).to(tl.float32) * inv_c + shift)
            if PR261:
                s = bf16_rounded(s)
            z = cap * s
            z = tl.where(c < V, z, float("-inf"))
            new_top = tl.maximum(top, tl.max(z, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        loss = tl.zeros((), tl.float32)
        for k in tl.static_range(K):
            col = tl.load(cols_ptr + t * K + k)
            s_col = tl.sigmoid(tl.load(row + tl.maximum(col, 0)).to(tl.float32) * inv_c + shift)
            if PR261:
                s_col = bf16_rounded(s_col)
            loss += tl.load(wts_ptr + t * K + k) * (lse - cap * s_col)
        return lse, loss

    @triton.jit
    def block_terms(l, c, lse, cols_ptr, wts_ptr, t, inv_c, shift, cap, K: tl.constexpr, BLOCK: tl.constexpr,
                    PR261: tl.constexpr):
        # a block of a row's columns: sigma, p = exp(z - LSE), the weights of the targets among them, and
        # the row's own sum of weights
        s = tl.sigmoid(l * inv_c + shift)
        if PR261:
            s = bf16_rounded(s)
        p = tl.exp(cap * s - lse)
        s_w = tl.zeros((), tl.float32)
        hit = tl.zeros((BLOCK,), tl.float32)
        for k in tl.static_range(K):
            w = tl.load(wts_ptr + t * K + k)
            s_w += w
            hit += tl.where(c == tl.load(cols_ptr + t * K + k), w, 0.0)
        return s, p, hit, s_w

    @triton.jit
    def pr261_gradient(g, s_w, p, hit, s, slope, inv_scale, top):
        # S_w: all the weights; #261's order (slope = fp32(1/C) A); saturate at the output's largest
        d = g * slope * inv_scale * (s_w * p - hit) * s * (1.0 - s)
        return tl.where(d > top, top, tl.where(d < -top, -top, d))

    @triton.jit
    def rows_kernel(logits_ptr, cols_ptr, wts_ptr, lse_ptr, loss_ptr, V, row_stride, inv_c, shift, cap,
                    K: tl.constexpr, BLOCK: tl.constexpr, PR261: tl.constexpr = False):
        # one program per row
        t = tl.program_id(0).to(tl.int64)
        lse, loss = row_lse_and_loss(logits_ptr + t * row_stride, cols_ptr, wts_ptr, t, V, inv_c, shift, cap, K,
                                     BLOCK, PR261)
        tl.store(lse_ptr + t, lse)
        tl.store(loss_ptr + t, loss)

    @triton.jit
    def dlogits_kernel(logits_ptr, lse_ptr, cols_ptr, wts_ptr, g_ptr, out_ptr, V, row_stride, out_stride,
                       inv_c, shift, cap, slope, scale, K: tl.constexpr, BLOCK: tl.constexpr,
                       ROUND: tl.constexpr, PR261: tl.constexpr = False, sw_ptr=None, inv_scale=1.0,
                       top=1.0, sw_stride=0):
        # one program per (row, block of columns); every element independent given the row's LSE
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        l = tl.load(logits_ptr + t * row_stride + c, mask=c < V, other=0.0).to(tl.float32)
        s, p, hit, s_w = block_terms(l, c, tl.load(lse_ptr + t), cols_ptr, wts_ptr, t, inv_c, shift, cap, K, BLOCK,
                                     PR261)
        if PR261:  # S_w: one value for every row (sw_stride 0), or one per row (1: #337's prefix term)
            d = pr261_gradient(tl.load(g_ptr), tl.load(sw_ptr + t * sw_stride), p, hit, s, slope, inv_scale, top)
        else:
            d = tl.math.div_rn(tl.load(g_ptr) * slope * (s_w * p - hit) * s * (1.0 - s), scale)
        if ROUND:  # one round-to-nearest-even from fp32, as torch's cast
            d = d.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + t * out_stride + c, d, mask=c < V)

    @triton.jit
    def rows_dlogits_kernel(logits_ptr, cols_ptr, wts_ptr, lse_ptr, loss_ptr, g_ptr, out_ptr, sw_ptr, V, row_stride,
                            out_stride, inv_c, shift, cap, slope, inv_scale, top, sw_stride, K: tl.constexpr,
                            BLOCK: tl.constexpr, ROUND: tl.constexpr):
        # pr261 in one program per row, as #261's one kernel: rows_kernel's LSE and loss, then the row's
        # gradient block by block with dlogits_kernel's formula while the row is still in the cache, so
        # the (T, V) logits leave memory once, not once per kernel
        t = tl.program_id(0).to(tl.int64)
        row = logits_ptr + t * row_stride
        lse, loss = row_lse_and_loss(row, cols_ptr, wts_ptr, t, V, inv_c, shift, cap, K, BLOCK, True)
        tl.store(lse_ptr + t, lse)
        tl.store(loss_ptr + t, loss)
        g, s_w_all = tl.load(g_ptr), tl.load(sw_ptr + t * sw_stride)
        for start in range(0, V, BLOCK):
            c = start + tl.arange(0, BLOCK)
            l = tl.load(row + c, mask=c < V, other=0.0).to(tl.float32)
            s, p, hit, _ = block_terms(l, c, lse, cols_ptr, wts_ptr, t, inv_c, shift, cap, K, BLOCK, True)
            d = pr261_gradient(g, s_w_all, p, hit, s, slope, inv_scale, top)
            if ROUND:
                d = d.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(out_ptr + t * out_stride + c, d, mask=c < V)

    _FUSED_CE_KERNELS = (rows_kernel, dlogits_kernel, rows_dlogits_kernel)
    return _FUSED_CE_KERNELS


_FUSED_CE_KERNELS = None
# the kernels' Triton helpers, made with them (_fused_ce_kernels)
bf16_rounded = row_lse_and_loss = block_terms = pr261_gradient = None
_CAP_ARGS = dict(inv_c=1 / SIGMOID_TEMPERATURE, shift=SIGMOID_SHIFT / SIGMOID_TEMPERATURE, cap=SIGMOID_CAP)


def _fused_ce_rows_triton(logits, cols, wts, block: int = 1024, variant: str = "pr252"):
    """_fused_ce_rows_torch's result from the Triton kernel (one program per row)."""
    rows_kernel = _fused_ce_kernels()[0]
    T, V = logits.shape
    lse, loss = (torch.empty(T, dtype=torch.float32, device=logits.device) for _ in range(2))
    extra = dict(PR261=True) if variant == "pr261" else {}
    rows_kernel[(T,)](logits, cols.contiguous(), wts.contiguous(), lse, loss, V, logits.stride(0),
                      K=cols.shape[1], BLOCK=block, num_warps=4, **_CAP_ARGS, **extra)
    return loss, lse


def _fused_ce_dlogits_triton(logits, lse, cols, wts, g, scale, out_dtype, block: int = 1024,
                             variant: str = "pr252", s_w_all: Optional[torch.Tensor] = None):
    """_fused_ce_dlogits_torch's result from the Triton kernel (one program per row and column block)."""
    dlogits_kernel = _fused_ce_kernels()[1]
    T, V = logits.shape
    out = torch.empty(T, V, dtype=out_dtype, device=logits.device)
    slope, extra = SIGMOID_CAP / SIGMOID_TEMPERATURE, {}
    if variant == "pr261":  # the factors as #261 rounds them to fp32
        slope, inv_scale = _fused_ce_pr261_factors(scale)
        s_w = s_w_all.float().reshape(-1).contiguous()
        extra = dict(PR261=True, sw_ptr=s_w, inv_scale=inv_scale, top=torch.finfo(out_dtype).max,
                     sw_stride=0 if s_w.numel() == 1 else 1)
    dlogits_kernel[(T, -(-V // block))](
        logits, lse, cols.contiguous(), wts.contiguous(), g.float().contiguous(), out, V, logits.stride(0),
        out.stride(0), slope=slope, scale=float(scale), K=cols.shape[1], BLOCK=block,
        ROUND=out_dtype != torch.float32, num_warps=4, **_CAP_ARGS, **extra)
    return out


def _fused_ce261_rows_dlogits_triton(logits, cols, wts, g, scale, out_dtype, s_w_all, block: int = 1024):
    """(loss, LSE, dL/dl): _fused_ce_rows_triton's and _fused_ce_dlogits_triton's pr261 results from the
    one-pass kernel (one program per row, the logits read while in the cache: #261's one kernel)."""
    kernel = _fused_ce_kernels()[2]
    T, V = logits.shape
    lse, loss = (torch.empty(T, dtype=torch.float32, device=logits.device) for _ in range(2))
    out = torch.empty(T, V, dtype=out_dtype, device=logits.device)
    slope, inv_scale = _fused_ce_pr261_factors(scale)
    s_w = s_w_all.float().reshape(-1).contiguous()
    kernel[(T,)](logits, cols.contiguous(), wts.contiguous(), lse, loss, g.float().contiguous(), out, s_w, V,
                 logits.stride(0), out.stride(0), slope=slope, inv_scale=inv_scale, top=torch.finfo(out_dtype).max,
                 sw_stride=0 if s_w.numel() == 1 else 1, K=cols.shape[1], BLOCK=block,
                 ROUND=out_dtype != torch.float32, num_warps=4, **_CAP_ARGS)
    return loss, lse, out


def _fused_ce_logits(h: torch.Tensor, H: torch.Tensor, transposed: bool, fp8: bool, s_x: float,
                     s_w: float) -> torch.Tensor:
    """l = h H (T, V): bf16 from FP8 codes with fp8, as the records' kernel stores them; else h's dtype."""
    if fp8:
        return fp8_head_logits(*fp8_head_codes(h, H, (s_x, s_w)), transposed, (s_x, s_w), torch.bfloat16)
    W = H.to(h.dtype)
    return h @ W if transposed else F.linear(h, W)


def _fused_ce_forward(h: torch.Tensor, H: torch.Tensor, cols: torch.Tensor, wts: torch.Tensor, transposed: bool,
                      fp8: bool, s_x: float, s_w: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss: the fp32 token sum, logits (T, V), LSE (T,) fp32). H is (V, d), or (d, V) if transposed."""
    logits = _fused_ce_logits(h, H, transposed, fp8, s_x, s_w)
    rows = _fused_ce_rows_triton if logits.is_cuda else _fused_ce_rows_torch
    loss, lse = rows(logits, cols, wts)
    return loss.sum(), logits, lse


def _fused_ce261_forward(h: torch.Tensor, H: torch.Tensor, cols: torch.Tensor, wts: torch.Tensor,
                         s_w_all: torch.Tensor, transposed: bool, fp8: bool, s_x: float, s_w: float, s_g: float,
                         grad_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pr261 variant: (loss: the fp32 token sum, dL/dl for the upstream gradient grad_scale): with
    fp8 its e5m2 codes / s_g (s_g already times grad_scale), else in h's dtype. The logits are formed
    once per micro-batch. CUDA: one Triton program per row makes the loss and the gradient in one pass
    (#261's one kernel); the CPU path runs the two torch halves one after the other (the same values)."""
    logits = _fused_ce_logits(h, H, transposed, fp8, s_x, s_w)
    g = torch.full((), grad_scale, dtype=torch.float32, device=logits.device)
    scale, out_dtype = (s_g if fp8 else 1.0), (torch.float8_e5m2 if fp8 else h.dtype)
    if logits.is_cuda:
        loss, _, dl = _fused_ce261_rows_dlogits_triton(logits, cols, wts, g, scale, out_dtype, s_w_all)
        return loss.sum(), dl
    loss, lse = _fused_ce_rows_torch(logits, cols, wts, variant="pr261")
    dl = _fused_ce_dlogits_torch(logits, lse, cols, wts, g, scale, out_dtype, variant="pr261", s_w_all=s_w_all)
    return loss.sum(), dl


def _fused_ce_head_backward(dl: torch.Tensor, h: torch.Tensor, H: torch.Tensor, transposed: bool, fp8: bool,
                            s_x: float, s_w: float, s_g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh in h's dtype, dH in H's dtype) from dL/dl: e5m2 codes of dL/dl / s_g with fp8, else in h's dtype."""
    if fp8:  # the codes of h and H are made again (one elementwise pass) rather than kept
        x8, w8 = fp8_head_codes(h, H, (s_x, s_w, s_g))
        return fp8_head_backward(dl, x8, w8, transposed, (s_x, s_w, s_g), h.dtype, H.dtype)
    W = H.to(h.dtype)
    dh = dl @ W.t() if transposed else dl @ W
    dH = h.t() @ dl if transposed else dl.t() @ h
    return dh, dH.to(H.dtype)


def _fused_ce_backward(g: torch.Tensor, h: torch.Tensor, H: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                       cols: torch.Tensor, wts: torch.Tensor, transposed: bool, fp8: bool, s_x: float, s_w: float,
                       s_g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh in h's dtype, dH in H's dtype) for the upstream gradient g (a scalar)."""
    dlogits = _fused_ce_dlogits_triton if logits.is_cuda else _fused_ce_dlogits_torch
    dl = dlogits(logits, lse, cols, wts, g, s_g if fp8 else 1.0, torch.float8_e5m2 if fp8 else h.dtype)
    return _fused_ce_head_backward(dl, h, H, transposed, fp8, s_x, s_w, s_g)


def fused_ce_ops():
    """The halves as torch.library custom ops (torch.compile keeps each as one opaque call; a fake
    version gives it the shapes), registered once per process: a second copy of this module
    (records/diff.py loads scripts by path) finds them already there. Returns (forward, backward,
    the pr261 forward, the backward from a given dL/dl)."""
    names = ("fused_ce_forward", "fused_ce_backward", "fused_ce261_forward", "fused_ce_head_backward")
    try:
        return tuple(getattr(torch.ops.gpt_medium, n) for n in names)
    except (AttributeError, RuntimeError):
        pass
    schemas = {
        "fused_ce_forward": (_fused_ce_forward, "(Tensor h, Tensor H, Tensor cols, Tensor wts, bool transposed, "
                             "bool fp8, float s_x, float s_w) -> (Tensor, Tensor, Tensor)"),
        "fused_ce_backward": (_fused_ce_backward, "(Tensor g, Tensor h, Tensor H, Tensor logits, Tensor lse, "
                              "Tensor cols, Tensor wts, bool transposed, bool fp8, float s_x, float s_w, float s_g) "
                              "-> (Tensor, Tensor)"),
        "fused_ce261_forward": (_fused_ce261_forward, "(Tensor h, Tensor H, Tensor cols, Tensor wts, Tensor s_w_all, "
                                "bool transposed, bool fp8, float s_x, float s_w, float s_g, float grad_scale) "
                                "-> (Tensor, Tensor)"),
        "fused_ce_head_backward": (_fused_ce_head_backward, "(Tensor dl, Tensor h, Tensor H, bool transposed, "
                                   "bool fp8, float s_x, float s_w, float s_g) -> (Tensor, Tensor)")}

    def fake_forward(h, H, cols, wts, transposed, fp8, s_x, s_w):
        T, V = h.shape[0], H.shape[1] if transposed else H.shape[0]
        return (h.new_empty((), dtype=torch.float32), h.new_empty((T, V), dtype=torch.bfloat16 if fp8 else h.dtype),
                h.new_empty((T,), dtype=torch.float32))

    def fake_forward261(h, H, cols, wts, s_w_all, transposed, fp8, s_x, s_w, s_g, grad_scale):
        T, V = h.shape[0], H.shape[1] if transposed else H.shape[0]
        return (h.new_empty((), dtype=torch.float32),
                h.new_empty((T, V), dtype=torch.float8_e5m2 if fp8 else h.dtype))

    fakes = {"fused_ce_forward": fake_forward, "fused_ce261_forward": fake_forward261,
             "fused_ce_backward": lambda g, h, H, *rest: (torch.empty_like(h), torch.empty_like(H)),
             "fused_ce_head_backward": lambda dl, h, H, *rest: (torch.empty_like(h), torch.empty_like(H))}
    for name in names:  # each one missing (an older copy of this module may have registered only some)
        try:
            getattr(torch.ops.gpt_medium, name)
        except (AttributeError, RuntimeError):
            fn, schema = schemas[name]
            torch.library.custom_op(f"gpt_medium::{name}", fn, mutates_args=(), schema=schema).register_fake(
                fakes[name])
    return tuple(getattr(torch.ops.gpt_medium, n) for n in names)


# =============================================================================
# 4. FlashAttention-3 (--attention=fa3): the record's attention kernel, fetched from the kernels hub


FA3_KERNEL = "varunneal/flash-attention-3"
_fa3_kernel: dict = {}


def flash_attention_3():
    """FA3's flash_attn_varlen_func, fetched on first use (needs the Hugging Face `kernels` package,
    whose name this file does not take, and, for the download, network access; a Hopper GPU to run)."""
    if "varlen" not in _fa3_kernel:
        from kernels import get_kernel
        _fa3_kernel["varlen"] = get_kernel(FA3_KERNEL).flash_attn_interface.flash_attn_varlen_func
    return _fa3_kernel["varlen"]
