"""The `hvdkit` command: one entry point, one subcommand per concern."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from hvdkit import __version__, config, env, job
from hvdkit.args import SUBCOMMANDS, OneLineParser


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hvdkit", description="Horovod/MPI training toolkit for PyTorch.")
    parser.add_argument("--version", action="version", version=f"hvdkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    doctor = sub.add_parser("doctor", help="report Python, torch, MPI, Horovod and the launch environment")
    doctor.add_argument("--selftest", action="store_true",
                        help="also run a real 2-process allreduce/broadcast/training check per controller")
    where = doctor.add_mutually_exclusive_group()  # hosts: only the comparison, which takes seconds
    where.add_argument("-H", "--hosts", help="compare these hosts with this one (host1,host2 or host1:4,host2:4: "
                                             "with slots, those are checked against the cores and GPUs), reached "
                                             "by ssh as the launcher reaches them; in a multi-node Slurm "
                                             "allocation the default is its nodes, reached by srun")
    where.add_argument("--hostfile", help="the hosts to compare, from a hostfile (host:N or host slots=N)")
    doctor.add_argument("--dir", help="the directory that must be shared between the hosts (default: "
                                      "$HVDKIT_CHECKPOINT_DIR, $HVDKIT_LOG_DIR or ./runs)")

    for command in SUBCOMMANDS:  # each parses its own arguments: main() hands it the rest
        sub.add_parser(command.name, add_help=False, help=command.help)

    ckpt = sub.add_parser("checkpoint", help="work with checkpoints: export one as plain torch files")
    actions = ckpt.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=OneLineParser)
    export = actions.add_parser("export", help="write a checkpoint's model and optimizer (sharded or not) as the "
                                               "plain state_dicts that torch loads on one process")
    export.add_argument("source", help="a checkpoint file, or a checkpoint_dir (its newest valid checkpoint)")
    export.add_argument("output", help="a new directory for model.pt, optimizer.pt, scheduler.pt, export.json")

    train = sub.add_parser("train", usage="hvdkit train [--config FILE] [options]",
                           help="data-parallel training; launch one per GPU/slot with horovodrun, mpirun or srun")
    train.add_argument("--list", action="store_true", help="list the models and datasets, then exit")
    train.add_argument("--debug", action="store_true", help="show the traceback of any error")
    config.add_arguments(train)
    return parser


def run_doctor(args: argparse.Namespace) -> int:
    """This machine's report; or, given hosts (or in a multi-node allocation), theirs compared with
    this one's, in seconds (--selftest runs on this machine, before a job: not with hosts)."""
    import os

    from hvdkit.checks import doctor, hosts
    from hvdkit.launch.hostfile import (
        LaunchError,
        parse_hosts,
        read_hostfile,
        slurm_hosts,
    )

    try:
        listed = (parse_hosts(args.hosts, bare=True) if args.hosts else
                  read_hostfile(args.hostfile, bare=True) if args.hostfile else
                  slurm_hosts(os.environ) if "SLURM_JOB_NODELIST" in os.environ else [])
    except LaunchError as exc:
        print(f"hvdkit doctor: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    if args.selftest and (args.hosts or args.hostfile):
        print("hvdkit doctor: --selftest runs on this machine; run it without --hosts or --hostfile", file=sys.stderr)
        return job.BAD_INPUT
    in_allocation = not (args.hosts or args.hostfile) and len(listed) > 1
    if not (args.hosts or args.hostfile or in_allocation):
        return doctor.main(selftest_wanted=args.selftest)
    return hosts.main(listed, args.dir or hosts.default_directory(os.environ), in_allocation)


def train(args: argparse.Namespace) -> int:
    if args.list:
        from hvdkit import data, models
        print("models:  ", " ".join(models.names()))
        print("datasets:", " ".join(data.DATASETS))
        return 0
    try:  # the config's own checks before torch loads: a mistyped run is its line in a tenth of a second
        cfg = config.from_args(args)
    except config.ConfigError as exc:
        if args.debug:
            raise
        return _refused(exc)
    from hvdkit.data import (  # imports torch, which only training needs
        UnreadableSample,
        one_line,
    )
    from hvdkit.session import OWN_ERRORS
    from hvdkit.trainer import PEER_HINT, Trainer, failure_hint

    trainer = None  # its Session names who is gone after Horovod's shutdown
    try:
        trainer = Trainer(cfg)
        summary = trainer.fit()
    except OWN_ERRORS as exc:
        if args.debug:
            raise
        code = job.code_for(exc, (config.ConfigError,))
        rank = env.detect().rank
        session = getattr(trainer, "session", None)  # none yet where the Session itself refused
        gone = session.watchdog.after_shutdown(exc, session.size) if session else ""
        # One line for np ranks (hvdkit launch says it again last): rank 0's, or where Horovod shut
        # down because rank 0 is gone, the lowest rank left's.
        speaks = rank in (0, None) or session is not None and session.watchdog.lowest_rank_left()
        if speaks:
            print(f"hvdkit train: {exc}{gone}", file=sys.stderr, flush=True)
            if code != job.BAD_INPUT:  # bad input ends the job before it trained: its one line is enough
                job.record_exit(code, f"hvdkit train: {exc}{gone}")
            if session:  # its heartbeat goes before it ends: the ranks left know it said why (not gone)
                session.watchdog.stop(keep_stacks=True)
        from hvdkit.rank.ending.stops import defer_to_rank0

        defer_to_rank0(None if speaks else rank)
        return code
    except UnreadableSample as exc:  # on the rank that read it: the others wait for it, or for the launcher
        if args.debug:
            raise
        print(f"hvdkit train: {one_line(exc)}", file=sys.stderr, flush=True)
        return job.FAILED
    except Exception as exc:
        hint = failure_hint(exc)
        if hint is None or args.debug:
            raise
        rank = env.detect().rank
        session = getattr(trainer, "session", None)
        gone = session.watchdog.gone(session.size) if session and hint == PEER_HINT else ""
        hint = f"stopped because another rank ended first: {gone}" if gone else hint  # it may have had no word
        print(f"hvdkit train: {'' if rank is None else f'rank {rank} '}{hint}", file=sys.stderr, flush=True)
        return job.FAILED
    return summary.get("exit_code", job.OK)


def _refused(exc: config.ConfigError) -> int:
    """A config every rank refuses alike, before anything started: rank 0 says it (or the one
    process), the others leave it the word; exit 2 on every rank."""
    from hvdkit.rank.ending.stops import defer_to_rank0

    rank = env.detect().rank
    if rank in (0, None):
        print(f"hvdkit train: {exc}", file=sys.stderr, flush=True)
    defer_to_rank0(rank)
    return job.BAD_INPUT


def export_checkpoint(args: argparse.Namespace) -> int:
    from hvdkit.checkpoint import CheckpointError
    from hvdkit.zero import shards

    try:
        out = shards.export(args.source, args.output)
    except CheckpointError as exc:
        print(f"hvdkit checkpoint: {exc}", file=sys.stderr)
        return job.FAILED
    print(f"hvdkit checkpoint: exported {args.source} to {out}: torch.load() each file; "
          f"optimizer.pt loads into the same torch optimizer on one process")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    own = {command.name: command for command in SUBCOMMANDS}
    if argv[:1] and argv[0] in own:
        return importlib.import_module(own[argv[0]].module).main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return run_doctor(args)
    if args.command == "checkpoint":
        return export_checkpoint(args)
    if args.command == "train":
        try:
            return train(args)
        finally:
            if args.debug:  # the traceback, not the Session's one line (hvdkit.rank.ending.stops.exit_on_own_errors)
                sys.excepthook = sys.__excepthook__
    parser.error(f"unknown command {args.command}")
    return job.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
