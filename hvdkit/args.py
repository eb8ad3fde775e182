"""What every command's arguments share: the parser, the argument types, the table of subcommands.

Below every command, so a subcommand's module imports this, never the `hvdkit` entry point
(hvdkit.cli) that imports it: the table names each subcommand's module as a string, and
cli.py builds both its parser and its dispatch from it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable

from hvdkit import job


class OneLineParser(argparse.ArgumentParser):
    """Bad flags get one line and exit code 2, like any other bad input: `PROG: error: MESSAGE`,
    or `PROG: MESSAGE` with ``bare`` (the commands whose own checks print so)."""

    def __init__(self, *args, bare: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bare = bare

    def error(self, message: str):
        self.exit(job.BAD_INPUT, f"{self.prog}: {'' if self.bare else 'error: '}{message}\n")


@dataclass(frozen=True)
class Subcommand:
    """A subcommand with its own parser: ``module``'s ``main(argv)`` reads everything after its name."""
    name: str
    module: str
    help: str


# The subcommands that parse their own arguments, in the order `hvdkit --help` lists them after
# doctor; cli.py parses doctor, checkpoint and train itself.
SUBCOMMANDS = (
    Subcommand("build", "hvdkit.build.builder",
               "build Horovod against the installed torch (same as python -m hvdkit.build)"),
    Subcommand("launch", "hvdkit.launch.cli", "start a command on N ranks with horovodrun, mpirun or srun"),
    Subcommand("slurm", "hvdkit.slurm", "render or submit an sbatch script from the templates in slurm/"),
    Subcommand("rehearse", "hvdkit.rehearse.cli",
               "run a multi-node job (launch line or sbatch) on hosts made on this machine, then remove them"),
    Subcommand("image", "hvdkit.container.cli",
               "build hvdkit's container image (podman or docker), or the local Debian base it starts from"),
    Subcommand("mpijob", "hvdkit.container.mpijob",
               "print a Kubeflow MPIJob manifest for hvdkit's image, or run it here (--run)"),
    Subcommand("plot", "hvdkit.plot", "PNGs of one run or several from their metrics.jsonl: metrics, "
                                      "throughput, each rank's compute and wait"),
    Subcommand("bench", "hvdkit.bench.cli", "benchmarks: synthetic (--compare ddp), allreduce bandwidth, scaling"),
)


def _bad(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def positive(text: str) -> int:
    """A whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise _bad(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def non_negative(text: str) -> float:
    """A number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise _bad(f"expected a number >= 0, got {text!r}")
    return value


def number_list(kind: Callable[[str], float], example: str, what: str) -> Callable[[str], list]:
    """A comma-separated list of ``kind`` numbers, each above 0 (``what`` says so in the error)."""
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            raise _bad(f"expected a list like {example}, got {text!r}") from None
        if not values or min(values) <= 0:
            raise _bad(f"{what}, got {text!r}")
        return values
    return parse


def duration(text: str) -> float:
    """'30s', '2m', '1.5h' or plain seconds ('20')."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if not match:
        raise _bad(f"{text!r}: expected a duration like 30s, 2m or 20")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """The text as given, once ``check`` (raising ValueError with its message) accepts it."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return text
    return parse


LINK_RATE = "HVDKIT_LINK_RATE"  # the hosts' link rate in tc's words, for what the command measures


def bits_per_second(rate: str) -> float:
    """tc's rate words: '1gbit' -> 1e9, '30mbit' -> 3e7, '500kbit' -> 5e5."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", rate)
    if not match:
        raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit or kbit, like 1gbit")
    return float(match[1]) * {"k": 1e3, "m": 1e6, "g": 1e9}[match[2]]
