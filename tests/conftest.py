"""Shared fixtures: the repository on sys.path, and tiny configurations."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_gpt_medium as tg  # noqa: E402

# One thread per process unless OMP_NUM_THREADS says otherwise: the suite's in-process runs and
# the processes it starts then keep their speed when another program takes a core (README, "CPU
# threads"); the trainer's CPU default is the same.
if not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def tiny_config():
    """The tiny preset's model (fp32 on CPU), with no data files attached."""
    return tg.make_config("tiny", dtype="float32")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A small synthetic dataset (same generator as the tiny preset), written once per session."""
    sys.path.insert(0, str(ROOT / "data"))
    import synthetic
    out = tmp_path_factory.mktemp("synthetic")
    synthetic.write_dataset(out, vocab_size=500, eot_token=499, seed=7, train_shards=2, shard_tokens=60_000,
                            val_tokens=16_384)
    return out
