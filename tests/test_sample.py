"""tools/sample.py: text from a checkpoint. Greedy decoding is the argmax of the training forward,
a seed fixes the samples, a model of the synthetic data writes what its chain allows, text goes in
through a tokenizer and comes out through the token-bytes table, and bad input is one line."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import FOUR_BLOCKS
from test_model import randomize
from test_mudd_gate import SEVEN_BLOCKS
from test_training import runner_and_loader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "data"))
from tools import inspect_checkpoint as ic  # noqa: E402
from tools import sample as sm  # noqa: E402
import synthetic  # noqa: E402


def random_checkpoint(synthetic_dir, tmp_path, step=20, **overrides):
    """A tiny checkpoint of random non-zero weights at `step` (the head still tied to the input table),
    of its recipe's layout in miniature (FOUR_BLOCKS; mudd's SEVEN_BLOCKS): sampling runs each block
    alike at any depth, and every kind of block is there."""
    layout = SEVEN_BLOCKS if overrides.get("recipe") == "mudd" else FOUR_BLOCKS
    config = tg.make_config("tiny", checkpoint_dir=str(tmp_path / "ck"), warmup_steps=0,
                            train_files=str(synthetic_dir / "synthetic_train_*.bin"), **{**layout, **overrides})
    runner, loader = runner_and_loader(config)
    randomize(runner.model, seed=3)
    return tg.save_checkpoint(runner, loader, step, 0.0)


def trainer_logits_by_loss(config, state, step, ids):
    """-(loss of every token id as the target) at every position of `ids`: the trainer's own Runner
    sets the model for `step` (windows, YaRN tables, the tie), and its eval forward gives per-token
    losses, one forward per candidate id. Equal to the logits up to a constant per position (the
    log-sum-exp), so its argmax is the logits' argmax. (V, T)"""
    runner = tg.Runner(config, torch.device("cpu"))  # on a CPU the trainer's attention is SDPA's too
    runner.model.load_state_dict(state)
    window = runner.window(step)
    runner.set_embedding_tie(step)
    runner.model.eval()
    inputs = ids.to(torch.int32)
    with torch.no_grad():
        return torch.stack([-runner.model(inputs, torch.full_like(ids, v), window, reduction="none")
                            for v in range(config.vocab_size)])


@pytest.mark.parametrize("recipe", ["bulk", "mudd"])
def test_greedy_decoding_is_the_argmax_of_the_training_forward_at_every_position(synthetic_dir, tmp_path, recipe):
    path = random_checkpoint(synthetic_dir, tmp_path, recipe=recipe)
    model, config, step = ic.load_model(path)
    prompt = [5, 17, 42]
    new = sm.generate(model, config, step, prompt, 12, temperature=0, stop_at_eot=False)
    assert len(new) == 12 and len(set(new)) > 1  # a random model: a sequence that says something
    seq = torch.tensor([config.eot_token, *prompt, *new])  # 16 tokens: one attention block
    scores = trainer_logits_by_loss(config, model.state_dict(), step, seq)  # (V, 16)
    positions = range(len(prompt), len(seq) - 1)  # position t predicts token t + 1
    assert [int(scores[:, t].argmax()) for t in positions] == new


def test_the_logits_are_the_eval_forwards_and_ignore_the_padding_after_the_context(synthetic_dir, tmp_path):
    """next_token_logits at each prefix, against the losses of one forward over the whole sequence."""
    model, config, step = ic.load_model(random_checkpoint(synthetic_dir, tmp_path))
    ids = torch.tensor([config.eot_token, 8, 9, 400, 31, 7, 7, 120, 3, 2, 250, 11, 12, 13, 14, 15])
    window = ic.at_step(model, config, step)
    with torch.no_grad():
        losses = model(ids.to(torch.int32), torch.roll(ids, -1), window, reduction="none")
    for t in (2, 7, 14):  # prefixes of 3, 8 and 15 tokens, each padded to 16 with end-of-text
        logits = model.logits(sm.head_inputs(model, ids[:t + 1], window)[-1:])[0]  # over the padded vocabulary
        assert torch.allclose(torch.logsumexp(logits, 0) - logits[ids[t + 1]], losses[t], atol=1e-5)
        assert torch.equal(sm.next_token_logits(model, ids[:t + 1], window), logits[:config.vocab_size])


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of the command line; a usage error exits through argparse."""
    try:
        code = sm.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(trained_tiny_checkpoint, capsys):
    argv = (trained_tiny_checkpoint, "--num_samples=2", "--max_new_tokens=16", "--prompt_ids=10,20")
    first, again, other = (run_cli(capsys, *argv, f"--seed={s}") for s in (1, 1, 2))
    assert first[0] == again[0] == other[0] == 0
    assert first[1] == again[1]
    assert first[1].count("--- sample ") == 2 and "<10> <20> " in first[1]
    samples = lambda out: [line for line in out.splitlines() if not line.startswith("---")]
    assert samples(first[1])[0] != samples(first[1])[1]  # the second sample draws on from the first's stream
    assert samples(first[1]) != samples(other[1])


def allowed_fraction(P, tokens):
    """The share of transitions in `tokens` that the chain P gives a nonzero probability."""
    return float(np.mean([P[a, b] > 0 for a, b in zip(tokens, tokens[1:])]))


def test_a_model_of_the_synthetic_data_writes_what_its_chain_allows(trained_tiny_checkpoint):
    """The tiny run's data (data/synthetic/, seed 1234): 8 successors and end-of-text follow each token,
    9 of 500. Greedy text keeps to the chain throughout; sampling from the 5 likeliest mostly does.
    A model that ignored the chain would pick an allowed successor 9/500 = 1.8% of the time."""
    P = synthetic.markov_chain(500, 499, 1234)
    model, config, step = ic.load_model(trained_tiny_checkpoint)
    gen = torch.Generator().manual_seed(0)
    greedy, sampled = [], []
    for start in (3, 77, 250):
        greedy.append(allowed_fraction(P, [499, start, *sm.generate(model, config, step, [start], 24, 0,
                                                                      stop_at_eot=False)]))
        sampled.append(allowed_fraction(P, [499, start, *sm.generate(model, config, step, [start], 24, 1.0, 5, gen,
                                                                       stop_at_eot=False)]))
    assert min(greedy) == 1.0, greedy
    assert np.mean(sampled) > 0.6, sampled


def test_a_sample_stops_at_end_of_text_unless_asked_not_to(synthetic_dir, tmp_path, monkeypatch):
    """The choices scripted (pick replaced): the sample ends with the first end-of-text it chooses."""
    model, config, step = ic.load_model(random_checkpoint(synthetic_dir, tmp_path))
    script = [5, 6, config.eot_token, 7, 8]
    for stop, expected in ((True, script[:3]), (False, script)):
        choices = iter(script)
        monkeypatch.setattr(sm, "pick", lambda *args: next(choices))
        assert sm.generate(model, config, step, [1], 5, stop_at_eot=stop) == expected


def byte_level_tokenizer_file(tmp_path) -> Path:
    """A tokenizer.json of GPT-2's 256 byte tokens (ids as GPT-2 numbers them) and no merges: the
    `tokenizers` package's byte-level BPE, as GPT-2's own file is, made here without the hub."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    import gpt2_token_bytes as gb
    chars = {b: c for c, b in gb.byte_of_char().items()}
    vocab = {chars[b]: i for i, b in enumerate(gb.BYTE_ORDER)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_a_text_prompt_goes_in_through_the_tokenizer_and_out_through_the_byte_table(synthetic_dir, tmp_path, capsys):
    path = random_checkpoint(synthetic_dir, tmp_path, vocab_size=50257, eot_token=50256)
    tokenizer = sm.gpt2_tokenizer(byte_level_tokenizer_file(tmp_path))
    assert sm.encode(tokenizer, "Hi é") == [39, 72, 220, 127, 102]  # GPT-2's ids of H, i, space, 0xC3, 0xA9
    code, out, err = run_cli(capsys, path, "--prompt=Hi é", f"--tokenizer_file={tmp_path / 'tokenizer.json'}",
                             "--temperature=0", "--max_new_tokens=5")
    assert code == 0, err
    assert out.splitlines()[1].startswith("Hi é")  # the prompt's bytes, decoded by the table


def test_gpt2_tokens_decode_through_the_byte_table():
    vocab = ic.Vocabulary(50257)
    assert vocab.text([15496, 262, 50256]) == "Hello the<|endoftext|>"
    assert vocab.text([127]) == "\ufffd"  # 0xC3 alone is not UTF-8
    assert vocab.text([127, 102]) == "é"
    assert ic.Vocabulary(500).text([3, 499]) == "<3> <499>"


def test_offline_without_a_cached_tokenizer_says_in_one_line_how_to_fetch_it():
    from huggingface_hub.errors import LocalEntryNotFoundError
    calls = []

    def download(**kwargs):
        calls.append(kwargs)
        raise LocalEntryNotFoundError("not cached")

    def probe():
        raise RuntimeError("https://huggingface.co is out of reach (ConnectionError: no network)")
    with pytest.raises(sm.TokenizerUnavailable) as e:
        sm.gpt2_tokenizer(None, download=download, probe=probe)
    message = str(e.value)
    assert "\n" not in message and "openai-community/gpt2/tokenizer.json is not in the hub cache" in message
    assert "hf_hub_download('openai-community/gpt2', 'tokenizer.json')" in message and "--tokenizer_file" in message
    assert [c.get("local_files_only") for c in calls] == [True]  # the cache only: no download was tried


def test_a_cached_tokenizer_is_read_without_the_network(tmp_path):
    file = byte_level_tokenizer_file(tmp_path)
    probe_calls = []
    tokenizer = sm.gpt2_tokenizer(None, download=lambda **kw: file, probe=lambda: probe_calls.append(1))
    assert sm.encode(tokenizer, "Hi") == [39, 72] and probe_calls == []


@pytest.mark.parametrize("argv, message", [
    (["--temperature=-1"], "--temperature must be a number >= 0"),
    (["--prompt_ids=1,x"], "--prompt_ids '1,x': give comma-separated token ids"),
    (["--prompt_ids=1,600"], "--prompt_ids: 600 is not a token id of this checkpoint (0..499)"),
    (["--prompt=hello"], "--prompt: this checkpoint's vocabulary has 500 tokens, not GPT-2's 50257"),
    (["--prompt=a", "--prompt_ids=1"], "not allowed with argument"),
    (["--max_new_tokens=0"], "--max_new_tokens must be at least 1"),
    (["--prompt_ids=" + ",".join(["1"] * 512)], "--prompt_ids: 512 tokens, and with the leading end-of-text more "
                                                "than the 512 this checkpoint's model attends over"),
])
def test_bad_input_is_one_line_and_exit_2(synthetic_dir, tmp_path, capsys, argv, message):
    code, out, err = run_cli(capsys, random_checkpoint(synthetic_dir, tmp_path), *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, tmp_path / "nothing")
    assert code == 2 and "no such checkpoint folder or .safetensors file" in err


def test_each_token_is_handed_on_as_it_is_made(synthetic_dir, tmp_path, monkeypatch):
    """generate's on_token sees every new token in order, before the next one is picked: the command
    line prints a long sample as it grows, not at its end."""
    model, config, step = ic.load_model(random_checkpoint(synthetic_dir, tmp_path))
    script, seen, picks = [5, 6, 7], [], []
    choices = iter(script)

    def pick(*args):
        picks.append(list(seen))  # what had been handed on when this token was picked
        return next(choices)
    monkeypatch.setattr(sm, "pick", pick)
    assert sm.generate(model, config, step, [1], 3, on_token=seen.append) == script == seen
    assert picks == [[], [5], [5, 6]]


def test_more_new_tokens_than_the_model_attends_over_are_refused_in_one_line(synthetic_dir, tmp_path, capsys):
    path = random_checkpoint(synthetic_dir, tmp_path)
    _, config, _ = ic.load_model(path)
    longest = ic.longest_sequence(config)
    code, out, err = run_cli(capsys, path, "--stop_at_eot=false", "--max_new_tokens=100000000")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"--max_new_tokens 100000000: at most {longest:,} with no prompt: the model attends over {longest:,}" in err


def test_every_forward_up_to_the_cap_sees_the_whole_prompt_and_one_more_token_would_not(synthetic_dir, tmp_path,
                                                                                       monkeypatch):
    """The contexts generate runs the model over (the model replaced: each forward's ids recorded), at the
    cap room_for_new_tokens gives and one past it: 3 prompt tokens after end-of-text leave 512 - 4 + 1."""
    model, config, step = ic.load_model(random_checkpoint(synthetic_dir, tmp_path))
    prompt = [5, 17, 42]
    assert ic.longest_sequence(config) == 512 and sm.room_for_new_tokens(config, prompt) == 509
    contexts = []

    def logits(model, ids, window):
        contexts.append(ids.tolist())
        return torch.zeros(config.vocab_size)
    monkeypatch.setattr(sm, "next_token_logits", logits)
    sm.generate(model, config, step, prompt, 509, temperature=0, stop_at_eot=False)
    assert len(contexts) == 509 and all(c[:4] == [config.eot_token, *prompt] for c in contexts)
    assert len(contexts[-1]) == 512
    contexts.clear()
    sm.generate(model, config, step, prompt, 510, temperature=0, stop_at_eot=False)
    assert contexts[-1][:3] == prompt  # the leading end-of-text fell out of the last forward


def test_the_new_token_cap_counts_the_prompt(synthetic_dir, tmp_path, capsys, monkeypatch):
    """With 3 prompt tokens, 512 - 3 new tokens are run (generate replaced: nothing is sampled) and one more is
    refused in one line."""
    path = random_checkpoint(synthetic_dir, tmp_path)
    asked = []
    monkeypatch.setattr(sm, "generate", lambda model, config, step, prompt, n, *args, **kwargs: asked.append(n) or [])
    code, _, err = run_cli(capsys, path, "--prompt_ids=5,17,42", "--max_new_tokens=509")
    assert code == 0 and asked == [509], err
    code, out, err = run_cli(capsys, path, "--prompt_ids=5,17,42", "--max_new_tokens=510")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--max_new_tokens 510: at most 509 with this 3-token prompt" in err


def test_streamed_gpt2_text_is_the_whole_texts_decoding():
    """A character split over two tokens shows once whole (an incremental UTF-8 decoder)."""
    vocab = ic.Vocabulary(50257)
    if vocab.offsets is None:
        pytest.skip("the committed GPT-2 byte table is missing")
    tokens = [40, 588, 50256, 31000, 13]
    piece = vocab.streamer()
    assert "".join(piece(t) for t in tokens) == vocab.text(tokens)
