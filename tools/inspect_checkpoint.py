"""Look inside a checkpoint: the learned mixing weights of every layer (which layers use which
input embedding, docs/ideas.md), and logit lenses that decode the residual stream and the
embeddings through the final norm and head.

    python tools/inspect_checkpoint.py checkpoints/medium/step_005690
    python tools/inspect_checkpoint.py CKPT --position 200 --top_k 5 --token 262

Prints, on the CPU in fp32:
1. per layer, the block lambdas (x, x00, x01, ...) and each embedding's lambda divided by the
   RMS of x at the layer's input (the embeddings are unit-RMS, so this is the share each one adds),
   measured on the first validation sequence;
2. a logit lens at one position of that sequence: the top-k tokens (and the probability of the
   true next token) read from x at each layer's input and after the last layer;
3. an embedding lens for one token id: its input embeddings, its value embeddings, and each
   value embedding passed through the o-projection of every layer that uses it.
The model runs as the trainer ran it at the checkpoint's step (its saved config): the attention
windows of that step, the rotary tables after the YaRN changes made so far, the input embedding
still tied to the head before --untie_embed_after_step; the sequence is at most as long as the
longest the run used (train_seq_len or val_seq_len), 2048 tokens by default.
GPT-2 tokens are printed as text when data/gpt2_tokens.bin is present, other vocabularies as ids.
torch and the trainer are imported inside the functions that use them, so a mistyped argument is
refused at once, before they load.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import OneLineParser, fail, first_line, os_error_line, run_main  # noqa: E402

if TYPE_CHECKING:
    import torch
    import train_gpt_medium as tg


def load_model(path: Path, device="cpu", dtype: str | None = "float32") -> tuple[tg.GPT, tg.Hyperparameters, int]:
    """The checkpoint's model (in eval mode), its config and its step: on `device`, in `dtype`
    (None: the dtype it was trained in; float32 by default, into which bf16 values copy exactly).
    `path` is a checkpoint folder or a .safetensors file of tools/export.py. CheckpointError naming
    the file for anything that is not a checkpoint this script can read; OSError for an unreadable file."""
    import train_gpt_medium as tg
    path = Path(path)
    if path.suffix == ".safetensors" and not path.is_dir():
        from tools.export import load_safetensors
        return load_safetensors(path, device, dtype)
    try:
        tg.validate_checkpoint(path)
    except (TypeError, AttributeError, KeyError) as e:  # meta.json is JSON, but not a checkpoint's record
        raise tg.CheckpointError(f"{path / 'meta.json'}: not a checkpoint's meta.json ({first_line(e)})")
    saved = tg._load(path / "main.pt")  # the trainer's loader: CheckpointError naming the file
    try:
        model, config = model_of(saved["config"], device, dtype)
        model.load_state_dict(saved["model"])  # bf16 values copy exactly into fp32
        step = int(saved["step"])
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:  # RuntimeError: parameter names or shapes
        raise tg.CheckpointError(f"{path / 'main.pt'}: holds no model this version of the trainer builds "
                                 f"({first_line(e)})")
    return model.eval(), config, step


class ToolInputError(Exception):
    """A tool's input that cannot be used: one line saying which and why (the tools print it as error:)."""


def missing_checkpoint(checkpoint: Path) -> str | None:
    """The error line for a checkpoint path that does not exist, or None: asked before torch loads (a
    file where a folder is meant is the trainer's validate_checkpoint's to name)."""
    return None if checkpoint.exists() else f"{checkpoint}: no such checkpoint folder or .safetensors file"


def load_for_tool(checkpoint: Path, device_flag: str, purpose: str) -> tuple[tg.GPT, tg.Hyperparameters, int, str]:
    """(model, config, step, device) for an after-run tool (--device auto|cuda|cpu): a checkpoint folder or
    a .safetensors file, fp32 on the CPU and in the trained dtype on CUDA. ToolInputError naming the file and
    what could not be done with it (`purpose`: "sampled", "scored") otherwise."""
    if problem := missing_checkpoint(checkpoint):
        raise ToolInputError(problem)
    import torch
    import train_gpt_medium as tg
    if device_flag == "cuda" and not torch.cuda.is_available():
        raise ToolInputError("--device cuda: no CUDA device here; use --device cpu")
    device = "cuda" if device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available()) else "cpu"
    try:
        model, config, step = load_model(checkpoint, device, "float32" if device == "cpu" else None)
    except (tg.CheckpointError, tg.ConfigError) as e:
        raise ToolInputError(str(e)) from e
    except OSError as e:
        raise ToolInputError(f"{os_error_line(e, checkpoint)}, so {checkpoint} cannot be {purpose}") from e
    return model, config, step, device


def model_of(saved_config: dict, device="cpu", dtype: str | None = "float32") -> tuple[tg.GPT, tg.Hyperparameters]:
    """The model a saved config (config_record) builds, initialized, and that config as the tools run
    it: in `dtype` (None: the saved one), eagerly, with attention through SDPA's dense mask, which
    applies the windows on any device (FlexAttention does so only compiled). KeyError, TypeError or
    ConfigError for a config this trainer cannot build."""
    import train_gpt_medium as tg
    known = {f.name for f in tg.fields(tg.Hyperparameters)}
    values = {k: v for k, v in saved_config.items() if k in known}
    config = tg.make_config(values.pop("preset"), **{**values, "dtype": dtype or values["dtype"], "resume": "",
                                                     "save_every": 0, "attention": "sdpa", "compile": False})
    return tg.build_model(config, device), config


class Vocabulary:
    """Token text for GPT-2 (from the committed byte table), `<id>` for any other vocabulary."""

    def __init__(self, vocab_size: int):
        lengths, blob = ROOT / "data/gpt2_token_bytes.npy", ROOT / "data/gpt2_tokens.bin"
        self.offsets = None
        if vocab_size == 50257 and lengths.exists() and blob.exists():
            self.offsets = np.concatenate([[0], np.cumsum(np.load(lengths).astype(np.int64))])
            self.blob = blob.read_bytes()

    def __call__(self, token: int) -> str:
        if self.offsets is None or token >= len(self.offsets) - 1:
            return f"<{token}>"
        raw = self.blob[self.offsets[token]:self.offsets[token + 1]]
        return repr(raw.decode("utf-8", errors="backslashreplace")) if raw else "<|endoftext|>"

    def streamer(self):
        """A function token -> the text it adds, for printing tokens as they come: GPT-2's bytes through
        an incremental UTF-8 decoder (a character split over tokens shows once whole), `<id> ` otherwise."""
        import codecs
        if self.offsets is None:
            return lambda token: f"<{token}> "
        decoder, eot = codecs.getincrementaldecoder("utf-8")(errors="replace"), len(self.offsets) - 2
        return lambda token: decoder.decode(b"<|endoftext|>" if token == eot else
                                            self.blob[self.offsets[token]:self.offsets[token + 1]])

    def text(self, tokens) -> str:
        """Tokens as the text they stand for. GPT-2: their raw bytes joined, then decoded as UTF-8 (a
        byte that is not valid there shows as U+FFFD), end-of-text as `<|endoftext|>`; a byte-level
        BPE decodes exactly so, no tokenizer needed. Other vocabularies: the ids, `<id>` each."""
        if self.offsets is None:
            return " ".join(f"<{t}>" for t in tokens)
        eot = len(self.offsets) - 2
        raw = b"".join(b"<|endoftext|>" if t == eot else self.blob[self.offsets[t]:self.offsets[t + 1]]
                       for t in tokens)
        return raw.decode("utf-8", errors="replace")


def lens(model: tg.GPT, h: torch.Tensor, k: int, normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over the real vocabulary of rows h (n, d) read through the final norm (unless
    `normed`: h is what the head reads), the head and the softcap, as the model reads its last
    layer. Returns (probs (n, V), top-k ids (n, k))."""
    import torch
    import train_gpt_medium as tg
    with torch.no_grad():
        probs = torch.softmax(model.logits(h if normed else tg.rms_norm(h)), dim=-1)[:, :model.config.vocab_size]
    return probs, probs.topk(k, dim=-1).indices


def at_step(model: tg.GPT, config: tg.Hyperparameters, step: int) -> torch.Tensor:
    """Set `model` as the trainer's Runner sets it for `step` (Runner.window, set_embedding_tie):
    rotary tables after the YaRN changes up to `step`, the input embedding tied to the head up to
    --untie_embed_after_step. Returns the forward's window argument, [long, short] in blocks."""
    import torch
    import train_gpt_medium as tg
    if config.yarn_window_limit:
        model.rotary.set_changes(tuple((old, new) for s, old, new in tg.yarn_changes(config) if s <= step))
    if tg.untie_step(config):
        model.embed_tied = step <= tg.untie_step(config)
    return torch.tensor(tg.attention_windows(step, config), dtype=torch.int32)


def longest_sequence(config: tg.Hyperparameters) -> int:
    """The longest sequence the run trained or validated on (the rotary tables' length)."""
    return max(config.train_seq_len, config.val_seq_len)


def layer_inputs(model: tg.GPT, ids: torch.Tensor, window: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """x entering each block (after its skip), and what the head reads: each (T, d). The head reads
    the backout's output where the model has one (already normed), else the last block's output
    (the lens norms it)."""
    import torch
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0][0])) for b in model.blocks]
    last = model.backout if model.backout is not None else model.blocks[-1]
    hooks.append(last.register_forward_hook(lambda m, args, out: seen.append(out if out.dim() == 2 else out[0])))
    try:
        with torch.no_grad():
            model(ids[:-1].to(torch.int32), ids[1:].to(torch.int64), window, reduction="none")
    finally:
        for h in hooks:
            h.remove()
    return seen[:-1], seen[-1]


def describe(model, h, k, vocab, target=None, normed: bool = False) -> str:
    probs, top = lens(model, h[None], k, normed)
    words = " ".join(f"{vocab(t)}:{probs[0, t]:.3f}" for t in top[0].tolist())
    return words + (f"   p(next={vocab(target)})={probs[0, target]:.6f}" if target is not None else "")


def report(model: tg.GPT, config: tg.Hyperparameters, step: int, val_tokens, position: int, k: int,
           token: int, seq_len: int) -> list[str]:
    import torch
    import train_gpt_medium as tg
    vocab, out = Vocabulary(config.vocab_size), []
    window = at_step(model, config, step)
    x0_weights = model.mixing_weights()[1]  # (L, input embeddings); None: §18 --mudd_gate sets them per token
    x0_weights = torch.zeros(config.num_layers, 0) if x0_weights is None else x0_weights.detach()
    inputs = None
    if val_tokens is not None:
        ids = val_tokens[:seq_len + 1].long()
        inputs, final = layer_inputs(model, ids, window)
    out.append(f"== lambdas per layer (step {step}); /rms: the embedding's lambda over the RMS of x at the layer's input")
    for i, line in enumerate(tg.learned_scalars_lines(model)[:config.num_layers]):  # as the run log ends
        if inputs is not None:
            rms = inputs[i].square().mean().sqrt().item()
            shares = " ".join(f"x0{e}/rms:{v / rms:+.4f}" for e, v in enumerate(x0_weights[i].tolist()))
            line += f"  rms(x):{rms:.3f} {shares}"
        out.append(line)
    if inputs is not None:
        position = min(position, len(inputs[0]) - 1)
        context = " ".join(vocab(t) for t in ids[max(position - 7, 0):position + 1].tolist())
        target = int(ids[position + 1])
        out.append(f"== logit lens at position {position}: ... {context} -> next {vocab(target)}")
        for i, x in enumerate(inputs):
            out.append(f"input of layer {i:2d}: {describe(model, x[position], k, vocab, target)}")
        out.append(f"after last layer:   {describe(model, final[position], k, vocab, target, model.backout is not None)}")
    with torch.no_grad():
        t = torch.tensor([token])
        out.append(f"== embedding lens for token {token} {vocab(token)}")
        for e, x0 in enumerate(model.input_embeddings(t)):  # x00 reads the head while tied
            out.append(f"x0{e}: {describe(model, x0[0, 0], k, vocab)}")
        tables = model.value_embeds(t)
        for layer, ve in enumerate(tables):
            if ve is None:
                continue
            o = model.blocks[layer].attn.qkvo_w[3]  # (d, attn_dim): rows are output features, used as y @ o^T
            out.append(f"value embedding of layer {layer:2d}: {describe(model, ve[0], k, vocab)}")
            out.append(f"  through its o-projection:  {describe(model, ve[0] @ o.T.to(ve.dtype), k, vocab)}")
    return out


def read_val_tokens(pattern: str, min_tokens: int) -> torch.Tensor:
    """The concatenated validation shards; FileNotFoundError or ShardError naming the problem."""
    import torch
    import train_gpt_medium as tg
    shards = []
    for f in tg.shard_files(pattern, "val_files"):
        try:
            shards.append(tg.read_shard(f))
        except OSError as e:  # a folder, no permission: as unusable as a corrupt shard
            raise tg.ShardError(os_error_line(e, f))
    tokens = torch.cat(shards)
    if tokens.numel() < min_tokens:
        raise tg.ShardError(f"--val_files {pattern}: {tokens.numel()} tokens, fewer than the {min_tokens} "
                            "that --seq_len needs; pass a smaller --seq_len")
    return tokens


def main(argv=None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (step_NNNNNN, holding meta.json) or a "
                                                     ".safetensors file of tools/export.py")
    parser.add_argument("--val_files", help="validation shards (default: the checkpoint's config)")
    parser.add_argument("--position", type=int, default=100, help="position of the logit lens in the first sequence")
    parser.add_argument("--top_k", type=int, default=5, help="tokens shown per lens, 1..vocab_size")
    parser.add_argument("--token", type=int, default=262, help="token id of the embedding lens (262 is ' the')")
    parser.add_argument("--seq_len", type=int,
                        help="tokens of the first validation sequence to run, a multiple of the checkpoint's "
                             "attn_block_size, at most its longest sequence (default: 2048 or that; the "
                             "CPU's dense mask is seq_len^2)")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error(f"--top_k must be at least 1, got {args.top_k}")
    if args.position < 0:
        parser.error(f"--position must be at least 0, got {args.position}")
    if problem := missing_checkpoint(args.checkpoint):
        return fail(problem)
    import train_gpt_medium as tg
    try:
        model, config, step = load_model(args.checkpoint)
    except (tg.CheckpointError, tg.ConfigError) as e:
        return fail(str(e))
    except OSError as e:  # a file of the checkpoint that cannot be read (permissions, a folder in its place)
        return fail(f"{os_error_line(e, args.checkpoint)}, so {args.checkpoint} cannot be inspected")
    if not 0 <= args.token < config.vocab_size:
        parser.error(f"--token must be in [0, {config.vocab_size})")
    if args.top_k > config.vocab_size:
        parser.error(f"--top_k must be at most the vocabulary size {config.vocab_size}, got {args.top_k}")
    longest = longest_sequence(config)
    if args.seq_len is None:
        bs = config.attn_block_size  # longest is a multiple of it (the trainer checks)
        args.seq_len = min(max(2048 // bs, 1) * bs, longest)
    if args.seq_len <= 0 or args.seq_len % config.attn_block_size:
        parser.error(f"--seq_len must be a positive multiple of {config.attn_block_size}")
    if args.seq_len > longest:  # the rotary tables (and what the model was trained on) end there
        parser.error(f"--seq_len must be at most {longest}, the longest sequence this checkpoint's run "
                     f"used (train_seq_len {config.train_seq_len}, val_seq_len {config.val_seq_len})")
    val_tokens = None
    try:
        val_tokens = read_val_tokens(args.val_files or config.val_files, args.seq_len + 1)
    except (FileNotFoundError, tg.ShardError) as e:
        if args.val_files:  # asked for by name: an input error
            return fail(f"{e}; pass --val_files=PATTERN with readable validation shards")
        print(f"note: no logit lens over the residual stream ({e})", file=sys.stderr)
    print("\n".join(report(model, config, step, val_tokens, args.position, args.top_k, args.token, args.seq_len)))
    return 0


if __name__ == "__main__":
    run_main(main)
