"""The torchrun arm of `hvdkit bench goodput`: the job as torchrun's users write it, and its start
on the rehearsal's hosts.

``train``: one rank of torch DistributedDataParallel over Gloo, as its tutorials write the loop
(DistributedSampler, SGD, rank 0 saving every ``--checkpoint-steps`` steps and every rank loading
the newest checkpoint at its start), on hvdkit train's synthetic images and model, so that the arms
train alike. Its checkpoints are written by hvdkit's checkpoint writer, its step reports to
metrics.jsonl as hvdkit train's are: the rehearsal watches and measures all arms alike.

``launch``: one ``torchrun --max-restarts N`` agent per host of the rehearsal (ssh, as horovodrun
and mpirun reach them), meeting at node0 through torchrun's c10d rendezvous; it ends when they all
have, with the first failure's code, and passes a stop signal on to them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from hvdkit.args import OneLineParser
from hvdkit.checks.hosts import ssh_command
from hvdkit.launch.planner import job_hosts
from hvdkit.system.sighandlers import Handlers

KEEP = 3  # checkpoints kept, as hvdkit train keeps them
RENDEZVOUS_PORT = 29400  # torchrun's default c10d rendezvous port
THREADS = "1"  # one thread per rank, as the other arms' ranks (the rehearsal's ONE_THREAD)


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from hvdkit import checkpoint, data, models

    dist.init_process_group("gloo")  # torchrun's env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = models.build(args.model, 3, args.image_size, data.SYNTHETIC_CLASSES)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = data.SyntheticImages(2048, args.image_size, seed=1)
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    writer = checkpoint.Writer(background=False)
    step = 0
    newest = checkpoint.existing(args.checkpoint_dir)
    if newest:
        state = checkpoint.load(newest[-1])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"hvdkit: resumed from {newest[-1]} (epoch {step // len(loader) + 1}, step {step})", flush=True)
    log = None
    if rank == 0:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.log_dir) / "metrics.jsonl", "a")

    def report(**record) -> None:
        if log:
            log.write(json.dumps({**record, "time": time.time()}) + "\n")
            log.flush()

    report(event="config", log_interval=1, world_size=size)
    while step < args.max_steps:
        epoch, done = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for images, labels in itertools.islice(loader, done, None):
            loss = F.cross_entropy(ddp(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            report(event="train", step=step, loss=loss.item())
            if step % args.checkpoint_steps == 0 or step == args.max_steps:
                if rank == 0:
                    writer.save(args.checkpoint_dir, step, {"model": model.state_dict(),
                                                            "optimizer": optimizer.state_dict(), "step": step}, KEEP)
                dist.barrier()
            if step == args.max_steps:
                break
    dist.destroy_process_group()
    return 0


def agent_command(host: str, nodes: int, max_restarts: int, rendezvous: str, train_args: Sequence[str]) -> list[str]:
    """torchrun's agent on ``host``, from this one (ssh)."""
    # The workers' own store each round, not the rendezvous's: shared, a round's ranks read addresses an
    # earlier round left there and failed to connect (Gloo connectFullMesh refused) at every restart.
    remote = ["env", f"OMP_NUM_THREADS={THREADS}", f"PATH={os.environ.get('PATH', '')}",
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m",
              "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1", "--max-restarts",
              str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rendezvous}:{RENDEZVOUS_PORT}",
              "--rdzv-id", "hvdkit-goodput", "-m", "hvdkit.bench.ddp_job", "train", *train_args]
    return ssh_command(host, remote)


def launch(args: argparse.Namespace, train_args: Sequence[str]) -> int:
    hosts = [host.name for host in job_hosts(None, None, os.environ) or []][:args.nodes]
    agents = [subprocess.Popen(agent_command(host, len(hosts), args.max_restarts, hosts[0], train_args),
                               stdin=subprocess.DEVNULL, start_new_session=True) for host in hosts]

    def stop(signum, frame) -> None:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    with Handlers((signal.SIGTERM, signal.SIGINT), stop):
        codes = [agent.wait() for agent in agents]
    return next((code for code in codes if code), 0)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hvdkit.bench.ddp_job")
    sub = p.add_subparsers(dest="what", required=True)
    run = sub.add_parser("train", help="one rank of the DDP job (under torchrun)")
    run.add_argument("--model", default="mlp")
    run.add_argument("--image-size", type=int, default=32)
    run.add_argument("--batch-size", type=int, default=32)
    run.add_argument("--lr", type=float, default=0.025)
    run.add_argument("--seed", type=int, default=42)
    run.add_argument("--max-steps", type=int, required=True)
    run.add_argument("--checkpoint-steps", type=int, required=True)
    run.add_argument("--checkpoint-dir", required=True)
    run.add_argument("--log-dir", required=True)
    start = sub.add_parser("launch", help="torchrun on the rehearsal's hosts; the train arguments after --")
    start.add_argument("--nodes", type=int, required=True)
    start.add_argument("--max-restarts", type=int, required=True)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:split], argv[split + 1:]
    args = parser().parse_args(own)
    return launch(args, rest) if args.what == "launch" else train(args)


if __name__ == "__main__":
    sys.exit(main())
