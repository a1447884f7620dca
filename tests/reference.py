"""Slow, literal implementations of the recipe's model and masks (docs/recipe.md, "Model" and
"Attention masks"), used as oracles by the tests (numpy / float64)."""
import numpy as np
import torch


def literal_mask(ids: np.ndarray, window: int, block_size: int, eot: int) -> np.ndarray:
    """The block rule of docs/recipe.md ("Attention masks") read word by word: per query block, list candidates, split full / partial, keep the
    most recent min(n_full, W-1) full and min(n_partial, max(W - n_full, 1)) partial blocks."""
    BS, T = block_size, ids.size
    docs = np.cumsum(ids == eot)
    nb = T // BS
    blocks = [docs[b * BS:(b + 1) * BS] for b in range(nb)]
    mask = np.zeros((T, T), dtype=bool)
    for i in range(nb):
        full, partial = [], []
        for j in range(i + 1):
            if not blocks[i][0] <= blocks[j][-1]:
                continue  # no document in common
            one_doc = len(set(blocks[i]) | set(blocks[j])) == 1
            (full if j < i and one_doc else partial).append(j)
        keep_full = sorted(full, reverse=True)[:max(min(len(full), window - 1), 0)]
        keep_partial = sorted(partial, reverse=True)[:min(len(partial), max(window - len(full), 1))]
        for j in keep_full:
            mask[i * BS:(i + 1) * BS, j * BS:(j + 1) * BS] = True
        for j in keep_partial:  # inside a partial block: key_pos <= query_pos and same document
            q = np.arange(i * BS, (i + 1) * BS)[:, None]
            k = np.arange(j * BS, (j + 1) * BS)[None, :]
            mask[i * BS:(i + 1) * BS, j * BS:(j + 1) * BS] = (k <= q) & (docs[q] == docs[k])
    return mask


def reference_loss(model, ids: torch.Tensor, targets: torch.Tensor, window: int) -> float:
    """The record's forward pass (docs/recipe.md, "Model", steps 1-4) in float64 with explicit loops, from the
    model's parameters. Assumes the record's layer pattern (16 layers, skips 9<6, 10<4, 11<2,
    no attention in layer 7, long windows at 0, 4, 11, 15, value embeddings 0..4 - 0..4)."""
    cfg = model.config
    P = {name: p.detach().double() for name, p in model.named_parameters()}
    L, H, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    n_embeds = 1 + cfg.num_extra_embeds
    scalars = P["scalars"]
    skip_w = scalars[:L]
    lambdas = scalars[L:L + L * (n_embeds + 1)].view(L, n_embeds + 1)
    attn_lambdas = scalars[L + L * (n_embeds + 1):].view(L, 2)

    def norm(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True))

    ids_l, T = ids.long(), ids.numel()
    x0 = [norm(P[f"embeds.{e}.weight"][ids_l]) for e in range(n_embeds)]
    ve_table = cfg.value_embed_tables
    masks = {w: torch.from_numpy(literal_mask(ids.numpy(), w, cfg.attn_block_size, cfg.eot_token))
             for w in (window, window // 2)}
    quarter = D // 4
    freqs = torch.cat([(1 / cfg.rope_base) ** torch.linspace(0, 1, quarter, dtype=torch.float64),
                       torch.zeros(quarter, dtype=torch.float64)])
    theta = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]

    def rotate(x):  # (T, H, D)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)

    x, outs = x0[0], []
    for i in range(L):
        for target, source in ((9, 6), (10, 4), (11, 2)):
            if i == target:
                x = x + skip_w[source] * outs[source]
        x = lambdas[i, 0] * x + sum(lambdas[i, 1 + e] * x0[e] for e in range(n_embeds))
        if i != 7:
            W = P[f"blocks.{i}.attn.qkvo_w"]
            q, k, v = ((x @ W[j].T).view(T, H, D) for j in range(3))
            q, k, v = norm(q), norm(k), norm(v)
            q, k = rotate(q), rotate(k)
            v = attn_lambdas[i, 0] * v
            if ve_table[i] is not None:
                v = v + attn_lambdas[i, 1] * P[f"value_embeds.tables.{ve_table[i]}.weight"][ids_l].view(T, H, D)
            mask = masks[window if i in (0, 4, 11, 15) else window // 2]
            y = torch.empty_like(q)
            for h in range(H):
                scores = (q[:, h] @ k[:, h].T) * cfg.attn_scale
                scores = scores.masked_fill(~mask, float("-inf"))
                y[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
            x = x + y.reshape(T, H * D) @ W[3]
        hidden = torch.relu(norm(x) @ P[f"blocks.{i}.mlp.fc_w"].T) ** 2
        x = x + hidden @ P[f"blocks.{i}.mlp.proj_w"].T
        outs.append(x)
    # the later records' head input (records/x01_lineage/recipes.md): backout of block backout_layer, then the smear
    if cfg.backout == "mix":
        a, b = P["backout.weights"]
        x = a * norm(x) + b * norm(outs[cfg.backout_layer])
    elif cfg.backout == "subtract":
        x = norm(x - P["backout.weights"][0] * outs[cfg.backout_layer])
    else:
        x = norm(x)
    if cfg.head_smear:
        c = P["head_smear.weight"][0]
        x = torch.stack([x[t] + c * x[t - 1] if t > 0 else x[t] for t in range(T)])
    z = x @ P["head.weight"].T
    z = 15 * z / torch.sqrt(z * z + 225)
    return torch.nn.functional.cross_entropy(z, targets.long()).item()
