"""--prefix_loss_weight (docs/short-track-transfer.md section 7, #337): the prefix table against the
hand-worked GPT-2 examples and a plain-Python longest-prefix loop; the loss and dL/dlogits of every
training-loss path (the multi-token loss, both fused variants' emulations, their Triton kernels under
TRITON_INTERPRET=1) against a float64 loop; the weight's schedule at the phase edges; the switch off
(and the term off) bit for bit; validation unchanged."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
import triton_kernels as kernels
from test_bulk_model import FOUR_BLOCKS

ROOT = Path(tg.__file__).resolve().parent
MTP = [1.0, 0.5, 0.25]
W = 0.25


def gpt2_tokens():
    lengths = np.load(ROOT / "data" / "gpt2_token_bytes.npy")
    return tg.token_strings(lengths, (ROOT / "data" / "gpt2_tokens.bin").read_bytes())


def plain_longest_prefix(tokens):
    """The definition, written out: for each token, its bytes cut one shorter at a time until a token
    has them (the lowest id of equal ones); -1 if none does."""
    first = {}
    for i, b in enumerate(tokens):
        if b and b not in first:
            first[b] = i
    table = []
    for b in tokens:
        found = -1
        for n in range(len(b) - 1, 0, -1):
            if b[:n] in first:
                found = first[b[:n]]
                break
        table.append(found)
    return np.array(table, dtype=np.int64)


def prefix_config(synthetic_dir, **overrides):
    """The tiny model with the prefix term, on FOUR_BLOCKS: the term is the loss's, after the last
    block, the same at any depth."""
    flags = dict(dtype="float32", untie_embed_after_step=0, prefix_loss_weight=W,
                 token_bytes_file=str(synthetic_dir / "synthetic_token_bytes.npy"), **FOUR_BLOCKS)
    return tg.make_config("tiny", **{**flags, **overrides})


# ---- the table


def test_the_gpt2_table_has_the_hand_worked_examples():
    config = tg.make_config("medium", prefix_loss_weight=W)
    table = tg.prefix_table(config)
    tokens = gpt2_tokens()
    assert table.shape == (50304,) and table.dtype == np.int64
    for token, prefix, text in ((464, 817, b"Th"), (2068, 45567, b" qui"), (7586, 4772, b" brow"),
                                (21831, 11511, b" fo"), (4772, 1379, b" bro")):
        assert table[token] == prefix and tokens[prefix] == text
    assert tokens[7586] == b" brown" and tokens[464] == b"The"
    assert (table >= 0).sum() == 50_000  # every multi-byte token
    assert (table[:256] == -1).all() and table[50256] == -1 and (table[50257:] == -1).all()


def test_the_gpt2_table_equals_a_plain_python_loop():
    tokens = gpt2_tokens()
    assert np.array_equal(tg.longest_prefix_table(tokens), plain_longest_prefix(tokens))


def test_the_table_skips_empty_tokens_and_takes_the_lowest_of_equal_ones():
    tokens = [b"a", b"ab", b"abc", b"", b"abd", b"b", b"ab", b"abcd", b"abce", b"x"]
    expected = [-1, 0, 1, -1, 1, -1, 0, 2, 2, -1]
    assert tg.longest_prefix_table(tokens).tolist() == expected == plain_longest_prefix(tokens).tolist()


def test_the_synthetic_data_has_made_up_bytes_of_its_lengths(synthetic_dir):
    lengths = np.load(synthetic_dir / "synthetic_token_bytes.npy")
    blob = (synthetic_dir / "synthetic_tokens.bin").read_bytes()
    assert len(blob) == int(lengths.astype(np.int64).sum())
    tokens = tg.token_strings(lengths, blob)
    assert [len(t) for t in tokens] == lengths.tolist()
    table = tg.prefix_table(prefix_config(synthetic_dir))
    assert np.array_equal(table[:500], plain_longest_prefix(tokens)) and (table[500:] == -1).all()
    assert ((table[:500] >= 0) == (lengths > 1)).all()  # every multi-byte token has one, as in GPT-2
    assert len(set(lengths[table[:500][table[:500] >= 0]])) > 2  # prefixes of several lengths


def test_the_model_holds_the_table_outside_its_state_dict(synthetic_dir):
    model = tg.build_model(prefix_config(synthetic_dir))
    assert np.array_equal(model.prefix.table.numpy(), tg.prefix_table(model.config))
    assert not any(k.startswith("prefix") for k in model.state_dict())
    assert tg.build_model(tg.make_config("tiny")).prefix is None  # off: nothing built


def test_missing_or_mismatched_byte_files_are_refused_in_one_line(synthetic_dir, tmp_path):
    lengths = np.load(synthetic_dir / "synthetic_token_bytes.npy")
    np.save(tmp_path / "x_token_bytes.npy", lengths)
    config = prefix_config(synthetic_dir, token_bytes_file=str(tmp_path / "x_token_bytes.npy"))
    with pytest.raises(tg.ConfigError, match=r"^--prefix_loss_weight: .*x_tokens.bin.* is missing; make it"):
        tg.prefix_table(config)
    (tmp_path / "x_tokens.bin").write_bytes(b"ab")
    with pytest.raises(tg.ConfigError, match="holds 2 bytes"):
        tg.prefix_table(config)


def test_the_tiny_data_of_an_older_checkout_gets_its_bytes_file_when_the_prefix_asks(tmp_path, monkeypatch):
    """data/synthetic/ written before the bytes file existed: a run without the prefix leaves it as it
    is; one with it writes the data again (the same shards and lengths: the same seeds), bytes included."""
    monkeypatch.chdir(tmp_path)
    tg.ensure_synthetic_data(tg.make_config("tiny"))
    folder = tmp_path / "data" / "synthetic"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "synthetic_tokens.bin").unlink()
    tg.ensure_synthetic_data(tg.make_config("tiny"))
    assert not (folder / "synthetic_tokens.bin").exists()
    tg.ensure_synthetic_data(tg.make_config("tiny", prefix_loss_weight=W))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert (tg.prefix_table(tg.make_config("tiny", prefix_loss_weight=W))[:500] >= 0).sum() > 300


@pytest.mark.parametrize("flags, message", [
    (dict(multi_token_prediction=False), "--prefix_loss_weight: follows the multi-token phases"),
    (dict(token_bytes_file=""), "--prefix_loss_weight: its table comes from --token_bytes_file"),
    (dict(prefix_loss_weight=-0.1), "--prefix_loss_weight: -0.1 is not allowed")])
def test_configurations_it_cannot_serve_are_refused(flags, message):
    with pytest.raises(tg.ConfigError, match=message):
        tg.make_config("tiny", **{"prefix_loss_weight": W, **flags})


# ---- the schedule


def test_the_weight_follows_the_multi_token_phases():
    """S = 188 (tiny): three weights while step/S < 1/12 (steps 0..15), two while < 2/12 (16..31), then
    one; w is 0.25, then falls as the second multi-token weight does (w / 0.5 of it), then none."""
    config = tg.make_config("tiny", prefix_loss_weight=W)
    S = tg.scheduled_steps(config)
    assert S == 188
    at = lambda step: tg.prefix_loss_weight_at(step, config)
    assert at(0) == at(15) == W and len(tg.multi_token_weights(15, config)) == 3
    assert len(tg.multi_token_weights(16, config)) == 2 and at(16) == pytest.approx(W * (1 - (3 * 16 / 47 - 1)))
    assert 0 < at(31) < at(16) < W and at(31) == pytest.approx(W * (2 - 3 * 31 / 47))
    assert at(32) is None and len(tg.multi_token_weights(32, config)) == 1
    for step in range(config.num_iterations):
        weights, w = tg.multi_token_weights(step, config), at(step)
        assert (w is None) == (len(weights) == 1), step
        if len(weights) == 2:
            assert w == pytest.approx(W * weights[1] / 0.5, abs=1e-12)
    assert at(S) is None and at(config.num_iterations - 1) is None  # the extension
    medium = tg.make_config("medium", prefix_loss_weight=0.5)  # S = 4700: edges at 391.67 and 783.33
    assert tg.prefix_loss_weight_at(391, medium) == 0.5 > tg.prefix_loss_weight_at(392, medium)
    assert tg.prefix_loss_weight_at(783, medium) > 0 and tg.prefix_loss_weight_at(784, medium) is None


def test_the_runner_sets_each_steps_weight(synthetic_dir):
    runner = tg.Runner(prefix_config(synthetic_dir), torch.device("cpu"))
    prefix, batches = runner.model.prefix, runner.random_batches(torch.Generator().manual_seed(1))
    for step, active in ((0, True), (20, True), (40, False)):
        runner.train_step(step, batches)
        assert prefix.active == active
        if active:
            assert prefix.weight.item() == np.float32(tg.prefix_loss_weight_at(step, runner.config))


# ---- the loss and its gradient against a float64 loop

V_TINY = 500


def crafted_targets(table, T=24, seed=0):
    """Targets with ids of no prefix (one byte, end-of-text), prefix targets equal to the second and to
    the third multi-token target, and the last rows with a prefix."""
    gen = torch.Generator().manual_seed(seed)
    has = np.flatnonzero(table[:V_TINY] >= 0)
    none = [i for i in np.flatnonzero(table[:V_TINY] < 0) if i != V_TINY - 1]
    y = torch.tensor(has[torch.randint(0, len(has), (T,), generator=gen).numpy()])
    y[3], y[4] = int(none[0]), V_TINY - 1  # one byte; end-of-text
    y[7] = int(table[int(y[6])])  # p(y_6) = y_7, position 6's second target
    y[12] = int(table[int(y[10])])  # p(y_10) = y_12, its third
    y[T - 1] = int(has[5])
    assert min(table[int(y[t])] for t in (6, 10, T - 1)) >= 0 and table[int(y[3])] == table[int(y[4])] == -1
    return y


def reference(z, y, weights, table, w, s_w_all=False):
    """(loss, dL/dz) in float64 by loops: row t's terms are w_k (LSE_t - z_t[y_(t+k)]) for t+k < T and
    w (LSE_t - z_t[p(y_t)]) where p(y_t) >= 0; dL/dz_t = S_w(t) softmax(z_t) - the terms' weights on their
    columns. s_w_all (#261): S_w(t) counts every multi-token weight on every row."""
    z = z.double()
    T = z.shape[0]
    lse, p = torch.logsumexp(z, 1), torch.softmax(z, 1)
    loss, grad = 0.0, torch.zeros_like(z)
    for t in range(T):
        terms = [(int(y[t + k]), wk) for k, wk in enumerate(weights) if t + k < T]
        if table[int(y[t])] >= 0:
            terms.append((int(table[int(y[t])]), w))
        s_w = sum(wk for _, wk in terms)
        if s_w_all:
            s_w = sum(weights) + (w if table[int(y[t])] >= 0 else 0.0)
        for col, wk in terms:
            loss += wk * (lse[t] - z[t, col]).item()
            grad[t, col] -= wk
        grad[t] += s_w * p[t]
    return torch.tensor(loss, dtype=torch.float64), grad


@pytest.fixture(scope="module")
def case(synthetic_dir):
    table = tg.prefix_table(prefix_config(synthetic_dir))
    y = crafted_targets(table)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(len(y), 32, generator=gen)
    h = h * h.square().mean(1, keepdim=True).rsqrt()
    H = torch.randn(512, 32, generator=gen) * 0.5
    return table, y, h, H


def test_the_multi_token_loss_with_the_prefix_column_equals_the_float64_loop(synthetic_dir, case):
    """GPT.loss in training (the plain path), its logits replaced by a leaf z: the loss and dL/dz."""
    table, y, _, _ = case
    model = tg.build_model(prefix_config(synthetic_dir))
    model.train()
    z = (torch.randn(len(y), 512, generator=torch.Generator().manual_seed(5)) * 3).requires_grad_()
    model.logits = lambda xc: z[xc[:, 0].long()]  # each row of x names its row of z
    x = torch.arange(len(y)).float()[:, None].expand(-1, model.config.model_dim)
    loss = model.loss(x, y, 1, "sum", False, torch.tensor(MTP))
    loss.backward()
    ref_loss, ref_grad = reference(z.detach(), y, MTP, table, W)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(z.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    without, _ = reference(z.detach(), y, MTP, np.full_like(table, -1), W)
    assert abs(ref_loss - without) > 1  # the term is there
    # two micro-chunks (activation checkpointing's loss chunks) give the same
    z.grad = None
    model.loss(x, y, 2, "sum", True, torch.tensor(MTP)).backward()
    torch.testing.assert_close(z.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


def test_without_multi_token_weights_the_prefix_term_is_still_added(synthetic_dir, case):
    table, y, _, _ = case
    model = tg.build_model(prefix_config(synthetic_dir))
    model.train()
    z = torch.randn(len(y), 512, generator=torch.Generator().manual_seed(6)).requires_grad_()
    model.logits = lambda xc: z
    loss = model.loss(torch.zeros(len(y), model.config.model_dim), y, 1, "sum", False, None)
    torch.testing.assert_close(loss.double(), reference(z.detach(), y, [1.0], table, W)[0], rtol=1e-6, atol=0)


def capped(l):
    return 23 * torch.sigmoid((l.double() + 5) / 7.5)


def test_the_pr252_emulation_equals_the_float64_loop(case):
    """fused_softcap_ce with the prefix: the loss, dL/dl (from the emulation's gradient function) and
    dh, dH (through the op's backward) against the float64 loop on z = 23 sigmoid((l + 5) / 7.5)."""
    table, y, h, H = case
    prefix = (torch.from_numpy(table)[y], torch.tensor([W]))
    a, b = h.clone().requires_grad_(), H.clone().requires_grad_()
    loss = tg.fused_softcap_ce(a, b, y, torch.tensor(MTP), prefix=prefix)
    loss.backward()
    l = h @ H.t()
    s = torch.sigmoid((l.double() + 5) / 7.5)
    ref_loss, dz = reference(capped(l), y, MTP, table, W)
    dl = dz * 23 / 7.5 * s * (1 - s)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    cols, wts = kernels.fused_ce_terms(y, torch.tensor(MTP), 512, *prefix)
    assert cols.shape == (len(y), 4) and (cols[4, 3] == -1) and (cols[3, 3] == -1) and wts[4, 3] == 0
    lse = kernels._fused_ce_rows_torch(l, cols, wts)[1]
    ours = kernels._fused_ce_dlogits_torch(l, lse, cols, wts, torch.tensor(1.0), 1.0, torch.float32)
    torch.testing.assert_close(ours.double(), dl, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(a.grad.double(), dl @ H.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad.double(), dl.t() @ h.double(), rtol=1e-5, atol=1e-6)


def test_the_pr261_emulation_equals_the_float64_loop(case):
    """pr261: sigma rounded to bf16, dL/dl made in the forward for grad_scale 0.5, S_w every multi-token
    weight plus w where p(y_t) >= 0 (#337's kernel), the last rows included."""
    table, y, h, H = case
    prefix = (torch.from_numpy(table)[y], torch.tensor([W]))
    loss = tg.fused_softcap_ce(h.clone().requires_grad_(), H.clone().requires_grad_(), y, torch.tensor(MTP),
                               variant="pr261", grad_scale=0.5, prefix=prefix)
    dl = loss.grad_fn.saved_tensors[0]
    l = h @ H.t()
    s = (0.5 + 0.5 * torch.tanh((l / 7.5 + 5 / 7.5) / 2)).bfloat16().double()
    ref_loss, dz = reference(23 * s, y, MTP, table, W, s_w_all=True)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(dl.double(), 0.5 * dz * 23 / 7.5 * s * (1 - s), rtol=1e-5, atol=1e-8)
    # S_w on the rows without a prefix (3: one byte, 4: end-of-text) is the weights' sum alone
    no_prefix, _ = reference(23 * s, y, MTP, np.full_like(table, -1), W, s_w_all=True)
    assert ref_loss - no_prefix > 1


def test_the_fused_model_paths_equal_the_plain_one(synthetic_dir):
    """Runner.train_step at step 0 (w = 0.25, three weights), fp32: pr252's gradients are the plain
    multi-token loss's up to fp32 order; pr261's (bf16 sigma) within 1 %; without the prefix they differ."""
    grads = {}
    for name, flags in (("plain", {}), ("pr252", dict(fused_softcap_ce=True)),
                        ("pr261", dict(fused_softcap_ce=True, fused_ce_variant="pr261")),
                        ("off", dict(prefix_loss_weight=0.0)),
                        ("pr252_fp8", dict(fused_softcap_ce=True, fp8=True)),
                        ("pr261_fp8", dict(fused_softcap_ce=True, fused_ce_variant="pr261", fp8=True))):
        runner = tg.Runner(prefix_config(synthetic_dir, **flags), torch.device("cpu"))
        with torch.no_grad():
            runner.model.head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        seen = grads.setdefault(name, {})
        for opt in runner.optimizers:
            opt.step = lambda *a, seen=seen, model=runner.model: seen.update(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        runner.train_step(1, runner.random_batches(torch.Generator().manual_seed(4)))
    flat = {k: torch.cat([g.flatten() for g in v.values()]) for k, v in grads.items()}
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(flat["pr252"], flat["plain"]) < 1e-5
    assert rel(flat["pr261"], flat["plain"]) < 0.01
    assert rel(flat["off"], flat["plain"]) > 0.01
    for name in ("pr252_fp8", "pr261_fp8"):  # FP8's gradient codes: a few % (docs/fused-ce.md)
        assert rel(flat[name], flat["plain"]) < 0.5 * rel(flat["off"], flat["plain"]), name


def test_the_training_forward_with_the_prefix_traces_into_one_graph(synthetic_dir):
    """Static shapes, no host syncs: the training forward with the multi-token weights and the prefix
    term, traced whole, equals the eager one; the term set off (the third phase) traces too and then
    equals the forward of a model without the prefix."""
    from test_bulk_model import WINDOW, fill_random, packed
    config = prefix_config(synthetic_dir)
    model = tg.build_model(config)
    fill_random(model)
    model.train()
    inputs, targets = packed(config)
    mtp = torch.tensor(MTP)
    traced = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    got, want = traced(inputs, targets, WINDOW, mtp_weights=mtp), model(inputs, targets, WINDOW, mtp_weights=mtp)
    assert torch.equal(got, want)
    model.prefix.set_weight(None)
    off = tg.build_model(prefix_config(synthetic_dir, prefix_loss_weight=0.0))
    fill_random(off)
    off.train()
    plain = traced(inputs, targets, WINDOW, mtp_weights=mtp)
    assert torch.equal(plain, off(inputs, targets, WINDOW, mtp_weights=mtp)) and not torch.equal(plain, got)


# ---- off: bit for bit; validation unchanged


def test_off_and_outside_its_phases_the_loss_and_gradients_are_bit_for_bit(synthetic_dir):
    """prefix_loss_weight 0 builds nothing; with it on, a step past the two multi-token phases (w none)
    gives the record's loss and gradients to the last bit, and so does a model whose term is set off."""
    results = []
    for w in (0.0, W):
        runner = tg.Runner(prefix_config(synthetic_dir, prefix_loss_weight=w), torch.device("cpu"))
        assert (runner.model.prefix is None) == (w == 0)
        seen = {}
        for opt in runner.optimizers:
            opt.step = lambda *a, seen=seen, model=runner.model: seen.update(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        loss = runner.train_step(41, runner.random_batches(torch.Generator().manual_seed(4)))
        results.append((loss, seen))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    on, off = tg.build_model(prefix_config(synthetic_dir)), tg.build_model(prefix_config(synthetic_dir,
                                                                                         prefix_loss_weight=0.0))
    tokens = torch.randint(0, 500, (513,), generator=torch.Generator().manual_seed(8))
    losses = []
    for model in (on, off):
        model.train()
        if model.prefix is not None:
            model.prefix.set_weight(None)
        loss = model(tokens[:-1].int(), tokens[1:], torch.tensor([3, 1]), mtp_weights=torch.tensor(MTP))
        loss.backward()
        losses.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(losses[0][1][n], losses[1][1][n]) for n in losses[1][1])


def test_validation_is_unchanged(synthetic_dir):
    """Runner.evaluate with the term on (and active) and off: the same validation loss, bit for bit."""
    vals = []
    for w in (W, 0.0):
        config = prefix_config(synthetic_dir, prefix_loss_weight=w, val_tokens=2048)
        runner = tg.Runner(config, torch.device("cpu"))
        with torch.no_grad():
            runner.model.head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        if runner.model.prefix is not None:
            runner.model.prefix.set_step(0)
            assert runner.model.prefix.active
        val = tg.read_shard(next(iter(sorted(synthetic_dir.glob("synthetic_val_*.bin")))))[:config.val_tokens + 1]
        vals.append(runner.evaluate(0, val))
    assert vals[0] == vals[1]


# ---- the Triton kernels, run by Triton's interpreter on the CPU (a process of its own)

KERNEL_SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import triton_kernels as kernels
logits, cols, wts, lse, lse261, g, s_w_rows = torch.load(sys.argv[2])
out = {"rows": kernels._fused_ce_rows_triton(logits, cols, wts, block=128),
       "rows261": kernels._fused_ce_rows_triton(logits, cols, wts, block=128, variant="pr261"),
       "dl": kernels._fused_ce_dlogits_triton(logits, lse, cols, wts, g, 1.0, torch.float32, block=128),
       "dl261": kernels._fused_ce_dlogits_triton(logits, lse261, cols, wts, g, 1.0, torch.float32, block=128,
                                                 variant="pr261", s_w_all=s_w_rows)}
torch.save(out, sys.argv[3])
"""


@pytest.fixture(scope="module")
def kernel_run(case, tmp_path_factory):
    """The crafted case's terms with the prefix column (K + 1 = 4), V = 500 columns (not a multiple of the
    128-column blocks), per-row S_w for pr261 as fused_softcap_ce forms it."""
    pytest.importorskip("triton")
    table, y, h, H = case
    logits = (h @ H[:500].t()).bfloat16()
    prefix = (torch.from_numpy(table)[y], torch.tensor([W]))
    cols, wts = kernels.fused_ce_terms(y, torch.tensor(MTP), 500, *prefix)
    s_w_rows = (wts[:, -1] + MTP[0]) + MTP[1] + MTP[2]
    lse = kernels._fused_ce_rows_torch(logits, cols, wts)[1]
    lse261 = kernels._fused_ce_rows_torch(logits, cols, wts, variant="pr261")[1]
    given = (logits, cols, wts, lse, lse261, torch.tensor(1.25), s_w_rows)
    folder = tmp_path_factory.mktemp("prefix_kernel")
    torch.save(given, folder / "in.pt")
    subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, str(ROOT), str(folder / "in.pt"), str(folder / "out.pt")],
                   check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    return given, torch.load(folder / "out.pt")


def test_the_kernels_with_the_prefix_column_equal_the_emulation(kernel_run):
    (logits, cols, wts, lse, lse261, g, s_w_rows), out = kernel_run
    for name, variant in (("rows", "pr252"), ("rows261", "pr261")):
        ref_loss, ref_lse = kernels._fused_ce_rows_torch(logits, cols, wts, variant=variant)
        torch.testing.assert_close(out[name][1], ref_lse, rtol=1e-6, atol=0)
        torch.testing.assert_close(out[name][0], ref_loss, rtol=1e-5, atol=1e-5)
    ref = kernels._fused_ce_dlogits_torch(logits, lse, cols, wts, g, 1.0, torch.float32)
    torch.testing.assert_close(out["dl"], ref, rtol=1e-5, atol=1e-12)
    ref261 = kernels._fused_ce_dlogits_torch(logits, lse261, cols, wts, g, 1.0, torch.float32, variant="pr261",
                                            s_w_all=s_w_rows)
    torch.testing.assert_close(out["dl261"], ref261, rtol=1e-5, atol=1e-12)
    # a kernel reading one S_w for all rows would differ on the rows without a prefix (3 and 4)
    one_s_w = kernels._fused_ce_dlogits_torch(logits, lse261, cols, wts, g, 1.0, torch.float32, variant="pr261",
                                             s_w_all=s_w_rows[:1])
    assert not torch.allclose(out["dl261"][3:5], one_s_w[3:5], rtol=1e-4, atol=0)
