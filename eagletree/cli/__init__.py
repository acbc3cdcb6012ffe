"""`eagletree` command line: data, generate, chat, viz, features, distill, export, import, plan, calibrate-copy,
datastore, bench, profile.

One module per command or close family holds its parsers (`add_*`) next to their handlers (`cmd_<name>`, each
parser's `func`): `training` (data, features, distill), `generate` (generate, chat; `prompt_batch`: the answers
file of generate --prompts), `viz`, `export` (export, import), `plan`, `copying` (calibrate-copy, datastore),
`bench` (bench, profile). `common` holds what they share: running a command (errors, warnings) and the argument
groups; `models`, loading what the flags name. A handler parses, calls the library and prints.

Handlers import what they run only when they run, so `eagletree --help` and a mistyped flag answer at once,
without loading torch (or transformers, or matplotlib).
"""

from __future__ import annotations

import argparse
import sys

from . import bench, copying, export, generate, plan, training, viz
from .common import run_command

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    """The `eagletree` parser: a subparser per command, whose `func` is the handler that runs it."""
    parser = argparse.ArgumentParser(prog="eagletree", description="Lossless speculative decoding with draft trees.")
    sub = parser.add_subparsers(dest="command", required=True)
    training.add_data_parser(sub)
    generate.add_generate_parsers(sub)
    viz.add_viz_parser(sub)
    training.add_features_parser(sub)
    training.add_distill_parser(sub)
    export.add_export_parsers(sub)
    plan.add_plan_parser(sub)
    copying.add_copying_parsers(sub)
    bench.add_bench_parsers(sub)
    return parser


def main(argv=None) -> int:
    """Parse `argv` (default: the command line's arguments) and run the command; its exit status."""
    return run_command(build_parser().parse_args(argv))


def run() -> None:
    """The `eagletree` command: `main` in a process whose memory may come in huge pages (`hugepages`: the command
    starts itself again with glibc's tunable set, before anything is loaded)."""
    from ..hugepages import relaunch_with_huge_pages

    relaunch_with_huge_pages()
    sys.exit(main())
