"""A slow, literal implementation of the live model's forward pass (docs/bulk-model.md, and the seed
ideas of docs/ideas.md), used as the oracle of the model tests: float64, explicit loops, written
from the description rather than from the trainer's code."""
import math

import torch


def reference_loss(model, ids, targets, long_w, short_w, mtp_weights=None):
    """The loss of one packed sequence in float64, from the model's parameters: the input embeddings
    (x00 from the head while tied, smeared; x01.. ; LoRE tables as table @ proj^T), residual and
    per-embedding weights, U-net skips (gated or one weight), pre-norm attention (lambdas on the
    weights, no v norm, value embeddings from native/grouped tables or a coefficient basis, gated
    per head, rotary with YaRN's frequencies, key offset on the long layers, token windows, output
    gate), the MLP, backout, x00 at the output, the LoRE or plain head, the soft cap; in training the
    (multi-token) loss reduced as --train_loss_reduction says, in evaluation the mean."""
    cfg = model.config
    P = {name: p.detach().double() for name, p in model.named_parameters()}
    L, H, D, bs = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.attn_block_size
    n_skips, n_embeds = len(cfg.skip_connections), 1 + cfg.num_extra_embeds

    # the scalar vector, slot by slot in the documented order
    scalars, at = P["scalars"], 0

    def take(n):
        nonlocal at
        at += n
        return scalars[at - n:at]

    skip_w = None if cfg.gated_skips else take(L)
    resid, sa = take(L), take(2 * L).view(L, 2)
    smear_weight = take(1)[0] if cfg.smear_embed else None
    gains = take(n_skips) if cfg.gated_skips else None
    x0_lambdas = P["x0_lambdas"].view(L, n_embeds)

    def norm(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True))

    def table(e):  # input embedding e as a (rows, d) matrix
        if cfg.lore_input:
            return P[f"embeds.{e}.table.weight"] @ P[f"embeds.{e}.proj"].T
        return P[f"embeds.{e}.weight"]

    head = P["head.up"] @ P["head.down"] if cfg.lore_output else P["head.weight"]
    ids_l, T = ids.long(), ids.numel()
    e = head[ids_l] if model.embed_tied else table(0)[ids_l]
    if cfg.smear_embed:
        smeared = e.clone()
        for t in range(1, T):
            g = torch.sigmoid(e[t, :16] @ P["smear_gate.weight"][0])
            smeared[t] = e[t] + smear_weight * g * e[t - 1]
        e = smeared
    x0s = [norm(e)] + [norm(table(j)[ids_l]) for j in range(1, n_embeds)]

    # value embeddings: layer i's table, or its mix of the basis tables
    def value_embedding(i):
        if cfg.value_embed_layout[i] is None:
            return None
        if cfg.ve_mode in ("native", "grouped"):
            return P[f"value_embeds.tables.{cfg.value_embed_layout[i]}.weight"][ids_l]
        A = model.value_embeds.coeffs.detach().double()  # a buffer when frozen
        return sum(A[i, k] * P[f"value_embeds.tables.{k}.weight"][ids_l] for k in range(A.size(1)))

    docs = torch.cumsum(ids_l == cfg.eot_token, 0)
    q_pos, k_pos = torch.arange(T)[:, None], torch.arange(T)[None, :]
    masks = {w: (k_pos <= q_pos) & (docs[:, None] == docs[None, :]) & (q_pos - k_pos <= w * bs)
             for w in (long_w, short_w)}
    quarter = D // 4
    freqs = [(1 / cfg.rope_base) ** (j / (quarter - 1)) for j in range(quarter)] + [0.0] * quarter
    scale = cfg.attn_scale
    for old, new in model.rotary.changes:  # YaRN, one frequency at a time
        for j, w in enumerate(freqs):
            g = min(max((bs * old * w / (2 * math.pi) - 1) / 31, 0.0), 1.0)
            freqs[j] = w * (old / new + g * (1 - old / new))
        scale *= 1 + 0.2 * math.log(new / old)
    theta = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]

    def rotate(x):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)

    stationary = [d for d in range(D) if quarter <= d < 2 * quarter or d >= 3 * quarter]
    skips = {target: (source, j) for j, (target, source) in enumerate(cfg.skip_connections)}
    x, outputs = x0s[0], []
    for i in range(L):
        if i in skips:
            source, j = skips[i]
            if cfg.gated_skips:
                w = torch.sigmoid(gains[j]) * 2 * torch.sigmoid(x0s[0][:, :16] @ P[f"skip_gates.{j}.weight"][0])
                x = x + w[:, None] * outputs[source]
            else:
                x = x + skip_w[source] * outputs[source]
        x = resid[i] * x + sum(x0_lambdas[i, j] * x0s[j] for j in range(n_embeds))
        if i not in cfg.attention_free_layers:
            W = P[f"blocks.{i}.attn.qkvo_w"]
            xn = norm(x)
            q, k, v = ((xn @ (sa[i, 0] * W[j]).T).view(T, H, D) for j in range(3))
            q, k = rotate(norm(q)), rotate(norm(k))
            if cfg.key_offset and i in cfg.long_window_layers:
                shifted = k.clone()
                shifted[1:, :, stationary] = k[:-1, :, stationary]
                k = shifted
            ve = value_embedding(i)
            if ve is not None:
                ve = ve.view(T, H, D)
                if cfg.value_embed_gate:
                    ve = 2 * torch.sigmoid(xn[:, :16] @ P[f"blocks.{i}.attn.value_gate.weight"].T)[:, :, None] * ve
                v = v + ve
            mask = masks[long_w if i in cfg.long_window_layers else short_w]
            y = torch.empty_like(q)
            for h in range(H):
                scores = (q[:, h] @ k[:, h].T) * scale
                y[:, h] = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[:, h]
            if cfg.attn_output_gate:
                y = y * torch.sigmoid(xn[:, :16] @ P[f"blocks.{i}.attn.output_gate.weight"].T)[:, :, None]
            x = x + y.reshape(T, H * D) @ (sa[i, 1] * W[3]).T
        hidden = torch.relu(norm(x) @ P[f"blocks.{i}.mlp.fc_w"].T) ** 2
        proj = P[f"blocks.{i}.mlp.proj_w"]
        x = x + hidden @ (proj if cfg.mlp_proj_transposed else proj.T)
        outputs.append(x)
    if cfg.backout:
        x = norm(x - P["backout.weight"][0] * outputs[cfg.backout_layer])
    else:
        x = norm(x)
    if cfg.x00_at_output:
        a, b = P["output_mix"]
        x = a * x + b * x0s[0]
    z = x @ head.T
    if cfg.logit_softcap_form == "sigmoid":
        z = 23 * torch.sigmoid((z + 5) / 7.5)
    else:
        cap = cfg.logit_softcap
        z = cap * z / torch.sqrt(z * z + cap * cap)
    lse = torch.logsumexp(z, dim=-1)
    if not model.training:
        return (lse - z[torch.arange(T), targets]).mean().item()
    weights = [1.0] if mtp_weights is None else mtp_weights
    total = sum(w * (lse[t] - z[t, targets[t + k]]).item() for k, w in enumerate(weights) for t in range(T - k))
    return total if cfg.train_loss_reduction == "sum" else total / T


def summation_error_bound(terms_abs_sum: torch.Tensor, count: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The most a sum of `count` terms of `dtype`, added in ANY order or blocking (a loop, a pairwise
    tree, a vectorized kernel's lanes, threads), can differ from the exact sum: gamma_(n-1) times
    the sum of the terms' magnitudes, gamma_k = k u / (1 - k u), u the unit roundoff (Higham,
    Accuracy and Stability of Numerical Algorithms, eq. 4.4). It holds on every CPU kind: it bounds
    each rounding, not one machine's order. A sum of one term is exact."""
    u = torch.finfo(dtype).eps / 2
    k = (count.double() - 1).clamp(min=0)
    return k * u / (1 - k * u) * terms_abs_sum.double()
