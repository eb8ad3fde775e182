"""Slurm's compact host and task notations, read in Python so no `scontrol` is needed.

Slurm hands a job its nodes as ``gpu[01-03,07],cpu5`` and its tasks per node as
``2(x3),1``; launchers and hostfiles need them spelled out.
"""

from __future__ import annotations

import re
from typing import Mapping


class SlurmFormatError(ValueError):
    pass


def _split_top_level(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmFormatError(f"nodelist {text!r}: ']' without '['")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise SlurmFormatError(f"nodelist {text!r}: '[' without ']'")
    parts.append(current)
    return parts


def _expand_range(text: str, nodelist: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'], keeping zero padding."""
    values = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise SlurmFormatError(f"nodelist {nodelist!r}: bad range {item!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SlurmFormatError(f"nodelist {nodelist!r}: range {item!r} runs backwards")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5; ``a[1-2]-ib[0-1]`` -> 4 names."""
    if not nodelist.strip():
        raise SlurmFormatError("nodelist is empty")
    hosts = []
    for part in _split_top_level(nodelist.strip()):
        if not part:
            raise SlurmFormatError(f"nodelist {nodelist!r}: empty name")
        names = [""]
        for match in re.finditer(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            literal, bracket = match.groups()
            values = _expand_range(bracket, nodelist) if bracket is not None else [""]
            names = [name + literal + value for name in names for value in values]
        hosts += names
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1], as in SLURM_TASKS_PER_NODE."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise SlurmFormatError(f"tasks per node {spec!r}: cannot read {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def allocation(environ: Mapping[str, str]) -> list[tuple[str, int]]:
    """(host, tasks) for each node of the Slurm allocation this process runs in."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmFormatError("not inside a Slurm allocation (SLURM_JOB_NODELIST is not set)")
    hosts = expand_nodelist(nodelist)
    tasks = expand_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", ",".join("1" * len(hosts))))
    if len(tasks) != len(hosts):
        raise SlurmFormatError(f"SLURM_TASKS_PER_NODE gives {len(tasks)} nodes, the nodelist {len(hosts)}")
    return list(zip(hosts, tasks, strict=True))
