"""`hvdkit train` whose background checkpoint copies start 0.5 s late (a loaded machine, made
sure): the training goes on meanwhile, so what the next step changes before its optimizer step
is caught changing under the copy."""

import sys
import time

from hvdkit import cli
from hvdkit.checkpoint import writer

copy = writer._copy


def late_copy(copies: list) -> int:
    time.sleep(0.5)
    return copy(copies)


writer._copy = late_copy
sys.exit(cli.main(["train", *sys.argv[1:]]))
