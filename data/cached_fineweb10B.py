"""Download the speedrun's GPT-2-tokenized FineWeb shards from the Hugging Face Hub.

    python data/cached_fineweb10B.py 30    # validation shard + first 30 train shards (~6 GB): one record run
    python data/cached_fineweb10B.py 103   # the whole 10B-token sample

Files land in data/fineweb10B/ (the trainer's default --train_files/--val_files). A file that is
already present and passes the shard header check is skipped; a corrupt one is fetched again.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt_medium import ShardError, shard_token_count  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS_IN_REPO = 103


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def is_valid(path: Path) -> bool:
    try:
        shard_token_count(path)
        return True
    except (OSError, ShardError):
        return False


def download(num_train: int, out_dir: Path, fetch=None) -> list[Path]:
    """Fetch what is missing; `fetch(filename, out_dir)` defaults to huggingface_hub (progress bars)."""
    if fetch is None:
        from huggingface_hub import hf_hub_download

        def fetch(name, directory):
            hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in shard_names(num_train):
        path = out_dir / name
        if is_valid(path):
            print(f"{path}: present, skipped")
        else:
            fetch(name, out_dir)
            if not is_valid(path):
                raise ShardError(f"{path}: downloaded but fails the shard check; delete it and try again")
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("num_train", nargs="?", type=int, default=30,
                        help=f"train shards to fetch, 1..{TRAIN_SHARDS_IN_REPO} (100M tokens each; default 30 = one record run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "fineweb10B")
    args = parser.parse_args(argv)
    if not 0 <= args.num_train <= TRAIN_SHARDS_IN_REPO:
        parser.error(f"num_train must be in 0..{TRAIN_SHARDS_IN_REPO}, got {args.num_train}")
    try:
        download(args.num_train, args.out)
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the hub client raises many kinds (HTTP, connection, offline mode)
        print(f"error: could not download from the Hugging Face Hub dataset {REPO_ID}: {type(e).__name__}: {e}\n"
              "Check the network (or HF_ENDPOINT / a proxy), then run the same command again: "
              "finished files are kept and skipped.", file=sys.stderr)
        return 1
    print(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
