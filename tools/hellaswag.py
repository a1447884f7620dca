"""HellaSwag accuracy of a checkpoint: which of four endings the model finds likeliest.

    python tools/hellaswag.py checkpoints/medium/step_004740              # the validation set, 10,042 items
    python tools/hellaswag.py CKPT --hellaswag_file=hellaswag_val.jsonl --limit=1000
    python tools/hellaswag.py --fetch                                     # cache the set and the tokenizer
    python tools/hellaswag.py --write_synthetic=items.jsonl --items=200   # items for a tiny synthetic-data model

Each ending is scored by the model's loss on its tokens after the context: acc_norm picks the
ending of lowest mean loss per token, acc the lowest sum (nanoGPT's and llm.c's "acc_norm" and
"acc"; upstream's short-track evaluation reports the mean). Each is printed with its standard error
sqrt(p (1 - p) / n). The trainer's --eval_hellaswag runs the same code after training, untimed.

Every candidate (context + one ending) is a document of its own: end-of-text, the context's
tokens, the ending's (` ` + ending, as GPT-2 tokenizes a following word). Candidates are packed
one after another into sequences of --seq_len tokens, padded with end-of-text; the document masks
keep each one to itself, as training keeps its packed documents, and like them a candidate's first
token still reads the previous one's last token through the smear, the key offset and the bigram
hash. The model runs as at the checkpoint's step (tools/sample.py's docstring says what that sets).

Rows: the hub's validation set (Rowan/hellaswag, Parquet, fetched once and cached), or a file:
.jsonl (one JSON object per line, as the original hellaswag_val.jsonl) or .parquet, each row
{"ctx": text, "endings": [text, ...], "label": k} (GPT-2 checkpoints only), or, for any
vocabulary, {"ctx_ids": [ids], "ending_ids": [[ids], ...], "label": k}.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import (  # noqa: E402
    OneLineParser, fail, first_line, make_parent, os_error_line, output_file_problem, run_main)

if TYPE_CHECKING:
    import torch
    import train_gpt_medium as tg

HUB_SET = dict(repo_id="Rowan/hellaswag", filename="default/validation/0000.parquet", repo_type="dataset",
               revision="refs/convert/parquet")  # the hub's Parquet copy of the validation split, 10,042 rows
GPT2_VOCAB = 50257
DEFAULT_SEQ_LEN = 2048  # tokens per packed sequence (at most the run's longest): the dense CPU/SDPA mask is T^2


class HellaSwagError(ValueError):
    """Rows that cannot be scored, or a set that cannot be had; the message names the file and row."""


@dataclass
class Item:
    context: list[int]
    endings: list[list[int]]
    label: int


# ---- rows and items

def read_rows(path: Path) -> list[dict]:
    """The rows of a .jsonl or .parquet file; HellaSwagError naming the file (and line) otherwise."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet
        except ImportError:
            raise HellaSwagError(f"{path}: reading Parquet needs the pyarrow package (pip install -r requirements.txt)")
        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except OSError as e:
            raise HellaSwagError(f"{path}: {os_error_line(e, path).split(': ', 1)[-1]}")
        except Exception as e:  # pyarrow's ArrowInvalid and kin
            raise HellaSwagError(f"{path}: not a readable Parquet file ({first_line(e)})")
    if path.suffix != ".jsonl":
        raise HellaSwagError(f"{path}: give a .jsonl or .parquet file of HellaSwag rows")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise HellaSwagError(os_error_line(e, path))
    except UnicodeDecodeError:
        raise HellaSwagError(f"{path}: not UTF-8 text; give a .jsonl file of HellaSwag rows")
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise HellaSwagError(f"{path}:{number}: not a JSON object ({e})")
    return rows


def items_of(rows: list[dict], where: str, vocab_size: int, tokenizer=None) -> list[Item]:
    """Items from rows; `tokenizer()` gives GPT-2's tokenizer for rows of text (called once, if any).
    HellaSwagError naming the row for a row that is not an item of this vocabulary."""
    items, tok = [], None
    for number, row in enumerate(rows, start=1):
        at = f"{where} row {number}"
        if not isinstance(row, dict):
            raise HellaSwagError(f"{at}: not a JSON object")
        try:
            label = int(row["label"])
            if "ctx_ids" in row:
                context = [int(t) for t in row["ctx_ids"]]
                endings = [[int(t) for t in e] for e in row["ending_ids"]]
            else:
                if vocab_size != GPT2_VOCAB:
                    raise HellaSwagError(f"{at}: a row of text, and this model's vocabulary is not GPT-2's "
                                         f"({vocab_size} tokens); give rows of ctx_ids and ending_ids")
                tok = tok or tokenizer()
                context = tok.encode(row["ctx"], add_special_tokens=False).ids
                endings = [tok.encode(" " + e, add_special_tokens=False).ids for e in row["endings"]]
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, HellaSwagError):
                raise
            raise HellaSwagError(f"{at}: needs ctx, endings and label (or ctx_ids, ending_ids and label) "
                                 f"({first_line(e)})")
        if len(endings) < 2 or not all(endings) or not 0 <= label < len(endings):
            raise HellaSwagError(f"{at}: needs at least two non-empty endings and a label among them "
                                 f"(got {len(endings)} endings, label {label})")
        if bad := [t for t in context + sum(endings, []) if not 0 <= t < vocab_size]:
            raise HellaSwagError(f"{at}: token {bad[0]} is not in this model's vocabulary (0..{vocab_size - 1})")
        items.append(Item(context, endings, label))
    if not items:
        raise HellaSwagError(f"{where}: no rows")
    return items


def hub_rows_file(download=None, probe=None) -> Path:
    """The hub's validation set in the local cache (fetched on first use). HubFileUnavailable offline."""
    from tools.hub import cached_file
    return cached_file(**HUB_SET, download=download, probe=probe)


def load_items(hellaswag_file: str, vocab_size: int, tokenizer_file: Path | None = None, download=None,
               probe=None) -> list[Item]:
    """The items of `hellaswag_file` ('': the hub's validation set). HellaSwagError (a file, a row)
    or TokenizerUnavailable / HubFileUnavailable (what the hub could not give) otherwise."""
    from tools.sample import gpt2_tokenizer
    path = Path(hellaswag_file) if hellaswag_file else hub_rows_file(download, probe)
    if path.is_dir():
        raise HellaSwagError(f"{path}: is a folder; give a .jsonl or .parquet file of HellaSwag rows")
    if not path.is_file():
        raise HellaSwagError(f"{path}: no such file; give a .jsonl or .parquet file of HellaSwag rows")
    return items_of(read_rows(path), str(path), vocab_size, lambda: gpt2_tokenizer(tokenizer_file, download, probe))


# ---- packing and scoring

@dataclass
class Packed:
    tokens: np.ndarray  # (seq_len + 1,) the candidates one after another, then end-of-text padding
    spans: list[tuple[int, int, int, int]]  # (item, ending, start, end): its tokens' losses are losses[start:end]


def pack(items: list[Item], seq_len: int, eot: int) -> tuple[list[Packed], int]:
    """Candidates as documents (end-of-text, context, ending) in sequences of seq_len inputs (and
    one more target); a candidate longer than a sequence keeps the end of its context. Returns the
    sequences and how many contexts were cut."""
    out, cut = [], set()
    tokens, spans = [], []

    def close():
        buf = np.full(seq_len + 1, eot, dtype=np.int64)
        buf[:len(tokens)] = tokens
        out.append(Packed(buf, list(spans)))
        tokens.clear()
        spans.clear()
    for i, item in enumerate(items):
        for j, ending in enumerate(item.endings):
            room = seq_len - 1 - len(ending)  # the document fits in the seq_len inputs
            if room < 0:
                raise HellaSwagError(f"item {i + 1}: an ending of {len(ending)} tokens does not fit a "
                                     f"sequence of {seq_len}")
            context = item.context[max(len(item.context) - room, 0):]
            if len(context) < len(item.context):
                cut.add(i)
            if len(tokens) + 1 + len(context) + len(ending) > seq_len:
                close()
            start = len(tokens) + len(context)  # the loss index of the ending's first token (its previous position)
            tokens.extend([eot, *context, *ending])
            spans.append((i, j, start, start + len(ending)))
    if tokens:
        close()
    return out, len(cut)


def ending_losses(forward, packed: list[Packed], items: list[Item], device) -> list[list[tuple[float, int]]]:
    """(summed loss, tokens) of every ending of every item; forward(inputs, targets) -> (T,) losses."""
    import torch
    scores = [[None] * len(item.endings) for item in items]
    for seq in packed:
        buf = torch.from_numpy(seq.tokens).to(device)
        losses = forward(buf[:-1].to(torch.int32), buf[1:]).double().cpu()  # one host copy per sequence
        for i, j, start, end in seq.spans:
            scores[i][j] = (float(losses[start:end].sum()), end - start)
    return scores


def accuracy(scores: list[list[tuple[float, int]]], items: list[Item]) -> dict:
    """acc (lowest summed loss) and acc_norm (lowest mean loss), each with its standard error."""
    n = len(items)
    right = dict(acc=0, acc_norm=0)
    for item, endings in zip(items, scores):
        right["acc"] += int(np.argmin([s for s, _ in endings])) == item.label
        right["acc_norm"] += int(np.argmin([s / c for s, c in endings])) == item.label
    out = dict(items=n)
    for key, k in right.items():
        p = k / n
        out.update({key: p, f"{key}_stderr": math.sqrt(p * (1 - p) / n), f"{key}_right": k})
    return out


def default_seq_len(config: tg.Hyperparameters) -> int:
    from tools.inspect_checkpoint import longest_sequence
    bs = config.attn_block_size
    return min(max(DEFAULT_SEQ_LEN // bs, 1) * bs, longest_sequence(config))


def evaluate(model: tg.GPT, config: tg.Hyperparameters, step: int, items: list[Item],
             seq_len: int | None = None) -> dict:
    """Accuracies of `model` set as at `step`, eval mode, SDPA attention (model.config is swapped for
    the call, then put back). The model's training mode and config are restored afterwards."""
    import dataclasses
    import torch
    from tools.inspect_checkpoint import at_step
    seq_len = seq_len or default_seq_len(config)
    device = next(model.parameters()).device
    packed, cut = pack(items, seq_len, config.eot_token)
    saved_config, was_training = model.config, model.training
    model.config = dataclasses.replace(model.config, attention="sdpa")  # windows applied eagerly on any device
    model.eval()
    try:
        window = at_step(model, config, step).to(device)
        with torch.no_grad():
            scores = ending_losses(lambda x, y: model(x, y, window, reduction="none"), packed, items, device)
    finally:
        model.config = saved_config
        model.train(was_training)
    return dict(accuracy(scores, items), step=step, contexts_cut=cut, sequences=len(packed), seq_len=seq_len)


def result_line(result: dict, seconds: float | None = None) -> str:
    """One line: `hellaswag: acc_norm:0.2950(0.0046) acc:0.2870(0.0045) items:10042 ...`."""
    line = (f"hellaswag: acc_norm:{result['acc_norm']:.4f}({result['acc_norm_stderr']:.4f}) "
            f"acc:{result['acc']:.4f}({result['acc_stderr']:.4f}) items:{result['items']} step:{result['step']}")
    if result["contexts_cut"]:
        line += f" contexts_cut:{result['contexts_cut']}"
    if seconds is not None:
        line += f" eval_time:{seconds:.1f}s (untimed)"
    return line


# ---- a fixture for models of the synthetic data (data/synthetic.py)

def synthetic_items(P: np.ndarray, eot: int, count: int, seed: int, context_tokens: int = 12,
                    ending_tokens: int = 4, wrong_endings: int = 3, impossible_tokens: int = 1) -> list[dict]:
    """Rows whose right ending is forced by the chain P: the context and the right ending are a walk
    of the chain from a document's start (never through end-of-text); a wrong ending's first
    `impossible_tokens` tokens are each one the chain never lets follow the token before it (P = 0),
    drawn by the tokens' stationary frequencies (so that token counts alone do not tell the endings
    apart), the rest a walk of the chain again. The chain gives every wrong ending probability 0 and
    the right one more, so a model of it scores the right ending first. Wrong endings are
    ending_tokens - 1 .. + 1 long."""
    sys.path.insert(0, str(ROOT / "data"))
    from synthetic import stationary
    rng, frequency = np.random.default_rng(seed), stationary(P)

    def follow(state: int) -> int:
        p = P[state].copy()
        p[eot] = 0
        return int(rng.choice(len(p), p=p / p.sum()))

    def impossible(state: int) -> int:
        weights = np.where((P[state] == 0) & (np.arange(len(P)) != eot), frequency, 0.0)
        return int(rng.choice(len(P), p=weights / weights.sum()))
    rows = []
    for _ in range(count):
        walk = [eot]
        for _ in range(context_tokens + ending_tokens):
            walk.append(follow(walk[-1]))
        context, right = walk[1:1 + context_tokens], walk[1 + context_tokens:]
        endings = []
        for _ in range(wrong_endings):
            ending, state = [], context[-1]
            for k in range(int(rng.integers(max(ending_tokens - 1, 1), ending_tokens + 2))):
                state = impossible(state) if k < impossible_tokens else follow(state)
                ending.append(state)
            endings.append(ending)
        label = int(rng.integers(wrong_endings + 1))
        endings.insert(label, right)
        rows.append(dict(ctx_ids=context, ending_ids=endings, label=label))
    return rows


def synthetic_rows(meta_file: Path, count: int, seed: int) -> list[dict]:
    """--write_synthetic's rows for the chain data/synthetic.py made (its synthetic_meta.json names it)."""
    sys.path.insert(0, str(ROOT / "data"))
    import synthetic
    meta = json.loads(Path(meta_file).read_text())
    P = synthetic.markov_chain(meta["vocab_size"], meta["eot_token"], meta["seed"])
    return synthetic_items(P, meta["eot_token"], count, seed)


# ---- the trainer's --eval_hellaswag (tools/after_run.py calls these)

def prepare(config: tg.Hyperparameters) -> list[Item]:
    """Before training: the items of --hellaswag_file (or the hub's set). ConfigError naming the flag."""
    import train_gpt_medium as tg
    from tools.hub import HubFileUnavailable
    from tools.sample import TokenizerUnavailable
    flag = "--hellaswag_file" if config.hellaswag_file else "--eval_hellaswag"
    try:
        return load_items(config.hellaswag_file, config.vocab_size)
    except (HellaSwagError, HubFileUnavailable, TokenizerUnavailable) as e:
        fix = "" if config.hellaswag_file else "; or pass --hellaswag_file=PATH (rows in .jsonl or .parquet)"
        raise tg.ConfigError(f"{flag}: {e}{fix}")


# ---- command line

def main(argv=None, download=None, probe=None) -> int:
    """The command line; `download` and `probe` replace the hub's in tests (tools/hub.py)."""
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, nargs="?", help="a checkpoint folder (step_NNNNNN) or a "
                        ".safetensors file of tools/export.py")
    parser.add_argument("--hellaswag_file", type=Path, help="rows (.jsonl or .parquet); default: the hub's "
                        "validation set, fetched once and cached")
    parser.add_argument("--limit", type=int, default=0, help="score the first N items only; 0: all (default)")
    parser.add_argument("--seq_len", type=int, help=f"tokens per packed sequence, a multiple of the checkpoint's "
                        f"attn_block_size, at most its longest (default: {DEFAULT_SEQ_LEN} or that)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda where there is one (default: %(default)s)")
    parser.add_argument("--tokenizer_file", type=Path, help="GPT-2's tokenizer.json (default: the hub's, cached)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object as well")
    parser.add_argument("--fetch", action="store_true", help="only put the hub's validation set and GPT-2's "
                        "tokenizer into the cache, then exit")
    parser.add_argument("--write_synthetic", type=Path, metavar="OUT.jsonl", help="only write --items rows for a "
                        "model of the synthetic data (--synthetic_meta names its chain), then exit")
    parser.add_argument("--items", type=int, default=200, help="rows --write_synthetic writes (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="let --write_synthetic replace its file if it "
                        "exists (default: keep it, and stop)")
    parser.add_argument("--synthetic_meta", type=Path, default=ROOT / "data/synthetic/synthetic_meta.json",
                        help="the chain's synthetic_meta.json (default: the tiny preset's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --write_synthetic (default: %(default)s)")
    args = parser.parse_args(argv)
    from tools.hub import HubFileUnavailable
    from tools.sample import TokenizerUnavailable, gpt2_tokenizer
    if args.fetch:
        try:
            print(f"cached: {hub_rows_file(download, probe)}")
            gpt2_tokenizer(None, download, probe)
        except (HubFileUnavailable, TokenizerUnavailable) as e:
            return fail(str(e))
        print("cached: GPT-2's tokenizer.json")
        return 0
    if args.write_synthetic:
        if args.items < 1:
            parser.error(f"--items must be at least 1, got {args.items}")
        if problem := output_file_problem(args.write_synthetic, "--write_synthetic", args.overwrite):
            return fail(problem)
        try:
            rows = synthetic_rows(args.synthetic_meta, args.items, args.seed)
        except (OSError, KeyError, ValueError) as e:
            return fail(f"--synthetic_meta {args.synthetic_meta}: {first_line(e)}; make the data with "
                        "python data/synthetic.py (or a tiny run) first")
        try:
            make_parent(args.write_synthetic)
            args.write_synthetic.write_text("".join(json.dumps(r) + "\n" for r in rows))
        except OSError as e:
            return fail(f"--write_synthetic {os_error_line(e, args.write_synthetic)}; choose another file")
        print(f"wrote {args.items} rows to {args.write_synthetic}")
        return 0
    if args.checkpoint is None:
        parser.error("give a checkpoint (or --fetch, or --write_synthetic)")
    if args.limit < 0:
        parser.error(f"--limit must be at least 0, got {args.limit}")
    import time
    import torch
    import train_gpt_medium as tg
    from tools.inspect_checkpoint import ToolInputError, load_for_tool, longest_sequence
    try:
        model, config, step, device = load_for_tool(args.checkpoint, args.device, "scored")
    except ToolInputError as e:
        return fail(str(e))
    longest, bs = longest_sequence(config), config.attn_block_size
    if args.seq_len is not None and not (0 < args.seq_len <= longest and args.seq_len % bs == 0):
        parser.error(f"--seq_len must be a positive multiple of {bs}, at most {longest} (this checkpoint's "
                     "longest sequence)")
    try:
        items = load_items(str(args.hellaswag_file or ""), config.vocab_size, args.tokenizer_file, download, probe)
    except (HellaSwagError, HubFileUnavailable, TokenizerUnavailable) as e:
        return fail(str(e) + ("" if args.hellaswag_file else "; or pass --hellaswag_file=PATH (rows in .jsonl or "
                                                             ".parquet)"))
    items = items[:args.limit] if args.limit else items
    t0 = time.perf_counter()
    result = evaluate(model, config, step, items, args.seq_len)
    print(result_line(result, time.perf_counter() - t0))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    run_main(main)
