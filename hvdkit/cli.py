"""The `hvdkit` command: one entry point, one subcommand per concern."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdkit", description="Horovod/MPI training toolkit for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="report Python, torch, MPI, Horovod and the launch environment")
    doctor.add_argument("--selftest", action="store_true",
                        help="also run a real 2-process allreduce/broadcast/training check per controller")

    sub.add_parser("build", add_help=False,
                   help="build Horovod against the installed torch (same as python -m hvdkit.build)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] == ["build"]:
        from hvdkit import build
        return build.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from hvdkit import doctor
        return doctor.main(selftest_wanted=args.selftest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
