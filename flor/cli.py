"""The parser of flor's command line (flor/__main__.py runs the commands).

Each command is an argparse subcommand with its own --help.  `record` and
`replay` take SCRIPT and the script's ARGS; flor's options go before SCRIPT
or at the very end of ARGS, and ``SCRIPT -- ARGS`` gives all of ARGS to the
script.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from .errors import FlorError, note

__all__ = ["build_parser", "parse", "options_of", "SUMMARY", "EXIT_STATUS"]

SUMMARY = """\
    flor record [options] SCRIPT [ARGS...]    run SCRIPT, recording it
    flor replay [options] SCRIPT [ARGS...]    replay its record with the edited SCRIPT
    flor merge [REPLAY]                       assemble a replay run in --part pieces
    flor runs | show RUN | rm RUN... | prune  the runs of the store
    flor tag RUN [TAG...] [--name N] [--note T]  name, tag or annotate a run
    flor plot NAME | export --tensorboard DIR | export --mlflow URI
                                              the stored values"""
EXIT_STATUS = ("`flor COMMAND --help` describes each. The exit status is 0 on success; the "
               "script's own status when it fails (1 for an uncaught exception); 1 when "
               "`replay --check strict` finds values that differ; 2 when flor refuses (an "
               "argument, option, script or store it cannot use).")

ENV_STORE = "  FLOR_DIR             the run store (default: ./.flor)\n"
ENV_RECORD = ENV_STORE + (
    "  FLOR_EPSILON         as --epsilon\n"
    "  FLOR_ADAPTIVE=0      as --no-adaptive\n"
    "  FLOR_ITERATION_CHECKPOINTS\n"
    "                       as --iteration-checkpoints\n"
    "  FLOR_MATERIALIZER    how checkpoints are written: thread (default), fork or inline\n"
    "  FLOR_CUDA_COPY       how a checkpoint's GPU tensors are copied: auto (default),\n"
    "                       staged or ordered\n"
    "  FLOR_MODE=off        a script that uses the API runs without recording\n"
    "  FLOR_PROJECT_ROOT    the project whose modules hands-free mode instruments (default:\n"
    "                       the nearest directory up with .git, pyproject.toml, setup.py or\n"
    "                       setup.cfg; none: the script alone)\n"
    "  FLOR_REPLICATED=every  every torchrun rank writes the replicated DDP state\n")
ENV_REPLAY = ENV_STORE + (
    "  FLOR_REPLAY_CORES    cores the replay workers may use (default: this process's)\n"
    "  FLOR_ALL_JOBS=1      start every worker --jobs allows, even where fewer would do\n"
    "  FLOR_TRUST_STORE=1   replay a record whose seal is missing or does not verify (made\n"
    "                       before flor sealed runs, or copied from another user)\n"
    "  FLOR_FORKSERVER=0    start each worker afresh, not forked from a process that\n"
    "                       imported the script's installed modules once\n"
    "  OMP_NUM_THREADS      as --threads\n"
    "  SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN, JOB_COMPLETION_INDEX  --parts N's index\n"
    "  CUDA_VISIBLE_DEVICES GPUs handed to the workers in turn (one worker sees them all)\n")
TRAILING = ("flor's options go before SCRIPT, or, when none do, at the very end of ARGS "
            "(`flor replay train.py --epochs 4 --jobs 2`); `SCRIPT -- ARGS` hands all of "
            "ARGS to the script.")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as flor does: `flor: ...`,
    the usage, exit status 2."""

    def error(self, message):
        self.print_usage(sys.stderr)
        note(message)
        raise SystemExit(2)


def _formatter(prog):
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30)


def _command(subs, name, help, description, env=None, epilog=""):
    text = textwrap.fill(epilog, 79) + (f"\n\nenvironment:\n{env}" if env else "")
    return subs.add_parser(name, help=help, description=textwrap.fill(description, 79),
                           epilog=text.strip(), formatter_class=_formatter, allow_abbrev=False)


def _script_args(p):
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER,
                   help="the script's arguments")


def _number(kind, least, strict=False):
    """An argparse type: a `kind` number of at least `least` (more than it, if
    `strict`)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not (value > least if strict else value >= least):
            bound = "more than" if strict else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {least}, not {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    top = _Parser(prog="flor", description="Record-replay for PyTorch training: cheap "
                  "background checkpoints, hindsight logging.\n\n" + SUMMARY,
                  epilog=textwrap.fill(EXIT_STATUS, 79), formatter_class=_formatter,
                  allow_abbrev=False)
    top.add_argument("--version", action="version", version=f"flor {__version__}")
    subs = top.add_subparsers(dest="command", metavar="COMMAND", required=True,
                              parser_class=_Parser)

    p = _command(subs, "record", "run a script, recording it",
                 "Run SCRIPT with ARGS as `python SCRIPT ARGS` would, taking background "
                 "checkpoints of what its loops change. A script that does not import flor "
                 "is instrumented hands-free.", ENV_RECORD, TRAILING)
    p.add_argument("--epsilon", type=_number(float, 0, strict=True), metavar="E",
                   help="record overhead bound of the adaptive rule (default 1/15)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="checkpoint every block execution (no calibration, no rule)")
    p.add_argument("--iteration-checkpoints", type=_number(int, 1), metavar="N",
                   help="iteration checkpoints kept of each loop, spread over it "
                   "(default 64)")
    p.add_argument("--resume", action="store_true",
                   help="continue the latest interrupted record of SCRIPT")
    p.add_argument("--force", action="store_true",
                   help="with --resume: even if SCRIPT or ARGS changed, or continue the "
                   "latest record if it failed (once SCRIPT is fixed)")
    _labels(p)
    _script_args(p)

    p = _command(subs, "replay", "replay a record with the edited script",
                 "Replay the latest finished (or interrupted) record of SCRIPT with the "
                 "edited SCRIPT: blocks that hold no new statement are skipped by loading "
                 "their checkpoints, and the main loop is split among workers. With no ARGS, "
                 "the recorded arguments are used.", ENV_REPLAY, TRAILING)
    p.add_argument("--jobs", type=_number(int, 1), default=1, metavar="N",
                   help="parallel workers, at most (default 1): fewer where the record's "
                   "times say more would not finish sooner")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="where the workers run (default local)")
    p.add_argument("--threads", type=_number(int, 1), metavar="T",
                   help="torch threads per worker (default: the record's)")
    p.add_argument("--run", metavar="ID", help="replay this record: its id, a unique start "
                   "of it, its name, or `latest` (default: the latest finished or interrupted "
                   "one of SCRIPT)")
    p.add_argument("--runs", metavar="WHICH", help="replay many records of SCRIPT, one after "
                   "another, each with its own arguments and its own version of SCRIPT with "
                   "the added statements carried onto it: `all`, run ids or names (separated "
                   "by commas), or a filter such as 'lr < 0.01' (docs/results.md)")
    parts = p.add_mutually_exclusive_group()
    parts.add_argument("--part", metavar="I/N", help="run only segment I of N, counting "
                       "from 0 (0/4 ... 3/4), for a scheduler; then `flor merge`")
    parts.add_argument("--parts", type=_number(int, 1), metavar="N", help="as --part, with I "
                       "from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX")
    p.add_argument("--check", choices=("warn", "strict"), default="warn",
                   help="strict: exit 1 when the deferred checks find differences")
    p.add_argument("--tolerance", type=_number(float, 0), metavar="REL",
                   help="relative tolerance of the deferred checks")
    p.add_argument("--strict", action="store_true",
                   help="refuse a script changed other than by hindsight statements")
    p.add_argument("--args-differ-ok", action="store_true",
                   help="replay with ARGS that differ from the recorded ones")
    _script_args(p)

    p = _command(subs, "merge", "assemble a replay run in --part pieces",
                 "Import the parts of a replay that ran with --part I/N (all of them must "
                 "have finished), print its output and run the deferred checks.", ENV_STORE)
    p.add_argument("replay", metavar="REPLAY", nargs="?",
                   help="the replay (default: the latest with parts not yet merged)")
    p.add_argument("--check", choices=("warn", "strict"), default="warn",
                   help="strict: exit 1 when the deferred checks find differences")

    p = _command(subs, "runs", "list the runs of the store",
                 "List the records and replays of the store, oldest first.", ENV_STORE,
                 "status: finished, failed, interrupted (a record whose process is gone), "
                 "running, or empty (it ended before any loop of flor's: replay never "
                 "picks it).")
    p.add_argument("--script", metavar="SCRIPT", help="only the runs of this script")
    p.add_argument("--status", choices=("finished", "failed", "interrupted", "running",
                                        "empty"), help="only runs of this status")
    p.add_argument("--kind", choices=("record", "replay"), help="only records or replays")
    p.add_argument("--where", metavar="EXPR",
                   help="only runs for which EXPR holds, of their parameters and what they "
                   "logged or printed: `lr <= 0.01 and max(val_acc) > 0.9` (docs/results.md, "
                   "Queries)")
    p.add_argument("--sort", metavar="KEY", help="in the order of KEY, a parameter or what a "
                   "run logged, or last/first/min/max/mean/count(NAME); a leading - for "
                   "descending: `-max(val_acc)`")
    p.add_argument("--json", action="store_true", help="one JSON list, for programs")

    p = _command(subs, "show", "describe one run", "Everything flor keeps of one run: "
                 "its command, status, checkpoints, replays, logged names and the git version of "
                 "its script.", ENV_STORE)
    p.add_argument("run", metavar="RUN", help="a run id, a unique start of one, a run's name, "
                   "or `latest`")
    p.add_argument("--json", action="store_true", help="as JSON")

    p = _command(subs, "rm", "delete runs", "Delete runs, their rows and their files, "
                 "with the replays of a deleted record.", ENV_STORE)
    p.add_argument("runs", metavar="RUN", nargs="+",
                   help="run ids, unique starts of them, run names, or `latest`")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = _command(subs, "tag", "name, tag or annotate a run",
                 "Give RUN (a record or a replay) tags, a name (unique in the store, "
                 "accepted wherever a run id is) or a note; `flor runs` and `flor show` "
                 "show them.", ENV_STORE)
    p.add_argument("run", metavar="RUN", help="a run id, a unique start of one, a run's name, "
                   "or `latest`")
    p.add_argument("tags", metavar="TAG", nargs="*", help="tags to add")
    p.add_argument("--remove", metavar="TAG", action="append", default=[],
                   help="a tag to remove (repeatable)")
    p.add_argument("--name", metavar="NAME", help="the run's name (a letter, then letters, "
                   "digits, '.', '_' or '-')")
    p.add_argument("--note", metavar="TEXT", help="a note on the run (\"\" removes it)")

    p = _command(subs, "prune", "delete all but the latest records of each script",
                 "Per script, keep the newest K records that replay can use and delete the "
                 "others (older, failed or empty records) with their replays.", ENV_STORE)
    p.add_argument("--keep", type=_number(int, 0), default=3, metavar="K",
                   help="records kept per script (default 3)")
    p.add_argument("--script", metavar="SCRIPT", help="only this script's records")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = _command(subs, "plot", "plot a stored value over iterations (PNG)",
                 "Write a PNG of NAME over the iterations of its loop, one line per run "
                 "(needs matplotlib: pip install matplotlib).", ENV_STORE)
    p.add_argument("name", metavar="NAME", help="a logged name (`flor show RUN` lists them)")
    p.add_argument("--run", metavar="RUN", action="append", dest="runs",
                   help="a run to plot (repeatable; default: every run of the script)")
    p.add_argument("--script", metavar="SCRIPT", help="whose runs (default: the latest run's)")
    p.add_argument("--out", metavar="FILE", help="the PNG (default: NAME.png)")

    p = _command(subs, "export", "write stored values for other tools",
                 "Write the runs' numeric values as TensorBoard event files, one directory "
                 "per record (needs tensorboard: pip install tensorboard), or to an MLflow "
                 "tracking store, one MLflow run per record with its configuration as "
                 "parameters (needs mlflow: pip install mlflow). A replay's hindsight values "
                 "go with its record's.", ENV_STORE)
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--tensorboard", metavar="DIR", help="the directory to write")
    to.add_argument("--mlflow", metavar="URI", help="the tracking store: sqlite:///mlflow.db, "
                    "http://host:5000, ...")
    p.add_argument("--run", metavar="RUN", action="append", dest="runs",
                   help="a run to export (repeatable; default: every run of the script)")
    p.add_argument("--script", metavar="SCRIPT", help="whose runs (default: the latest run's)")
    return top


def _labels(p):
    """A record's name, tags and note (flor tag changes them later)."""
    p.add_argument("--name", metavar="NAME", help="name the run (unique in the store; a "
                   "letter, then letters, digits, '.', '_' or '-'), to use wherever a run id is")
    p.add_argument("--tag", metavar="TAG", action="append", default=[], dest="tags",
                   help="tag the run (repeatable)")
    p.add_argument("--note", metavar="TEXT", help="a note on the run")


# -- SCRIPT and ARGS ---------------------------------------------------------

def options_of(parser) -> dict:
    """{option string: takes a value} of a command's parser."""
    return {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}


def _trailing(parser, args) -> tuple[list, list]:
    """(flor options found at the very end of ARGS, the script's ARGS)."""
    opts = options_of(parser)
    found = []
    if "--" in args:  # what follows a -- is the script's
        return found, args
    while args:
        last = args[-1]
        name, eq, _ = last.partition("=")
        if last in opts and not opts[last] and last not in ("-h", "--help"):
            found[:0] = [args.pop()]
        elif eq and opts.get(name):
            found[:0] = [args.pop()]
        elif len(args) >= 2 and opts.get(args[-2]):
            found[:0] = args[-2:]
            del args[-2:]
        else:
            break
    return found, args


def parse(parser, argv):
    top = parser.parse_args(argv)
    if top.command not in ("record", "replay"):
        return top
    sub = parser._subparsers._group_actions[0].choices[top.command]
    args = list(top.args)
    at = len(argv) - len(args)  # where ARGS begin (argparse drops one "--" before them)
    explicit = argv[at - 1:at] == ["--"] and argv[at - 2:at - 1] == [top.script]
    found = []
    if not explicit and at == 2:  # no option before SCRIPT: flor's may end ARGS
        found, args = _trailing(sub, args)
        if found:
            top = parser.parse_args([top.command, *found, top.script])
    top.args, top.explicit_args, top.peeled = args, explicit or bool(args), found
    if not os.path.isfile(top.script):
        raise FlorError(f"no such script: {top.script}")
    return top
