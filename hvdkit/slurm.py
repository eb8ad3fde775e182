"""Slurm: its compact host and task notations, and sbatch scripts rendered from slurm/.

Slurm hands a job its nodes as ``gpu[01-03,07],cpu5`` and its tasks per node as
``2(x3),1``; launchers and hostfiles need them spelled out, in Python, without `scontrol`.
`hvdkit slurm render` fills in the same templates users submit by hand, so there is one copy.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from hvdkit.system.launchers import SRUN


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


# ---------------------------------------------------------------------------
# Rendering sbatch scripts from the templates in slurm/.
# ---------------------------------------------------------------------------

def _template_dir() -> Path:
    """Installed: inside the package (setup.cfg maps slurm/ to hvdkit/_slurm); from a checkout
    or an editable install: the repository's slurm/."""
    here = Path(__file__).resolve().parent
    return here / "_slurm" if (here / "_slurm").is_dir() else here.parent / "slurm"


TEMPLATE_DIR = _template_dir()
TEMPLATES = {"srun": "multi-node-srun.sbatch", "mpirun": "multi-node-mpirun.sbatch",
             "horovodrun": "multi-node-horovodrun.sbatch"}
_TIME_RE = re.compile(r"(\d+-)?\d+(:\d{2}){0,2}|\d+-\d+(:\d{2}){0,2}")
_ARRAY_RE = re.compile(r"\d+(-\d+(:\d+)?)?(,\d+(-\d+(:\d+)?)?)*(%\d+)?")


@dataclass
class JobRequest:
    command: list
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = "01:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    launcher: str = "srun"
    array: Optional[str] = None
    requeue: bool = False


def check(request: JobRequest) -> None:
    """Refuse requests Slurm would refuse, or that cannot bind one GPU set per task."""
    for name in ("nodes", "tasks_per_node", "cpus_per_task"):
        if getattr(request, name) < 1:
            raise SlurmFormatError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(request, name)})")
    if request.gpus_per_node < 0 or request.gpus_per_node % request.tasks_per_node:
        raise SlurmFormatError(f"--gpus-per-node {request.gpus_per_node} is not a multiple of --tasks-per-node "
                               f"{request.tasks_per_node}: each task needs the same number of GPUs")
    if not _TIME_RE.fullmatch(request.time):
        raise SlurmFormatError(f"--time {request.time!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])")
    if request.array is not None and not _ARRAY_RE.fullmatch(request.array):
        raise SlurmFormatError(f"--array {request.array!r} is not a Slurm array (e.g. 0-9, 1,3,5 or 0-15%4)")
    for first, last in re.findall(r"(\d+)-(\d+)", request.array or ""):
        if int(first) > int(last):
            raise SlurmFormatError(f"--array {request.array!r}: the range {first}-{last} is empty "
                                   f"(write {last}-{first})")
    for name in ("partition", "account"):
        value = getattr(request, name)
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.,\-]+", value):
            raise SlurmFormatError(f"--{name} {value!r} is not a Slurm {name} name (letters, digits, _ . - and "
                                   f"commas between several)")
    if request.launcher not in TEMPLATES:
        raise SlurmFormatError(f"--launcher must be one of {', '.join(TEMPLATES)} (got {request.launcher!r})")
    if request.requeue and request.launcher != SRUN.name:
        raise SlurmFormatError("--requeue uses the preemptible template, which starts ranks with srun")
    if not request.command:
        raise SlurmFormatError("no command after '--'")
    spaced = [word for word in request.command if not word or re.search(r"\s", word)]
    if spaced:
        raise SlurmFormatError(f"the templates pass the command as words split at spaces; {spaced[0]!r} would "
                               f"break (put it in a config file, or rename the path)")


def render(request: JobRequest) -> str:
    """The template for the request's launcher with its header and default command filled in."""
    check(request)
    name = "preemptible.sbatch" if request.requeue else TEMPLATES[request.launcher]
    text = (TEMPLATE_DIR / name).read_text()
    directives = {"nodes": request.nodes, "ntasks-per-node": request.tasks_per_node,
                  "cpus-per-task": request.cpus_per_task, "time": request.time}
    for key, value in directives.items():
        text, count = re.subn(rf"^#SBATCH --{key}=.*$", f"#SBATCH --{key}={value}", text, flags=re.MULTILINE)
        assert count == 1, f"{name} has no #SBATCH --{key} line"
    extra = [f"--{k}={v}" for k, v in (("partition", request.partition), ("account", request.account),
                                        ("array", request.array)) if v]
    if request.gpus_per_node:
        extra.append(f"--gpus-per-node={request.gpus_per_node}")
    if extra:
        last = list(re.finditer(r"^#SBATCH .*$", text, flags=re.MULTILINE))[-1]
        text = text[:last.end()] + "".join(f"\n#SBATCH {e}" for e in extra) + text[last.end():]
    command, args = list(request.command), []
    if command[:2] == ["hvdkit", "train"]:
        command, args = command[:2], command[2:]
    text = _set_default(text, "HVDKIT_COMMAND", shlex.join(command))
    return _set_default(text, "HVDKIT_ARGS", shlex.join(args))


def _set_default(text: str, name: str, value: str) -> str:
    """Rewrite NAME=${NAME:-...}: the environment still wins, as the template documents."""
    quoted = shlex.quote(value) if value else ""
    text, count = re.subn(rf"^{name}=\$\{{{name}:-.*\}}$", lambda _: f"{name}=${{{name}:-{quoted}}}", text,
                          flags=re.MULTILINE)
    assert count == 1, f"the template has no {name}=${{{name}:-...}} line"
    return text


def main(argv: list) -> int:
    """`hvdkit slurm render|submit [options] -- COMMAND ...`"""
    import subprocess
    import sys

    from hvdkit import job
    from hvdkit.args import OneLineParser

    parser = OneLineParser(bare=True, prog="hvdkit slurm",
                           usage="hvdkit slurm {render,submit} [options] -- COMMAND ...",
                           description="Print (render) or submit an sbatch script made from the templates in slurm/.")
    parser.add_argument("action", choices=("render", "submit"))
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks-per-node", type=int, default=1, help="one per GPU")
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--cpus-per-task", type=int, default=1)
    parser.add_argument("--time", default="01:00:00", help="HH:MM:SS or D-HH:MM:SS")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--launcher", default="srun", help="srun (default), mpirun or horovodrun")
    parser.add_argument("--array", help="a job array, e.g. 0-9")
    parser.add_argument("--requeue", action="store_true", help="the preemptible template: signal, checkpoint, requeue")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    request = JobRequest(command=list(argv[split + 1:]), nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                         gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                         partition=args.partition, account=args.account, launcher=args.launcher,
                         array=args.array, requeue=args.requeue)
    try:
        script = render(request)
    except SlurmFormatError as exc:
        print(f"hvdkit slurm: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    if args.action == "render":
        sys.stdout.write(script)
        return 0
    result = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"hvdkit slurm: sbatch refused the job: {result.stderr.strip()}", file=sys.stderr)
        return job.FAILED
    print(result.stdout.strip().split(";")[0])
    return 0
