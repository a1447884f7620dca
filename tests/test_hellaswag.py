"""tools/hellaswag.py and the trainer's --eval_hellaswag: each ending scored by its own tokens' loss
(sum: acc, mean: acc_norm), candidates packed as documents that do not see each other, a fixture
whose right endings the synthetic chain forces, the hub's set read from the cache or refused in
one line offline, and the trainer's evaluation after training, outside its clock and its lines."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from test_checkpoint import four_block_argv

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "data"))
from tools import hellaswag as hs  # noqa: E402
from tools import inspect_checkpoint as ic  # noqa: E402
import synthetic  # noqa: E402
from test_sample import byte_level_tokenizer_file  # noqa: E402

TINY_CHAIN = dict(vocab_size=500, eot_token=499, seed=1234)  # the tiny preset's data (data/synthetic/)


def test_each_ending_is_scored_by_its_own_tokens_sum_and_mean():
    """A stand-in model whose loss at position t is the id of token t + 1: an ending's summed loss is
    the sum of its ids. Endings of different lengths make acc (sum) and acc_norm (mean) disagree, and
    sequences of 24 tokens split the candidates over several of them."""
    items = [hs.Item([5, 6], [[1, 1, 1, 1], [3], [2, 2]], label=1),  # sums 4, 3, 4; means 1, 3, 2
             hs.Item([7], [[9, 9], [1, 30]], label=0),  # sums 18, 31; means 9, 15.5
             hs.Item([8] * 10, [[4], [2, 7]], label=1)]  # sums 4, 9; means 4, 4.5
    packed, cut = hs.pack(items, seq_len=24, eot=0)
    assert cut == 0 and len(packed) > 1
    for seq in packed:
        assert len(seq.tokens) == 25
    scores = hs.ending_losses(lambda inputs, targets: targets.double(), packed, items, "cpu")
    assert scores == [[(4.0, 4), (3.0, 1), (4.0, 2)], [(18.0, 2), (31.0, 2)], [(4.0, 1), (9.0, 2)]]
    result = hs.accuracy(scores, items)
    # labels 1, 0, 1; the lowest sum is ending 1, 0, 0 (right, right, wrong); the lowest mean 0, 0, 0
    assert (result["acc_right"], result["acc_norm_right"]) == (2, 1)
    for key, p in (("acc", 2 / 3), ("acc_norm", 1 / 3)):
        assert result[key] == p and result[f"{key}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 3))


def test_each_candidate_is_a_document_end_of_text_context_ending():
    items = [hs.Item([5, 6], [[7], [8, 9]], label=0)]
    (seq,), _ = hs.pack(items, seq_len=16, eot=0)
    assert seq.tokens.tolist() == [0, 5, 6, 7, 0, 5, 6, 8, 9] + [0] * 8
    assert seq.spans == [(0, 0, 2, 3), (0, 1, 6, 8)]  # losses[t] predicts tokens[t + 1]


def test_a_context_too_long_for_a_sequence_keeps_its_end():
    items = [hs.Item(list(range(1, 30)), [[40, 41]], label=0)]
    (seq,), cut = hs.pack(items, seq_len=16, eot=0)
    assert cut == 1 and seq.tokens[:16].tolist() == [0, *range(17, 30), 40, 41]


def chain_logprob(P, context, ending):
    states = [context[-1], *ending]
    with np.errstate(divide="ignore"):
        return float(np.sum(np.log([P[a, b] for a, b in zip(states, states[1:])])))


def test_the_synthetic_fixture_is_forced_by_its_chain():
    """Under the chain itself every wrong ending has probability 0 and the right one more."""
    P = synthetic.markov_chain(**TINY_CHAIN)
    rows = hs.synthetic_items(P, 499, 50, seed=3)
    for row in rows:
        logp = [chain_logprob(P, row["ctx_ids"], e) for e in row["ending_ids"]]
        assert math.isfinite(logp[row["label"]]) and sum(map(math.isfinite, logp)) == 1
        assert 499 not in row["ctx_ids"] + sum(row["ending_ids"], [])
    assert len({r["label"] for r in rows}) == 4


@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "items.jsonl"
    rows = hs.synthetic_items(synthetic.markov_chain(**TINY_CHAIN), 499, 120, seed=11)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_model_of_the_synthetic_data_finds_the_right_endings_and_a_fresh_one_does_not(trained_tiny_checkpoint,
                                                                                       fixture_file):
    model, config, step = ic.load_model(trained_tiny_checkpoint)
    items = hs.load_items(str(fixture_file), config.vocab_size)
    trained = hs.evaluate(model, config, step, items)
    fresh = hs.evaluate(tg.build_model(config), config, step, items)  # the same model at its initial values
    assert trained["acc_norm"] > 0.65 and trained["acc"] > 0.6, trained
    assert fresh["acc_norm"] < 0.4 and fresh["acc"] < 0.4, fresh  # chance: 0.25 (sd 0.04 over 120 items)


def test_packed_candidates_score_as_each_one_alone(trained_tiny_checkpoint, fixture_file):
    """The document masks keep each candidate to itself: scored alone (one forward each) or packed
    with the others, its mean loss differs only through what the smear, the key offset and the
    bigram hash carry from the token before its end-of-text (as in training), well under 0.01 nats;
    a candidate that attended to its neighbours would move by far more."""
    model, config, step = ic.load_model(trained_tiny_checkpoint)
    items = hs.load_items(str(fixture_file), config.vocab_size)[:10]
    window = ic.at_step(model, config, step)
    forward = lambda x, y: model(x, y, window, reduction="none")
    with torch.no_grad():
        packed = hs.ending_losses(forward, hs.pack(items, 512, 499)[0], items, "cpu")
        for i, item in enumerate(items):
            for j, ending in enumerate(item.endings):
                one = [hs.Item(item.context, [ending], 0)]
                (alone,), = hs.ending_losses(forward, hs.pack(one, 512, 499)[0], one, "cpu")
                assert abs(alone[0] / alone[1] - packed[i][j][0] / packed[i][j][1]) < 0.01
                assert alone[1] == packed[i][j][1] == len(ending)


def test_the_command_line_prints_both_accuracies_with_their_standard_errors(trained_tiny_checkpoint, fixture_file,
                                                                             capsys):
    assert hs.main([str(trained_tiny_checkpoint), f"--hellaswag_file={fixture_file}", "--limit=40", "--json"]) == 0
    line, blob = capsys.readouterr().out.splitlines()
    result = json.loads(blob)
    assert result["items"] == 40 and result["step"] == 190
    for key in ("acc", "acc_norm"):
        p = result[f"{key}_right"] / 40
        assert result[key] == p and result[f"{key}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 40))
        assert f"{key}:{p:.4f}({result[key + '_stderr']:.4f})" in line
    assert line.startswith("hellaswag: acc_norm:") and "items:40 step:190" in line


def test_rows_of_text_are_tokenized_with_a_space_before_each_ending(tmp_path):
    """HellaSwag's own rows ({"ctx", "endings", "label"}, the label a string in the hub's Parquet)."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet
    file = tmp_path / "val.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
        [dict(ctx="Hi", endings=["a", "bc"], label="1", activity_label="x")]), file)
    tokenizer_file = byte_level_tokenizer_file(tmp_path)
    (item,) = hs.load_items(str(file), 50257, tokenizer_file)
    assert item.context == [39, 72] and item.endings == [[220, 64], [220, 65, 66]] and item.label == 1


@pytest.mark.parametrize("row, message", [
    ({"ctx_ids": [1], "ending_ids": [[2], [3]], "label": 2}, "row 1: needs at least two non-empty endings and a label"),
    ({"ctx_ids": [1], "ending_ids": [[2], []], "label": 0}, "needs at least two non-empty endings"),
    ({"ctx_ids": [1], "ending_ids": [[2], [700]], "label": 0}, "token 700 is not in this model's vocabulary"),
    ({"ctx_ids": [1], "label": 0}, "needs ctx, endings and label"),
    ({"ctx": "text", "endings": ["a", "b"], "label": 0}, "a row of text, and this model's vocabulary is not GPT-2's"),
])
def test_a_bad_row_is_named(tmp_path, row, message):
    file = tmp_path / "rows.jsonl"
    file.write_text(json.dumps(row) + "\n")
    with pytest.raises(hs.HellaSwagError, match=message.replace("(", r"\(")):
        hs.load_items(str(file), 500)


def offline_download(calls):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(**kwargs):
        calls.append(kwargs)
        raise LocalEntryNotFoundError("not cached")
    return download


def offline_probe():
    raise RuntimeError("https://huggingface.co is out of reach (ConnectionError: no network)")


def test_offline_the_hub_set_is_refused_in_one_line_saying_how_to_fetch_it(trained_tiny_checkpoint, capsys):
    calls = []
    assert hs.main([str(trained_tiny_checkpoint)], download=offline_download(calls), probe=offline_probe) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Rowan/hellaswag/default/validation/0000.parquet" in err
    assert "hf_hub_download('Rowan/hellaswag', 'default/validation/0000.parquet', repo_type='dataset', " \
           "revision='refs/convert/parquet')" in err
    assert "or pass --hellaswag_file=PATH" in err
    assert [c.get("local_files_only") for c in calls] == [True]


def test_the_hub_set_is_read_from_the_cache_without_the_network(tmp_path):
    cached = tmp_path / "0000.parquet"
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([dict(ctx_ids=[1], ending_ids=[[2], [3]], label="0")]),
                                cached)
    seen = []

    def from_cache(**kwargs):
        seen.append(kwargs)
        return cached
    (item,) = hs.load_items("", 500, download=from_cache, probe=lambda: pytest.fail("the hub was probed"))
    assert item.endings == [[2], [3]] and seen == [dict(hs.HUB_SET, local_files_only=True)]


# ---- the trainer's --eval_hellaswag

def test_the_trainer_scores_after_training_in_a_line_of_its_own(synthetic_dir, fixture_file, tmp_path, monkeypatch):
    """After train() has returned (so outside its clock): one `hellaswag:` line after the record's
    closing lines, before the log's last (how the run ended); every line before it is a line the run
    writes without the flag."""
    events, real_train, real_evaluate = [], tg.train, hs.evaluate

    def train(*args, **kwargs):
        out = real_train(*args, **kwargs)
        events.append("train returned")
        return out

    def evaluate(model, config, step, items, seq_len=None):
        events.append(f"evaluate at step {step}")
        return real_evaluate(model, config, step, items, seq_len)
    monkeypatch.setattr(tg, "train", train)
    monkeypatch.setattr(hs, "evaluate", evaluate)
    argv = four_block_argv(synthetic_dir, tmp_path, "--eval_hellaswag", f"--hellaswag_file={fixture_file}")
    assert tg.main(argv) == 0
    assert events == ["train returned", "evaluate at step 4"]
    (log,) = (tmp_path / "logs").glob("*.txt")
    body = log.read_text().split("=" * 100 + "\n")[-1].splitlines()
    assert body[-2].startswith("hellaswag: acc_norm:") and "items:120 step:4" in body[-2]
    assert body[-3].startswith("peak memory allocated:") and body[-1] == "run ended: finished (exit 0)"
    assert sum(line.startswith("hellaswag") for line in body) == 1


def test_a_missing_hellaswag_file_stops_the_trainer_before_training(synthetic_dir, tmp_path, capsys):
    argv = four_block_argv(synthetic_dir, tmp_path, "--eval_hellaswag", f"--hellaswag_file={tmp_path / 'none.jsonl'}")
    assert tg.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --hellaswag_file: ") and "none.jsonl: no such file" in err
    assert not (tmp_path / "logs").exists()


def test_a_failure_of_the_evaluation_after_training_is_a_line_and_the_run_still_succeeds(
        synthetic_dir, fixture_file, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
    monkeypatch.setattr(hs, "evaluate", out_of_memory)
    argv = four_block_argv(synthetic_dir, tmp_path, "--eval_hellaswag", f"--hellaswag_file={fixture_file}")
    assert tg.main(argv) == 0
    (log,) = (tmp_path / "logs").glob("*.txt")
    lines = log.read_text().splitlines()
    assert lines[-2] == "hellaswag: not scored (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    assert lines[-3].startswith("peak memory allocated:") and lines[-1] == "run ended: finished (exit 0)"


def test_a_folder_given_as_the_hellaswag_file_is_called_a_folder(tmp_path):
    with pytest.raises(hs.HellaSwagError, match=f"{tmp_path}: is a folder; give a .jsonl or .parquet file"):
        hs.load_items(str(tmp_path), 500)


def test_write_synthetic_names_its_own_flag_when_it_cannot_write(tmp_path, capsys):
    """A folder given to --write_synthetic is --write_synthetic's problem (it blamed --synthetic_meta)."""
    assert hs.main(["--write_synthetic", str(tmp_path), "--items=3"]) == 2
    err = capsys.readouterr().err
    assert f"--write_synthetic {tmp_path}: is a folder" in err and "--synthetic_meta" not in err
