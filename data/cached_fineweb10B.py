"""Download the speedrun's GPT-2-tokenized FineWeb shards from the Hugging Face Hub.

    python data/cached_fineweb10B.py 30    # validation shard + first 30 train shards (~6 GB): one record run
    python data/cached_fineweb10B.py 103   # the whole 10B-token sample (~21 GB)

Files land in data/fineweb10B/ (the trainer's default --train_files/--val_files). A file that is
already present and passes the shard header check is skipped; a corrupt one is fetched again.
Before the first download one short request (no retries) checks that the hub answers, so an
offline machine gets one line at once instead of the hub client's half minute of retries.
HF_ENDPOINT (a mirror) and HTTPS_PROXY are honoured. More in docs/data.md.
The trainer (for its shard check, so torch) and huggingface_hub are imported only once the
arguments are checked: a mistyped argument is refused at once.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.cli import OneLineParser, fail, first_line, output_folder_problem, run_main  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS_IN_REPO = 103
PROBE_TIMEOUT_S = 5.0  # a reachable hub answers a HEAD request in well under a second
DEFAULT_OUT = Path(__file__).resolve().parent / "fineweb10B"


class HubUnreachable(RuntimeError):
    """The hub did not answer the probe; the message says why."""


# ---- which files, and whether they are already here


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def is_valid(path: Path) -> bool:
    """True when `path` passes the trainer's shard check (header and size)."""
    import train_gpt_medium as tg
    try:
        tg.shard_token_count(path)
        return True
    except (OSError, tg.ShardError):
        return False


# ---- the hub: one quick probe, then the hub client's own downloads (with its retries)


def head_request(url: str, timeout: float) -> None:
    """One HEAD request through the hub client's HTTP session (its proxies, headers, offline mode)."""
    from huggingface_hub import get_session
    get_session().head(url, timeout=timeout, follow_redirects=False)


def probe_hub(request=head_request, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Make exactly one request to the hub's endpoint; raise HubUnreachable unless it answers
    (any HTTP status is an answer) within `timeout` seconds. The request runs in a daemon thread
    because a hanging DNS lookup ignores the HTTP timeout."""
    from huggingface_hub import constants
    if constants.is_offline_mode():
        raise HubUnreachable("HF_HUB_OFFLINE is set, so the hub client makes no connection (unset it to download)")
    url = f"{constants.ENDPOINT}/api/datasets/{REPO_ID}"
    outcome: dict[str, BaseException | None] = {}

    def attempt():
        try:
            request(url, timeout)
            outcome["error"] = None
        except Exception as e:  # connection refused, DNS failure, TLS, proxy errors: all mean "not reachable"
            outcome["error"] = e

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout)
    if "error" not in outcome:
        raise HubUnreachable(f"{constants.ENDPOINT} did not answer within {timeout:g} s: this machine seems offline")
    if outcome["error"] is not None:
        raise HubUnreachable(f"{constants.ENDPOINT} is out of reach ({first_line(outcome['error'])}): "
                             "this machine seems offline")


def progress(paths: list[Path]):
    """The shards to fetch, counted by a progress bar on stderr when it is a terminal: shards done of
    all, rate and time left (the hub client adds a bar per file). Nothing is printed elsewhere."""
    from tqdm import tqdm
    return tqdm(paths, desc="shards", unit="shard", disable=None)


def hub_fetch(name: str, directory: Path) -> None:
    from huggingface_hub import hf_hub_download
    hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=directory)


def remove_empty_folders(top: Path) -> None:
    """Remove `top` and the folders under it that hold no file (what a failed first download leaves)."""
    for folder, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(folder)  # refuses a folder that still holds anything: no file is ever removed
        except OSError:
            pass


def download(num_train: int, out_dir: Path, fetch=None, probe=None) -> list[Path]:
    """Fetch the validation shard and train shards 1..num_train that are missing or corrupt.

    `fetch(filename, out_dir)` defaults to huggingface_hub (with progress bars); `probe()` runs once
    before the first fetch and raises HubUnreachable when offline. It defaults to probe_hub when
    fetching from the hub, and to no probe when a `fetch` is given. Folders are created only when a
    file is about to be written, and removed again if a failed download left them empty.
    """
    if fetch is None:
        fetch, probe = hub_fetch, probe or probe_hub
    out_dir = Path(out_dir)
    paths, missing = [], []
    for name in shard_names(num_train):
        path = out_dir / name
        paths.append(path)
        if is_valid(path):
            print(f"{path}: present, skipped")
        else:
            missing.append(path)
    if not missing:
        return paths
    if probe is not None:
        probe()
    first_created = next((p for p in [out_dir, *out_dir.parents][::-1] if not p.exists()), None)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for path in progress(missing):
            fetch(path.name, out_dir)
            if not is_valid(path):
                from train_gpt_medium import ShardError
                raise ShardError(f"{path}: downloaded but fails the shard check; delete it and try again")
    finally:
        if first_created is not None:
            remove_empty_folders(first_created)
    return paths


# ---- command line


def train_shard_count(text: str) -> int:
    """argparse type of num_train: a whole number in 1..103."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= TRAIN_SHARDS_IN_REPO:
        raise argparse.ArgumentTypeError(f"must be a whole number of train shards in 1..{TRAIN_SHARDS_IN_REPO}, "
                                         f"got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0],
                           epilog="Offline? Copy the shards into the --out folder by hand; see docs/data.md.")
    parser.add_argument("num_train", nargs="?", type=train_shard_count, default=30,
                        help=f"train shards to fetch, 1..{TRAIN_SHARDS_IN_REPO} (100M tokens, ~200 MB each; "
                             "default 30 = one record run); the validation shard is always fetched")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the shards (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv=None, fetch=None, probe=None) -> int:
    """The command line; `fetch` and `probe` replace the hub (see download) in tests."""
    args = parse_args(argv)
    if problem := output_folder_problem(args.out, "--out"):
        return fail(problem)
    from train_gpt_medium import ShardError
    try:
        download(args.num_train, args.out, fetch, probe)
    except HubUnreachable as e:
        print(f"error: could not download from the Hugging Face Hub dataset {REPO_ID}: {e}. Copy the shards "
              f"into {args.out}/ by hand (see docs/data.md), or set HF_ENDPOINT to a mirror or HTTPS_PROXY to a "
              "proxy, then run the same command again (finished files are kept)", file=sys.stderr)
        return 1
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the hub client raises many kinds (HTTP errors, dropped connections, a full disk)
        print(f"error: could not download from the Hugging Face Hub dataset {REPO_ID}: {first_line(e)}; "
              "check the network (or HF_ENDPOINT / a proxy), then run the same command again: "
              "finished files are kept and skipped", file=sys.stderr)
        return 1
    print(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
