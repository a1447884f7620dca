"""A checkpoint's model weights as one safetensors file, and back.

    python tools/export.py checkpoints/medium/step_004740 --out medium.safetensors            # fp32
    python tools/export.py checkpoints/medium/step_004740 --out medium-bf16.safetensors --dtype bf16

The file holds the model's state (every tensor of `model.state_dict()`, under the trainer's own
names) and nothing of the optimizers, in fp32 or bf16, with the run's config (JSON), the step and
the trained dtype as metadata. It is not a Hugging Face `transformers` model: the architecture is
this trainer's, so the way back is `load_safetensors` (or any tool here given the .safetensors file
in place of a checkpoint folder: tools/sample.py, tools/hellaswag.py, tools/inspect_checkpoint.py),
which builds the model from the config in the metadata and loads the weights into it. The step
matters for the way back: it sets the attention windows, the YaRN tables and, before the
embedding split, the tie of the input table to the head, as the trainer set them at that step.

After writing, the file is read back through `load_safetensors` and compared with the checkpoint,
tensor by tensor, bit for bit (with --dtype bf16: with the checkpoint's values rounded to bf16);
any difference is an error. Exit codes: 0 written and verified, 2 bad input (nothing written).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import (  # noqa: E402
    OneLineParser, fail, first_line, make_parent, move_into_place, os_error_line, output_file_problem, run_main)

if TYPE_CHECKING:
    import torch
    import train_gpt_medium as tg

FORMAT = "train_gpt_medium.safetensors/1"  # metadata["format"] of the files this script writes
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def checkpoint_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(model state as saved, saved config, step) of a validated checkpoint folder; the model is built
    once from them (tools/inspect_checkpoint.load_model) so that a file is written only for a
    checkpoint this trainer can load. CheckpointError naming the file otherwise."""
    import train_gpt_medium as tg
    from tools.inspect_checkpoint import load_model
    load_model(path)  # validates meta.json, the hashes, the config and every parameter's shape
    saved = tg._load(Path(path) / "main.pt")
    return saved["model"], saved["config"], int(saved["step"])


def export_tensors(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The state as the file stores it: floating tensors cast to `dtype` (fp32 from bf16 is exact;
    bf16 from fp32 rounds to nearest even), others as they are; each contiguous, none sharing memory."""
    import torch
    target = getattr(torch, DTYPES[dtype])
    return {name: (t.to(target) if t.is_floating_point() else t).contiguous().clone() for name, t in state.items()}


def metadata(config: dict, step: int, dtype: str, source: Path) -> dict[str, str]:
    """safetensors metadata (strings only): the format, the run's config as JSON, the step, the dtype
    the model trained in and the one stored."""
    import torch
    return {"format": FORMAT, "config": json.dumps(config), "step": str(step), "trained_dtype": config["dtype"],
            "stored_dtype": DTYPES[dtype], "source": str(source), "torch_version": torch.__version__}


def write_safetensors(checkpoint: Path, out: Path, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Write the checkpoint's weights to `out` (atomically: a temporary name, then renamed, with the
    umask's permissions as every output); returns the tensors written."""
    import os
    from safetensors.torch import save_file
    state, config, step = checkpoint_weights(checkpoint)
    tensors = export_tensors(state, dtype)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata(config, step, dtype, checkpoint))
        move_into_place(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return tensors


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a file this script wrote; CheckpointError naming the file otherwise."""
    import train_gpt_medium as tg
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, ValueError, OSError) as e:  # OSError: unreadable; the others: not a safetensors file
        raise tg.CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})")
    if meta.get("format") != FORMAT or "config" not in meta or "step" not in meta:
        raise tg.CheckpointError(f"{path}: a safetensors file without this trainer's metadata (format "
                                 f"{meta.get('format')!r}, expected {FORMAT!r}); make it with tools/export.py")
    return tensors, meta


def load_safetensors(path: Path, device="cpu", dtype: str | None = None) -> tuple[tg.GPT, tg.Hyperparameters, int]:
    """The way back: the model the file's config builds (in eval mode, on `device`, in `dtype`; None:
    the dtype it trained in), its weights loaded from the file, the config and the step (the same
    triple as tools/inspect_checkpoint.load_model). CheckpointError naming the file for a file whose
    tensors do not fit the model."""
    import train_gpt_medium as tg
    from tools.inspect_checkpoint import model_of
    tensors, meta = read_safetensors(path)
    try:
        model, config = model_of(json.loads(meta["config"]), device, dtype)
        model.load_state_dict(tensors)  # copies each tensor into the parameter, cast to its dtype
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, tg.ConfigError) as e:
        raise tg.CheckpointError(f"{path}: holds no model this version of the trainer builds ({first_line(e)})")
    return model.eval(), config, int(meta["step"])


def differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit for bit the same (dtype, shape and every bit), or missing."""
    import torch
    bad = sorted(set(expected) ^ set(got))
    for name in sorted(set(expected) & set(got)):
        a, b = expected[name], got[name]
        same = a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True)
        if not same:
            bad.append(name)
    return bad


def main(argv=None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (step_NNNNNN, holding meta.json)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: keep it, "
                        "and stop)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="stored dtype of the floating tensors (default: %(default)s; bf16 rounds fp32 weights)")
    args = parser.parse_args(argv)
    if args.out.suffix != ".safetensors":
        parser.error(f"--out {args.out}: give a file name ending in .safetensors")
    if problem := output_file_problem(args.out, "--out", args.overwrite):
        return fail(problem)
    import train_gpt_medium as tg
    if problem := tg.checkpoint_folder_problem(args.checkpoint):  # before --out's folder is made
        return fail(problem)
    from safetensors import SafetensorError
    try:
        make_parent(args.out)
        written = write_safetensors(args.checkpoint, args.out, args.dtype)
        model, config, step = load_safetensors(args.out)  # the way back, in the dtype the run trained in
    except tg.CheckpointError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"{os_error_line(e, args.out)}; choose another --out")
    except SafetensorError as e:  # its writer's own error (a full disk): nothing was written under --out
        return fail(f"--out {args.out}: cannot be written ({first_line(e)}); choose another --out")
    loaded = model.state_dict()  # each tensor in its parameter's dtype, as the run stored it
    expected = {k: v.to(loaded[k].dtype) if k in loaded else v for k, v in written.items()}
    bad = differences(expected, loaded)
    if bad:
        return fail(f"{args.out}: read back, {len(bad)} tensors differ from the checkpoint's ({', '.join(bad[:4])}); "
                    "the file is not a faithful export")
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {len(written)} tensors, {sum(t.numel() for t in written.values()):,} values "
          f"({args.dtype}), {size / 2**20:.1f} MiB, step {step}; read back through load_safetensors: the same "
          f"{len(written)} tensors bit for bit")
    return 0


if __name__ == "__main__":
    run_main(main)
