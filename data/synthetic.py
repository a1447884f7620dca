"""Synthetic token shards with known entropies, for the tiny preset and the tests.

The token stream is one stationary Markov chain over the vocabulary, the end-of-text token
included: every token has `branching` likely successors (Dirichlet weights) plus a small
chance of ending the document; after end-of-text the next token is drawn from a broad start
distribution. Because documents are whole runs of the chain, concatenating them is still a
sample of that chain, so the entropies below are exact for the stream:

- conditional entropy H(next | current) = sum_s pi(s) H(P[s]), the best loss any model can reach
  (the document-causal mask hides nothing it needs: one token of context suffices);
- unigram entropy H(pi), what a model that ignores context reaches.

    python data/synthetic.py --out data/synthetic        # what the tiny preset generates
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.cli import OneLineParser, fail, os_error_line, output_folder_problem, run_main  # noqa: E402

BRANCHING = 8  # likely successors per token
MAX_VOCAB = 8192  # the chain is a dense V x V float64 matrix: 0.5 GB and minutes of eigen-decomposition at 8192


class SyntheticDataError(ValueError):
    """Parameters the generator cannot use; the message names the flag (as data/synthetic.py and the
    trainer spell it) and the range it must be in."""


def markov_chain(vocab_size: int, eot_token: int, seed: int, branching: int = BRANCHING,
                 end_prob: float = 1 / 128) -> np.ndarray:
    """Transition matrix P (V, V) float64: P[s, t] = probability that t follows s."""
    rng = np.random.default_rng(seed)
    V = vocab_size
    words = np.array([t for t in range(V) if t != eot_token])
    P = np.zeros((V, V))
    for s in words:
        successors = rng.choice(words, size=branching, replace=False)
        P[s, successors] = (1 - end_prob) * rng.dirichlet(np.ones(branching))
        P[s, eot_token] = end_prob
    P[eot_token, words] = rng.dirichlet(np.full(words.size, 0.5))  # documents start broadly
    return P


def stationary(P: np.ndarray) -> np.ndarray:
    """The chain's stationary distribution (left eigenvector for eigenvalue 1)."""
    values, vectors = np.linalg.eig(P.T)
    pi = np.abs(np.real(vectors[:, np.argmin(np.abs(values - 1))]))
    return pi / pi.sum()


def entropies(P: np.ndarray) -> dict[str, float]:
    """Exact conditional and unigram entropies of the stationary chain, in nats per token."""
    pi = stationary(P)
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.where(P > 0, P * np.log(P), 0.0).sum(1)
        unigram = -np.where(pi > 0, pi * np.log(pi), 0.0).sum()
    return dict(conditional_entropy=float(pi @ row_h), unigram_entropy=float(unigram))


def sample(P: np.ndarray, eot_token: int, num_tokens: int, seed: int, chains: int = 256) -> np.ndarray:
    """At least num_tokens tokens of whole documents (each starts with eot_token), then cut."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(P, axis=1)
    cdf[:, -1] = 1.0  # guard against rounding: every draw lands somewhere
    length = num_tokens // chains + 1024
    out = np.empty((chains, length), dtype=np.int64)
    state = np.full(chains, eot_token)
    for t in range(length):  # vectorized over independent chains
        out[:, t] = state
        u = rng.random(chains)
        state = (cdf[state] < u[:, None]).sum(1)
    docs = []
    for row in out:  # keep whole documents only: from the first EOT to before the last
        ends = np.flatnonzero(row == eot_token)
        docs.append(row[ends[0]:ends[-1]])
    stream = np.concatenate(docs)
    if stream.size < num_tokens:
        raise RuntimeError("synthetic sampler produced too few tokens; raise `chains` or length")
    return stream[:num_tokens]


def made_up_token_bytes(lengths: np.ndarray, seed: int) -> list[bytes]:
    """Bytes for each token, of exactly its length (end-of-text: none), shaped like a BPE vocabulary so
    that the trainer's prefix table (--prefix_loss_weight) has work to do: one-byte tokens get distinct
    bytes while 256 last, and each longer token (taken shortest first) extends a random shorter token
    by random bytes, drawn again (up to 8 times) if that string is taken. So every multi-byte token
    has a prefix token, often shorter than its length less one."""
    rng = np.random.default_rng(seed)
    tokens: list[bytes] = [b""] * lengths.size
    taken, by_length = set(), {}
    for token in np.argsort(lengths, kind="stable"):
        n = int(lengths[token])
        if n == 0:
            continue
        for _ in range(8):
            shorter = [k for k in range(1, n) if by_length.get(k)]
            if shorter:
                parents = by_length[shorter[rng.integers(len(shorter))]]
                start = tokens[parents[rng.integers(len(parents))]]
            else:
                start = b""
            b = start + bytes(rng.integers(0, 256, size=n - len(start)).tolist())
            if b not in taken:
                break
        tokens[token] = b
        taken.add(b)
        by_length.setdefault(n, []).append(int(token))
    return tokens


def check_parameters(vocab_size: int, eot_token: int, seed: int, train_shards: int, shard_tokens: int,
                     val_tokens: int) -> None:
    """SyntheticDataError naming the first parameter out of its range."""
    ranges = dict(vocab_size=(vocab_size, BRANCHING + 1, MAX_VOCAB), eot_token=(eot_token, 0, vocab_size - 1),
                  seed=(seed, 0, None), train_shards=(train_shards, 1, None), shard_tokens=(shard_tokens, 1, None),
                  val_tokens=(val_tokens, 1, None))
    for flag, (value, low, high) in ranges.items():
        if value < low or (high is not None and value > high):
            bounds = f"{low}..{high}" if high is not None else f"at least {low}"
            raise SyntheticDataError(f"--{flag}={value}: must be {bounds} for synthetic data")


def write_dataset(out_dir, vocab_size: int = 500, eot_token: int = 499, seed: int = 1234,
                  train_shards: int = 2, shard_tokens: int = 400_000, val_tokens: int = 65_536,
                  write_shard=None) -> dict:
    """Write synthetic_train_00000{1..}.bin, synthetic_val_000000.bin, synthetic_token_bytes.npy (a made-up
    byte length per token), synthetic_tokens.bin (made-up bytes of those lengths) and synthetic_meta.json
    (the entropies). SyntheticDataError for parameters out of range.
    `write_shard(path, tokens)` is the trainer's shard writer (one writer for the whole project):
    the trainer passes its own, so it is not imported a second time; by default it is imported here,
    after the parameters are checked."""
    check_parameters(vocab_size, eot_token, seed, train_shards, shard_tokens, val_tokens)
    if write_shard is None:
        from train_gpt_medium import write_shard
    P = markov_chain(vocab_size, eot_token, seed)
    stream = sample(P, eot_token, train_shards * shard_tokens + val_tokens, seed + 1)
    out_dir = Path(out_dir)
    # Written into a staging folder beside out_dir, then moved in file by file with the token-byte
    # table last (the file a tiny run checks for): a run starting meanwhile in the same folder sees
    # the whole dataset or none of it, never a shard half written.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write_shard(staging / "synthetic_val_000000.bin", stream[:val_tokens])
        for i in range(train_shards):
            start = val_tokens + i * shard_tokens
            write_shard(staging / f"synthetic_train_{i + 1:06d}.bin", stream[start:start + shard_tokens])
        meta = dict(vocab_size=vocab_size, eot_token=eot_token, seed=seed, **entropies(P))
        (staging / "synthetic_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        # a byte length per token (1..6, end-of-text 0) so the tiny preset reports val_bpb as GPT-2 runs do
        lengths = np.random.default_rng(seed + 2).integers(1, 7, size=vocab_size).astype(np.uint8)
        lengths[eot_token] = 0
        # and made-up bytes of those lengths, for the prefix table of --prefix_loss_weight
        (staging / "synthetic_tokens.bin").write_bytes(b"".join(made_up_token_bytes(lengths, seed + 3)))
        np.save(staging / "synthetic_token_bytes.npy", lengths)
        out_dir.mkdir(exist_ok=True)  # only now: a failed generation leaves no empty folder
        for file in sorted(staging.iterdir(), key=lambda f: f.name == "synthetic_token_bytes.npy"):
            os.replace(file, out_dir / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"synthetic data in {out_dir}: conditional entropy {meta['conditional_entropy']:.4f}, "
          f"unigram entropy {meta['unigram_entropy']:.4f} nats/token")
    return meta


# ---- command line


def main(argv=None) -> int:
    """Generate a dataset; exit code 2 (one line) for parameters out of range or an unwritable --out."""
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/synthetic"), help="folder (default: %(default)s)")
    parser.add_argument("--vocab_size", type=int, default=500, help=f"tokens, {BRANCHING + 1}..{MAX_VOCAB}")
    parser.add_argument("--eot_token", type=int, default=499, help="end-of-text id, 0..vocab_size-1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--train_shards", type=int, default=2)
    parser.add_argument("--shard_tokens", type=int, default=400_000, help="tokens per train shard")
    parser.add_argument("--val_tokens", type=int, default=65_536, help="tokens of the validation shard")
    args = parser.parse_args(argv)
    parameters = dict(vocab_size=args.vocab_size, eot_token=args.eot_token, seed=args.seed,
                      train_shards=args.train_shards, shard_tokens=args.shard_tokens, val_tokens=args.val_tokens)
    try:
        check_parameters(**parameters)
    except SyntheticDataError as e:
        return fail(str(e))
    if problem := output_folder_problem(args.out, "--out"):
        return fail(problem)
    try:
        write_dataset(args.out, **parameters)
    except OSError as e:  # a full disk, or a folder that changed since the check
        return fail(f"{os_error_line(e, args.out)}; choose another --out")
    return 0


if __name__ == "__main__":
    run_main(main)
