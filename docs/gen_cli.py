"""Write docs/command-line.md from flor's argparse parser (flor/cli.py), so
that the page says what `--help` says.

    python docs/gen_cli.py            # write docs/command-line.md
    python docs/gen_cli.py --check    # exit 1 if docs/command-line.md differs
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PAGE = os.path.join(HERE, "command-line.md")
PROG = "python -m flor"
COLUMNS = "88"  # the help's width, whatever the terminal's

INTRO = """\
# The command line

This page is generated from flor's argument parser (`flor/cli.py`) by
`docs/gen_cli.py`; `make docs` fails when it is out of date. `pip install`
puts a `flor` command on the path; `python -m flor` is the same program.
`python -m flor --help` and `python -m flor COMMAND --help` print this text
(naming the program `flor`). [Record and replay](record-and-replay.md) says
what the commands do; examples of use are in [hands-free mode](hands-free.md),
[resume and elastic replay](resume-and-elastic-replay.md),
[data-parallel training](data-parallel.md) and [results](results.md).
"""


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def generate() -> str:
    """The page's text."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from flor.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        top = build_parser()
        top.prog = PROG
        parts = [INTRO, f"## `{PROG}`\n", "```text\n" + top.format_help().rstrip() + "\n```\n"]
        for name, sub in _subparsers(top).items():
            sub.prog = f"{PROG} {name}"
            parts.append(f"## `{PROG} {name}`\n")
            parts.append("```text\n" + sub.format_help().rstrip() + "\n```\n")
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def main(argv) -> int:
    text = generate()
    if argv[1:] == ["--check"]:
        with open(PAGE) as f:
            if f.read() != text:
                print(f"{os.path.relpath(PAGE)} is out of date with flor/cli.py: "
                      f"run python docs/gen_cli.py", file=sys.stderr)
                return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    with open(PAGE, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
