"""`hvdkit bench synthetic|scaling|allreduce|tp-ops|pp-transport|pp|zero|checkpoint|goodput|estimate`:
the command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from hvdkit import env, job
from hvdkit.args import LINK_RATE, OneLineParser, bits_per_second, checked, non_negative, number_list, positive
from hvdkit.bench import goodput
from hvdkit.bench.allreduce_worker import allreduce_worker
from hvdkit.bench.drivers import (
    CHECKPOINT_IMPLS,
    RunFailed,
    allreduce,
    checkpoint_compare,
    compare_synthetic,
    print_estimate,
    scaling,
)
from hvdkit.bench.figures import TP_IMPLS, ZERO_IMPLS, BenchError, parse_size, size_range
from hvdkit.bench.pipeline import pipeline_bench, pipeline_worker
from hvdkit.bench.pp_transport import pp_transport, pp_transport_worker
from hvdkit.bench.tp_ops import tp_ops, tp_ops_worker
from hvdkit.bench.workers import (
    IMPL_HELP,
    SYNTHETIC_IMPLS,
    checkpoint_worker,
    synthetic_worker,
)
from hvdkit.bench.zero_drivers import zero
from hvdkit.bench.zero_worker import zero_worker
from hvdkit.launch.hostfile import LaunchError, parse_hosts
from hvdkit.system import launchers

_world_sizes = number_list(int, "1,2,4", "world sizes must be >= 1")
_link_speeds = number_list(float, "10,25,100", "link speeds must be > 0")


def _np_list(text: str) -> list[int]:
    return sorted(set(_world_sizes(text)))


def _names(allowed: Sequence[str], what: str):
    """An argument type: a comma-separated list of names out of ``allowed``, each unknown one said."""
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown)) or repr(text)}; "
                                             f"choose from {', '.join(allowed)}")
        return names
    return parse


_compare_list = _names(SYNTHETIC_IMPLS, "implementation")


def _checkpoint_arms(text: str) -> list[str]:
    return ["none", *_names(CHECKPOINT_IMPLS[1:], "arm")(text)]


def _knob(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE like HOROVOD_CYCLE_TIME=1, got {text!r}")
    return name, value


def _zero_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", help="gpt (default), or a torchvision model such as resnet50, on "
                                                  "random images")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam", help="the optimizer (default adam)")
    p.add_argument("--image-size", type=int, default=32, help="image side for a torchvision model (default 32)")
    p.add_argument("--num-classes", type=int, default=10, help="classes of a torchvision model (default 10)")
    p.add_argument("--max-model", action="store_true", help="the largest GPT each loop trains under --memory-cap")
    p.add_argument("--memory-cap", type=_byte_size, help="with --max-model: every rank's peak memory (resident; on a "
                                                         "GPU the allocator's) must stay below this (e.g. 3584M)")
    _gpt_arguments(p, seq_len=32, batch="samples per rank per step", repeats=3)
    p.add_argument("--layers", type=int, default=12, help="GPT blocks (default 12: 38M parameters, 300 MB of Adam "
                                                          "state unsharded)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("-np", "--np", dest="np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--impl", choices=ZERO_IMPLS + TP_IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--impls", type=_zero_impls, default=ZERO_IMPLS,
                   help=f"the loops to run, comma-separated (default: {','.join(ZERO_IMPLS)}; also "
                        f"{','.join(TP_IMPLS)}: tensor parallelism over every rank, hvdkit's and torch's)")


def _gpt_arguments(p: argparse.ArgumentParser, seq_len: int, batch: str, repeats: int) -> None:
    """The bench GPT's shape and the rounds, as `zero` and `tp-ops` take them."""
    p.add_argument("--width", type=positive, default=512, help="GPT width (default 512)")
    p.add_argument("--seq-len", type=positive, default=seq_len, help=f"tokens per sample (default {seq_len})")
    p.add_argument("--batch-size", type=positive, default=4, help=f"{batch} (default 4)")
    p.add_argument("--repeats", type=positive, default=repeats, help=f"alternating rounds (default {repeats})")


def _zero_impls(text: str) -> tuple:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in ZERO_IMPLS + TP_IMPLS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ZERO_IMPLS + TP_IMPLS)}, got {text!r}")
    return chosen


def _count(text: str) -> int:
    """A count like 175M, 1.5B or 2000000."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip(), re.I)
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a count like 175M, 1.5B or 2000000, got {text!r}")
    return int(float(match[1]) * {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}[match[2].upper()])


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--np", "--num-proc", dest="np", type=positive, default=2, help="ranks (default 2)")
    p.add_argument("--params", type=_count, default=175 * 10**6,
                   help="parameters of the model, linear layers of --width (default 175M: a 2.1 GB checkpoint "
                        "with Adam's state)")
    p.add_argument("--width", type=positive, default=4096, help="features of each linear layer (default 4096)")
    p.add_argument("--batch-size", type=positive, default=4, help="samples per rank per step (default 4)")
    p.add_argument("--steps", type=positive, default=12, help="timed steps per run (default 12)")
    p.add_argument("--warmup", type=non_negative, default=2, help="steps before the timing (default 2)")
    p.add_argument("--checkpoint-every", type=positive, default=4,
                   help="a checkpoint every this many steps (default 4)")
    p.add_argument("--repeats", type=positive, default=1, help="rounds over the arms (default 1)")
    p.add_argument("--arms", type=_checkpoint_arms, default=list(CHECKPOINT_IMPLS), metavar="ARM[,ARM]",
                   help=f"which saves to run beside none: {', '.join(CHECKPOINT_IMPLS[1:])} (default all); "
                        "snapshot: every --checkpoint-every steps into host memory (hvdkit launch --max-restarts)")
    p.add_argument("--model", default="linear",
                   help="linear (default: a stack of --params parameters), or a built-in model such as cnn on "
                        "random 32x32 images")
    p.add_argument("--dir", help="where each run writes its checkpoints, in a folder removed after it (default: the "
                                 "temporary folder)")
    p.add_argument("--impl", choices=CHECKPOINT_IMPLS, help=argparse.SUPPRESS)


def _byte_size(text: str) -> int:
    try:
        return parse_size(text)
    except BenchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rounds_arguments(p: argparse.ArgumentParser, count: str, default: int, what: str) -> None:
    """A self-launched pipeline benchmark's rounds (``--repeats``, and ``count`` of ``what`` timed a
    round), its worker's flag and the launch's arguments."""
    p.add_argument("--repeats", type=positive, default=7, help="alternating rounds (default 7)")
    p.add_argument(count, type=positive, default=default, help=f"{what} timed a round (default {default})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _launch_arguments(p, files=True)


def _launch_arguments(p: argparse.ArgumentParser, files: bool) -> None:
    p.add_argument("--launcher", choices=launchers.CHOICES, default="auto",
                   help="how to start the ranks (as hvdkit launch; default: auto)")
    ctl = p.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                     help="Horovod's Gloo controller (horovodrun --gloo)")
    ctl.add_argument("--mpi", dest="controller", action="store_const", const="mpi", help="Horovod's MPI controller")
    p.add_argument("-H", "--hosts", help="host1:N,host2:N (default: this machine or the Slurm allocation)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take (default 1800)")
    if files:
        p.add_argument("--out", help="folder for the CSV/JSON/PNG (default runs/bench/<kind>-<time>)")


def _synthetic_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet50", help="torchvision model or hvdkit model (default resnet50)")
    p.add_argument("--batch-size", type=positive, default=32, help="images per rank per step (default 32)")
    p.add_argument("--image-size", type=positive, default=224, help="side of the square images (default 224)")
    p.add_argument("--num-classes", type=positive, default=1000, help="default 1000, as ImageNet")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="default 10")
    p.add_argument("--num-batches-per-iter", type=positive, default=10, help="default 10")
    p.add_argument("--num-iters", type=positive, default=10, help="default 10")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the allreduce")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 on CPUs, fp16 + GradScaler on GPUs")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile a few: the top CPU and GPU ops, host syncs and Horovod "
                        "waits per step, per implementation, written to --out")
    p.add_argument("--counters", action="store_true",
                   help="after the timed steps, time each duty of a step where it is called: host µs per step of "
                        "each, per implementation (hvdkit, own-loop, horovod), written to --out")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="every arm's optimizer (default sgd, as Horovod's benchmark)")
    p.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hvdkit bench", description="Benchmarks that print figures, ratios and their environment.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK", parser_class=OneLineParser)

    syn = sub.add_parser("synthetic", help="Horovod's synthetic benchmark; --compare runs the peers in the same run")
    _synthetic_arguments(syn)
    syn.add_argument("-np", "--np", "--num-proc", dest="np", type=positive,
                     help="ranks to launch (default: one per GPU, else per core); under a launcher, its ranks")
    syn.add_argument("--compare", type=_compare_list, default=[], metavar="IMPL[,IMPL]",
                     help=f"also run these, launched the same way: {IMPL_HELP}")
    syn.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                     help="also run hvdkit with this setting (HOROVOD_*, OMPI_MCA_*, NCCL_*, ...), one run "
                          "per --knob; repeatable")
    syn.add_argument("--repeats", type=positive, default=1, help="rounds over the implementations (default 1)")
    syn.add_argument("--link-rate", type=checked(bits_per_second), default=os.environ.get(LINK_RATE), metavar="RATE",
                     help="the hosts' link, like 1gbit or 10gbit, for the network floor printed beside the figures "
                          f"(default: ${LINK_RATE}, which `hvdkit rehearse --bandwidth` sets)")
    syn.add_argument("--impl", choices=SYNTHETIC_IMPLS, help=argparse.SUPPRESS)
    _launch_arguments(syn, files=True)

    scale = sub.add_parser("scaling", help="throughput and efficiency per world size, same per-rank batch")
    _synthetic_arguments(scale)
    scale.add_argument("-np", "--np", dest="np_list", type=_np_list, default=[1, 2], metavar="N[,N]",
                       help="world sizes (default 1,2)")
    scale.add_argument("--impl", choices=SYNTHETIC_IMPLS, default="hvdkit", help="which loop (default hvdkit)")
    _launch_arguments(scale, files=True)

    ar = sub.add_parser("allreduce", help="allreduce bandwidth per size: Horovod beside raw MPI and torch.distributed")
    ar.add_argument("--sizes", default="4K..256M", help="4K..256M (powers of two) or 4K,1M,64M (default 4K..256M)")
    ar.add_argument("--iters", type=positive, help="timed allreduces per size (default: 1000 for small sizes "
                                                    "down to 10 for large)")
    ar.add_argument("-np", "--np", "--num-proc", dest="np", type=positive,
                    help="ranks (default: one per GPU, else per core)")
    ar.add_argument("--no-tuning", action="store_true",
                    help="leave Horovod's and MPI's defaults, without the Trainer's settings")
    ar.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _launch_arguments(ar, files=True)

    tp = sub.add_parser("tp-ops", help="tensor parallelism's operators on Horovod beside torch's functional "
                                       "collectives on the same tensors: latency per call, alternating rounds")
    _gpt_arguments(tp, seq_len=128, batch="sequences", repeats=7)
    tp.add_argument("--iters", type=positive, default=50, help="calls timed a round (default 50)")
    tp.add_argument("-np", "--np", "--num-proc", dest="np", type=positive,
                    help="ranks, all one tensor-parallel group (default: one per GPU, else per core)")
    tp.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _launch_arguments(tp, files=True)

    pipe = sub.add_parser("pp-transport", help="a pipeline's activations between two stages: hvdkit's transport, "
                                               "Horovod's alltoall, mpi4py's point-to-point (under MPI) and "
                                               "torch's isend/irecv over Gloo, latency and "
                                               "bandwidth per transfer, alternating rounds")
    pipe.add_argument("--width", type=positive, default=512, help="GPT width (default 512)")
    pipe.add_argument("--seq-lens", type=number_list(int, "1,128,1024", "expected whole numbers >= 1"),
                      default=[1, 128, 1024], metavar="T[,T]",
                      help="tokens per sequence, one row each (default 1,128,1024)")
    pipe.add_argument("--batch-size", type=positive, default=4, help="sequences per micro-batch (default 4)")
    _rounds_arguments(pipe, "--iters", 20, "round trips")

    pp = sub.add_parser("pp", help="a pipeline's step at pp 2, hvdkit's beside torch.distributed.pipelining's "
                                   "same schedule: step time, bubble, bytes per stage")
    pp.add_argument("--width", type=positive, default=512, help="GPT width (default 512)")
    pp.add_argument("--layers", type=positive, default=4, help="GPT blocks, half on each stage (default 4)")
    pp.add_argument("--seq-len", type=positive, default=64, help="tokens per sequence (default 64)")
    pp.add_argument("--batch-size", type=positive, default=8, help="sequences a step (default 8)")
    pp.add_argument("--micro-batches", type=number_list(int, "4,8", "expected whole numbers >= 1"), default=[4, 8],
                    metavar="M[,M]", help="micro-batches a step, one row each (default 4,8)")
    pp.add_argument("--schedules", type=_names(("gpipe", "1f1b"), "schedule"), default=["gpipe", "1f1b"],
                    metavar="S[,S]", help="gpipe, 1f1b (default both)")
    _rounds_arguments(pp, "--steps", 3, "steps")

    shard = sub.add_parser("zero", help="the sharded optimizer (stage 1, 2) beside Horovod's DistributedOptimizer "
                                        "and torch's ZeroRedundancyOptimizer: throughput and bytes per rank")
    _zero_arguments(shard)
    _launch_arguments(shard, files=True)

    ckpt = sub.add_parser("checkpoint", help="what checkpoints cost training: written in the training thread "
                                             "against in the background, beside a run without them")
    _checkpoint_arguments(ckpt)
    _launch_arguments(ckpt, files=True)

    good = sub.add_parser("goodput", help="one storm of faults at random moments on namespace hosts (hvdkit "
                                          "rehearse --chaos) against in-job restarts with snapshots and against "
                                          "restarts from disk: seconds to the next step, steps redone, ETTR")
    good.add_argument("-np", "--np", dest="np", type=positive, default=3, help="ranks, one per host (default 3)")
    good.add_argument("--faults", default="kill", help="the faults to draw from, as rehearse --faults (default kill)")
    good.add_argument("--count", dest="faults_count", type=positive, default=10,
                      help="faults in the storm (default 10)")
    good.add_argument("--seed", type=int, default=2026, help="the storm's seed (default 2026)")
    good.add_argument("--arms", type=_names(goodput.ARMS, "arm"), default=list(goodput.ARMS), metavar="ARM[,ARM]",
                      help=f"{', '.join(goodput.ARMS)} (default all)")
    good.add_argument("--model", default="mlp", help="a built-in model (default mlp)")
    good.add_argument("--image-size", type=positive, default=32, help="side of the synthetic images (default 32)")
    good.add_argument("--steps", type=positive, default=300, help="steps of the job (default 300)")
    good.add_argument("--checkpoint-steps", type=positive, default=20, help="disk checkpoints every (default 20)")
    good.add_argument("--snapshot-steps", type=positive, default=1, help="snapshots every, restarts arm (default 1)")
    good.add_argument("--timeout", type=float, default=3600, help="seconds one arm's rehearsal may take")
    good.add_argument("--out", help="folder for each arm's report and goodput.json (default "
                                    "runs/bench/goodput-<time>)")

    est = sub.add_parser("estimate", help="step time and efficiency at many ranks, from the ring-allreduce cost "
                                          "model and what `synthetic` measured (compute per step, gradient bytes)")
    est.add_argument("--compute-ms", type=non_negative, required=True,
                     help="forward+backward+step of one rank, no allreduce (synthetic prints it)")
    est.add_argument("--gradient-bytes", type=positive, required=True, help="bytes allreduced per step (fp32)")
    est.add_argument("--batch-size", type=positive, required=True, help="samples per rank per step")
    est.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as fp16 (half the bytes)")
    est.add_argument("-np", "--np", dest="np_list", type=_np_list, default=[8, 16, 32, 64, 128, 256, 512],
                     metavar="N[,N]", help="world sizes (default 8,16,...,512)")
    est.add_argument("--gbit", type=_link_speeds, default=[10.0, 25.0, 100.0], metavar="G[,G]",
                     help="link speeds in Gbit/s (default 10,25,100)")
    est.add_argument("--latency-us", type=non_negative, default=25.0,
                     help="per-hop latency in microseconds (default 25, TCP over Ethernet)")
    return p


SELF_LAUNCHED = {"allreduce": (allreduce_worker, allreduce), "tp-ops": (tp_ops_worker, tp_ops),
                 "pp-transport": (pp_transport_worker, pp_transport), "pp": (pipeline_worker, pipeline_bench)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    under_launcher = env.detect().rank is not None
    try:
        if getattr(args, "hosts", None):
            parse_hosts(args.hosts)  # a bad host list fails here, before anything starts
        if args.bench in SELF_LAUNCHED:  # (the worker in each rank, the driver that launches them)
            if args.bench == "allreduce":
                size_range(args.sizes)  # bad sizes fail here, before anything starts
            worker, driver = SELF_LAUNCHED[args.bench]
            if args.worker:
                worker(args)
                return 0
            if under_launcher:
                raise BenchError(f"{args.bench} launches its own ranks: run it without a launcher, with -np N")
            return driver(args)
        if args.bench == "estimate":
            return print_estimate(args)
        if args.bench == "zero":
            if args.impl:
                zero_worker(args)
                return 0
            return zero(args)
        if args.bench == "checkpoint":
            if args.impl:
                checkpoint_worker(args)
                return 0
            return checkpoint_compare(args)
        if args.bench == "goodput":
            if under_launcher:
                raise BenchError("goodput makes its own hosts and launches: run it without a launcher")
            return goodput.run(args)
        if args.bench == "scaling":
            if under_launcher:
                raise BenchError("scaling launches its own ranks: run it without a launcher, with --np 1,2")
            return scaling(args)
        if args.impl or (under_launcher and not args.compare and not args.knob):
            args.impl = args.impl or "hvdkit"
            synthetic_worker(args)
            return 0
        if under_launcher:
            raise BenchError("--compare and --knob launch each run themselves: run it without a launcher, with -np N")
        return compare_synthetic(args)
    except (BenchError, RunFailed, LaunchError) as exc:
        print(f"hvdkit bench: {exc}", file=sys.stderr, flush=True)
        return job.code_for(exc, (BenchError, LaunchError))
