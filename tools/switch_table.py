"""The README's table of flags, made from the Hyperparameters dataclass (the same metadata as --help).

    python tools/switch_table.py            # print the table
    python tools/switch_table.py --write    # replace the table in README.md (between its markers)

tests/test_config.py requires README.md to hold exactly this table, so a new or changed field
shows up in the README by running --write. The trainer (and with it torch) is imported after the
arguments are checked.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import OneLineParser  # noqa: E402

START, END = "<!-- switches:start -->", "<!-- switches:end -->"


def table() -> str:
    """Markdown rows grouped as in --help: flag, the record's default, meaning and allowed values."""
    import train_gpt_medium as tg
    rows, group = ["| flag | default (record) | meaning |", "|---|---|---|"], None
    for f in tg.fields(tg.Hyperparameters):
        if f.metadata["group"] != group:
            group = f.metadata["group"]
            rows.append(f"| **{group}** | | |")
        allowed = tg.range_text(f)
        meaning = f.metadata["meaning"] + (f" ({allowed})" if allowed else "")
        rows.append(f"| `--{f.name}` | `{tg.to_text(f.default)}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    start, end = readme.index(START) + len(START), readme.index(END)
    return readme[:start] + "\n" + table() + "\n" + readme[end:]


def main(argv=None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args(argv)
    if not args.write:
        print(table())
        return 0
    path = ROOT / "README.md"
    text = path.read_text()
    if START not in text or END not in text:
        print(f"error: {path} has no {START} ... {END} markers to put the table between", file=sys.stderr)
        return 2
    path.write_text(readme_with_table(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
