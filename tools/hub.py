"""Files the after-run tools take from the Hugging Face hub (GPT-2's tokenizer, HellaSwag): fetched
once into the hub client's cache (~/.cache/huggingface, or HF_HOME), read from there afterwards.

The cache is asked first, without a connection. Only a file that is not cached yet goes to the
hub, after one short probe (data/cached_fineweb10B.py's), so an offline machine gets one line at
once instead of the hub client's half minute of retries.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import first_line  # noqa: E402


class HubFileUnavailable(RuntimeError):
    """A hub file that is neither cached nor fetchable now; the message says why."""


def fetch_command(repo_id: str, filename: str, repo_type: str, revision: str | None) -> str:
    """The one-line command that puts the file into the cache on a machine that reaches the hub."""
    extra = (f", repo_type={repo_type!r}" if repo_type != "model" else "") + (f", revision={revision!r}"
                                                                             if revision else "")
    return (f"python -c \"from huggingface_hub import hf_hub_download; hf_hub_download({repo_id!r}, "
            f"{filename!r}{extra})\"")


def cached_file(repo_id: str, filename: str, repo_type: str = "model", revision: str | None = None,
                download=None, probe=None) -> Path:
    """The local path of a hub file, from the cache or fetched into it. HubFileUnavailable when it is
    not cached and the hub cannot be reached; the message names the file and the command that
    fetches it. `download(**kwargs)` (hf_hub_download) and `probe()` are replaceable for tests."""
    if download is None:
        from huggingface_hub import hf_hub_download as download
    where = dict(repo_id=repo_id, filename=filename, repo_type=repo_type, revision=revision)
    name = f"{repo_id}/{filename}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(download(**where, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError, or the cache's own problems): ask the hub
        pass
    if probe is None:
        sys.path.insert(0, str(ROOT / "data"))
        from cached_fineweb10B import probe_hub as probe
    how = f"fetch it once where the hub is reachable: {fetch_command(repo_id, filename, repo_type, revision)}"
    try:
        probe()
    except Exception as e:  # HubUnreachable, or anything else that stops the probe
        raise HubFileUnavailable(f"{name} is not in the hub cache and {first_line(e).split(': ', 1)[-1]}; {how}")
    try:
        return Path(download(**where))
    except Exception as e:  # missing on the hub, refused, interrupted: all mean the file is not here
        raise HubFileUnavailable(f"{name} could not be fetched ({first_line(e)}); {how}")
