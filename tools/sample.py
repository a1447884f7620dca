"""Text from a checkpoint: what the model writes after a prompt.

    python tools/sample.py checkpoints/medium/step_004740 --prompt "The meaning of life is"
    python tools/sample.py CKPT --prompt_ids=464,3139 --max_new_tokens=50 --temperature=0     # greedy
    python tools/sample.py CKPT --num_samples=3 --temperature=0.8 --top_k=50 --seed=1
    python tools/sample.py medium.safetensors --prompt "Hello"          # a file of tools/export.py

The model runs as the trainer ran it at the checkpoint's step (any recipe, saved on any number of
processes: main.pt holds the whole model): the attention windows of that step (the final
validation's at the last step), the rotary tables after the YaRN changes so far, the input
embedding still tied to the head before the split, MUDD and the bigram table where the recipe has
them. Eagerly, in eval mode, with attention through SDPA's dense mask (FlexAttention applies the
windows only when compiled); on the CPU in float32 (bf16 weights copy exactly), on CUDA in the
dtype it trained in.

The sample is one document: it starts with end-of-text, as every training document does, then the
prompt, and stops at the next end-of-text (--stop_at_eot=false: goes on into the next document).
The whole sample stays within the longest sequence the run used (its rotary tables): --max_new_tokens
is refused past what the prompt leaves of it, where the context would drop the prompt.

No key-value cache: each new token runs the model's own forward over the whole context again,
O(T^2) per token on a short context. A cache would need a second, incremental implementation of
the attention path (document masks, the two sliding windows, the key offset reading the previous
position, value embeddings, smear and bigram rows reading the previous token, MUDD's mixes) next
to the one the trainer runs and the tests check; recomputing keeps exactly the trained forward.
Its cost: the whole forward per token (docs/after-run.md: about 40 ms for the tiny model on 2 CPU cores).

Text prompts are encoded with GPT-2's tokenizer (the `tokenizers` package; its tokenizer.json is
fetched from the hub once and cached, or given by --tokenizer_file). Output is decoded through the
committed token-bytes table (data/gpt2_tokens.bin), no tokenizer needed; a vocabulary other than
GPT-2's (the tiny preset's synthetic one) prints token ids.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import OneLineParser, fail, run_main  # noqa: E402

if TYPE_CHECKING:
    import torch
    import train_gpt_medium as tg

GPT2_VOCAB = 50257
TOKENIZER_FILE = ("openai-community/gpt2", "tokenizer.json")  # GPT-2's byte-level BPE on the hub


# ---- the model at inference

def head_inputs(model: tg.GPT, ids: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """What the head reads at every position of `ids` (T,), (T, d): taken from the model's own
    forward (its loss is skipped), so nothing of the forward is written twice. The sequence is
    padded to whole attention blocks with end-of-text tokens after it (new documents that the
    causal mask keeps out of every earlier position)."""
    import torch
    cfg = model.config
    T, bs = ids.numel(), cfg.attn_block_size
    padded = torch.full((-(-T // bs) * bs,), cfg.eot_token, dtype=torch.int32, device=ids.device)
    padded[:T] = ids
    seen = []

    def keep_head_input(x, targets, *args, **kwargs):  # stands in for GPT.loss during this forward
        seen.append(x)
        return x.new_zeros(())
    model.loss = keep_head_input
    try:
        with torch.no_grad():
            model(padded, torch.zeros(padded.numel(), dtype=torch.int64, device=ids.device), window,
                  reduction="none")
    finally:
        del model.loss  # the class's own loss again
    return seen[0][:T]


def next_token_logits(model: tg.GPT, ids: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Soft-capped fp32 logits (vocab_size,) of the token after `ids`, as the eval forward makes them
    (the padded vocabulary rows left out)."""
    import torch
    with torch.no_grad():
        return model.logits(head_inputs(model, ids, window)[-1:])[0, :model.config.vocab_size].float()


def pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """The next token: argmax at temperature 0 (the lowest id among equal maxima), else a draw from
    softmax(logits / temperature) over the top_k largest (0: all), from `gen` on the CPU, so a seed
    gives the same draw on every device."""
    import torch
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.double().cpu() / temperature
    if 0 < top_k < scaled.numel():
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen))


def document_start(config: tg.Hyperparameters, prompt: list[int]) -> list[int]:
    """The context before the first new token: end-of-text, then the prompt (unless it starts with one)."""
    return list(prompt) if prompt[:1] == [config.eot_token] else [config.eot_token, *prompt]


def room_for_new_tokens(config: tg.Hyperparameters, prompt: list[int]) -> int:
    """The most new tokens whose every forward still sees the whole document start (longest_sequence
    minus what the start takes; the last new token is never fed back, so it costs no room). Below 1:
    the start alone is longer than the model attends over."""
    from tools.inspect_checkpoint import longest_sequence
    return longest_sequence(config) - len(document_start(config, prompt)) + 1


def generate(model: tg.GPT, config: tg.Hyperparameters, step: int, prompt: list[int], max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, gen: torch.Generator | None = None,
             stop_at_eot: bool = True, on_token=None) -> list[int]:
    """New tokens after `prompt`, one forward over the whole context per token (no cache: see the
    module's docstring). The context starts with end-of-text unless the prompt does. on_token(token):
    called with each new token as it is made (the command line prints it then)."""
    import torch
    from tools.inspect_checkpoint import at_step, longest_sequence
    gen = gen or torch.Generator().manual_seed(0)
    window = at_step(model, config, step).to(next(model.parameters()).device)
    context = document_start(config, prompt)
    longest, new = longest_sequence(config), []
    device = window.device
    for _ in range(max_new_tokens):
        ids = torch.tensor(context[-longest:], dtype=torch.int64, device=device)
        token = pick(next_token_logits(model, ids, window), temperature, top_k, gen)
        context.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
        if stop_at_eot and token == config.eot_token:
            break
    return new


# ---- text in, text out

class TokenizerUnavailable(RuntimeError):
    """GPT-2's tokenizer cannot be had here; the message says how to get it."""


def gpt2_tokenizer(tokenizer_file: Path | None = None, download=None, probe=None):
    """GPT-2's tokenizer (a `tokenizers.Tokenizer`): from `tokenizer_file`, else the hub's file
    (cached after the first fetch). TokenizerUnavailable with the way out otherwise."""
    from tools.hub import HubFileUnavailable, cached_file
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerUnavailable("--prompt needs the `tokenizers` package (pip install -r requirements.txt), "
                                   "or give the prompt as --prompt_ids")
    if tokenizer_file is None:
        try:
            tokenizer_file = cached_file(*TOKENIZER_FILE, download=download, probe=probe)
        except HubFileUnavailable as e:
            raise TokenizerUnavailable(f"--prompt needs GPT-2's tokenizer: {e}; or pass --tokenizer_file=PATH "
                                       "(a tokenizer.json), or give the prompt as --prompt_ids")
    try:
        return Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library raises its own Exception for a bad file
        raise TokenizerUnavailable(f"--tokenizer_file {tokenizer_file}: not a tokenizer.json the `tokenizers` "
                                   f"package reads ({str(e).splitlines()[0] if str(e) else type(e).__name__})")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def parse_ids(text: str) -> list[int]:
    """`1,2,3` as [1, 2, 3]; ValueError for anything else."""
    ids = [int(part) for part in text.split(",") if part.strip()]
    if not ids:
        raise ValueError("no ids")
    return ids


def main(argv=None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (step_NNNNNN) or a .safetensors file "
                                                     "of tools/export.py")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (GPT-2's tokenizer; default: none, a document from its start)")
    prompt.add_argument("--prompt_ids", help="prompt as token ids, e.g. 464,3139")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0: greedy, the "
                        "argmax each time (default: %(default)s)")
    parser.add_argument("--top_k", type=int, default=0, help="draw among the k likeliest tokens; 0: all "
                        "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: %(default)s)")
    parser.add_argument("--num_samples", type=int, default=1, help="samples, one after another (default: %(default)s)")
    parser.add_argument("--stop_at_eot", default="true", choices=("true", "false"),
                        help="end a sample at end-of-text (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda where there is one (default: %(default)s)")
    parser.add_argument("--tokenizer_file", type=Path, help="GPT-2's tokenizer.json (default: the hub's, cached)")
    args = parser.parse_args(argv)
    for flag, value, low in (("--max_new_tokens", args.max_new_tokens, 1), ("--top_k", args.top_k, 0),
                             ("--num_samples", args.num_samples, 1), ("--seed", args.seed, 0)):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        parser.error(f"--temperature must be a number >= 0, got {args.temperature}")
    prompt_ids = []
    if args.prompt_ids is not None:
        try:
            prompt_ids = parse_ids(args.prompt_ids)
        except ValueError:
            parser.error(f"--prompt_ids {args.prompt_ids!r}: give comma-separated token ids, e.g. 464,3139")
    import torch
    import train_gpt_medium as tg
    from tools.inspect_checkpoint import ToolInputError, Vocabulary, load_for_tool, longest_sequence
    try:
        model, config, step, device = load_for_tool(args.checkpoint, args.device, "sampled")
    except ToolInputError as e:
        return fail(str(e))
    if args.prompt is not None:
        if config.vocab_size != GPT2_VOCAB:
            return fail(f"--prompt: this checkpoint's vocabulary has {config.vocab_size} tokens, not GPT-2's "
                        f"{GPT2_VOCAB}: text cannot be encoded for it; give the prompt as --prompt_ids")
        try:
            prompt_ids = encode(gpt2_tokenizer(args.tokenizer_file), args.prompt)
        except TokenizerUnavailable as e:
            return fail(str(e))
    if bad := [t for t in prompt_ids if not 0 <= t < config.vocab_size]:
        return fail(f"--prompt_ids: {bad[0]} is not a token id of this checkpoint (0..{config.vocab_size - 1})")
    # past the longest sequence the context keeps only its last tokens: the prompt would be forgotten
    longest, room = longest_sequence(config), room_for_new_tokens(config, prompt_ids)
    if room < 1:
        flag = "--prompt" if args.prompt is not None else "--prompt_ids"
        return fail(f"{flag}: {len(prompt_ids):,} tokens, and with the leading end-of-text more than the {longest:,} "
                    "this checkpoint's model attends over (its longest sequence); shorten the prompt")
    if args.max_new_tokens > room:
        prompt_text = f"this {len(prompt_ids):,}-token prompt" if prompt_ids else "no prompt"
        return fail(f"--max_new_tokens {args.max_new_tokens}: at most {room:,} with {prompt_text}: the model attends "
                    f"over {longest:,} tokens (its longest sequence), end-of-text, the prompt and every new token but "
                    "the last; past that the context would drop the prompt")
    vocab, gen = Vocabulary(config.vocab_size), torch.Generator().manual_seed(args.seed)
    for k in range(args.num_samples):
        # each token printed as it is made (one forward per token: a long sample shows as it grows)
        print(f"--- sample {k + 1}/{args.num_samples} (step {step}, up to {args.max_new_tokens} new tokens, "
              f"temperature {args.temperature:g}, top_k {args.top_k or 'all'}, seed {args.seed})")
        piece = vocab.streamer()
        print("".join(piece(t) for t in prompt_ids), end="", flush=True)
        new = generate(model, config, step, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, gen,
                       args.stop_at_eot == "true", on_token=lambda t: print(piece(t), end="", flush=True))
        print(f"\n--- {len(new)} new tokens", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
