"""The README's table of flags, made from the Hyperparameters dataclass (the same metadata as --help),
and its table of recipes, made from RECIPES.

    python tools/switch_table.py            # print the tables
    python tools/switch_table.py --write    # replace the tables in README.md (between their markers)

tests/test_config.py and tests/test_recipes.py require README.md to hold exactly these tables, so a
new or changed field or recipe shows up in the README by running --write. The trainer (and with it
torch) is imported after the arguments are checked.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.cli import OneLineParser, run_main  # noqa: E402

START, END = "<!-- switches:start -->", "<!-- switches:end -->"
RECIPES_START, RECIPES_END = "<!-- recipes:start -->", "<!-- recipes:end -->"


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


def recipes_table() -> str:
    """One row per --recipe: its record, what it changes, steps, Muon lr, the published result."""
    import train_gpt_medium as tg
    rows = ["| `--recipe` | record | what it changes | steps | Muon lr | published mean time, runs, p |",
            "|---|---|---|---|---|---|"]
    for name, r in tg.RECIPES.items():
        config = tg.make_config(recipe=name)
        rows.append(f"| `{name}` | {r.date} `{r.folder}` | {r.change.replace('|', '/')} | {config.num_iterations} | "
                    f"{config.muon_lr} | {tg.recipe_facts(name)} |")
    for name, c in tg.CANDIDATES.items():
        config = tg.make_config(recipe=name)
        rows.append(f"| `{name}` | candidate ([{c.docs}]({c.docs})) | {c.change.replace('|', '/')} | "
                    f"{config.num_iterations} | {config.muon_lr} | {tg.CANDIDATE_NOTE} |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    for (first, last), text in (((START, END), table()), ((RECIPES_START, RECIPES_END), recipes_table())):
        start, end = readme.index(first) + len(first), readme.index(last)
        readme = readme[:start] + "\n" + text + "\n" + readme[end:]
    return readme


def main(argv=None) -> int:
    parser = OneLineParser(__file__, description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args(argv)
    if not args.write:
        print(table() + "\n\n" + recipes_table())
        return 0
    path = ROOT / "README.md"
    text = path.read_text()
    for first, last in ((START, END), (RECIPES_START, RECIPES_END)):
        if first not in text or last not in text:
            print(f"error: {path} has no {first} ... {last} markers to put the table between", file=sys.stderr)
            return 2
    path.write_text(readme_with_table(text))
    return 0


if __name__ == "__main__":
    run_main(main)
