"""hvdkit.parallel's tensor-parallel layers in every rank of a real job, each against the same layer
whole in one process, in fp64: the output, the input's gradient and the weights' gradients, for
two steps under the same names. Each rank builds the whole layer and its inputs from seeds (the
ranks of a tensor-parallel group alike, each data-parallel replica its own), so the reference
needs no collective. At 2 ranks the mesh is tp 2; at 4, tp 2 x dp 2 and tp 4, their process sets
all made at hvd.init. And the RNG tracker of dropout inside and outside the parallel regions.
Rank 0 prints "tensor parallel: ok at tp T x dp D" per mesh, or the job fails with the assertion.

    mpirun -np N python tests/programs/tensor_parallel_worker.py
"""

import copy

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hvdkit import env
from hvdkit.models import TinyGPT
from hvdkit.parallel.grads import sum_sequence_parallel_grads
from hvdkit.parallel.mesh import Mesh
from hvdkit.parallel.ops import all_gather, gather_from_sp
from hvdkit.parallel.plan import gpt_plan, parallelize
from hvdkit.parallel.rng import RNGTracker
from hvdkit.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

BATCH, SEQ, WIDTH, HIDDEN, VOCAB = 3, 4, 8, 12, 16


def close(ours, theirs, what):
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def block(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    width = t.shape[dim] // group.size
    return t.narrow(dim, group.rank * width, width)


def seeded(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def whole_linear(seed: int, fan_in: int, fan_out: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out).double()


def check_column(mesh, replica: int, step: int, gather_output: bool, sequence_parallel: bool) -> None:
    tp = mesh.tp_group
    what = f"column gather_output={gather_output} sequence_parallel={sequence_parallel} step {step}"
    whole = whole_linear(10 + step, WIDTH, HIDDEN)
    x = seeded(100 * replica + step, BATCH, SEQ, WIDTH).requires_grad_()
    upstream = seeded(200 * replica + step, BATCH, SEQ, HIDDEN)
    layer = ColumnParallelLinear(whole, tp, "test.column", gather_output=gather_output,
                                 input="sequence" if sequence_parallel else "whole")
    (whole(x) * upstream).sum().backward()
    mine = (block(x, tp, 1) if sequence_parallel else x).detach().clone().requires_grad_()
    out = layer(mine)
    expected = whole(x).detach()
    close(out, expected if gather_output else block(expected, tp, -1), f"{what}: output")
    (out * (upstream if gather_output else block(upstream, tp, -1))).sum().backward()
    close(mine.grad, block(x.grad, tp, 1) if sequence_parallel else x.grad, f"{what}: input's gradient")
    close(layer.weight.grad, block(whole.weight.grad, tp, 0), f"{what}: weight's gradient")
    close(layer.bias.grad, block(whole.bias.grad, tp, 0), f"{what}: bias's gradient")


def check_row(mesh, replica: int, step: int, sequence_parallel: bool) -> None:
    tp = mesh.tp_group
    what = f"row sequence_parallel={sequence_parallel} step {step}"
    whole = whole_linear(20 + step, HIDDEN, WIDTH)
    x = seeded(300 * replica + step, BATCH, SEQ, HIDDEN).requires_grad_()
    upstream = seeded(400 * replica + step, BATCH, SEQ, WIDTH)
    layer = RowParallelLinear(whole, tp, "test.row", sequence_parallel=sequence_parallel)
    (whole(x) * upstream).sum().backward()
    mine = block(x, tp, -1).detach().clone().requires_grad_()
    out = layer(mine)
    expected = whole(x).detach()
    close(out, block(expected, tp, 1) if sequence_parallel else expected, f"{what}: output")
    (out * (block(upstream, tp, 1) if sequence_parallel else upstream)).sum().backward()
    sum_sequence_parallel_grads(layer, tp, "test.row.grads")
    close(mine.grad, block(x.grad, tp, -1), f"{what}: input's gradient")
    close(layer.weight.grad, block(whole.weight.grad, tp, 1), f"{what}: weight's gradient")
    close(layer.bias.grad, whole.bias.grad, f"{what}: bias's gradient")


def check_mlp(mesh, replica: int, step: int, sequence_parallel: bool) -> None:
    """Megatron's MLP: column-parallel, then GELU on each rank's block, then row-parallel; with
    sequence parallelism the input and output are each rank's part of the sequence."""
    tp = mesh.tp_group
    what = f"mlp sequence_parallel={sequence_parallel} step {step}"
    up, down = whole_linear(30 + step, WIDTH, HIDDEN), whole_linear(40 + step, HIDDEN, WIDTH)
    x = seeded(500 * replica + step, BATCH, SEQ, WIDTH).requires_grad_()
    upstream = seeded(600 * replica + step, BATCH, SEQ, WIDTH)
    column = ColumnParallelLinear(up, tp, "test.mlp.up", input="sequence" if sequence_parallel else "whole")
    row = RowParallelLinear(down, tp, "test.mlp.down", sequence_parallel=sequence_parallel)
    expected = down(F.gelu(up(x)))
    (expected * upstream).sum().backward()
    part = (lambda t: block(t, tp, 1)) if sequence_parallel else (lambda t: t)
    mine = part(x).detach().clone().requires_grad_()
    out = row(F.gelu(column(mine)))
    close(out, part(expected.detach()), f"{what}: output")
    (out * part(upstream)).sum().backward()
    sum_sequence_parallel_grads(row, tp, "test.mlp.grads")
    close(mine.grad, part(x.grad), f"{what}: input's gradient")
    close(column.weight.grad, block(up.weight.grad, tp, 0), f"{what}: up's gradient")
    close(row.weight.grad, block(down.weight.grad, tp, 1), f"{what}: down's gradient")
    close(row.bias.grad, down.bias.grad, f"{what}: down's bias's gradient")


def check_gathered(mesh, replica: int, step: int) -> None:
    """Sequence parallelism's norm on each rank's part of the sequence, its output gathered once
    for the q, k and v layers that read it whole (``input="gathered"``): the outputs and every
    gradient are the whole layers', the norm's once its parts' gradients are summed."""
    tp = mesh.tp_group
    what = f"gathered step {step}"
    torch.manual_seed(60 + step)
    norm = nn.LayerNorm(WIDTH).double()
    with torch.no_grad():
        norm.weight.add_(seeded(61 + step, WIDTH)), norm.bias.add_(seeded(62 + step, WIDTH))
    wholes = [whole_linear(63 + 3 * step + i, WIDTH, HIDDEN) for i in range(3)]
    x = seeded(1100 * replica + step, BATCH, SEQ, WIDTH).requires_grad_()
    upstreams = [seeded(1200 * replica + 10 * step + i, BATCH, SEQ, HIDDEN) for i in range(3)]
    mine_norm = copy.deepcopy(norm)
    for param in mine_norm.parameters():
        param.sequence_parallel = True
    layers = [ColumnParallelLinear(w, tp, f"test.gathered.{i}", input="gathered") for i, w in enumerate(wholes)]
    normed = norm(x)
    sum((w(normed) * up).sum() for w, up in zip(wholes, upstreams, strict=True)).backward()
    mine = block(x, tp, 1).detach().clone().requires_grad_()
    gathered = gather_from_sp(mine_norm(mine), tp, "test.gathered.sequence", 1)
    outs = [layer(gathered) for layer in layers]
    for out, w in zip(outs, wholes, strict=True):
        close(out, block(w(normed).detach(), tp, -1), f"{what}: output")
    sum((out * block(up, tp, -1)).sum() for out, up in zip(outs, upstreams, strict=True)).backward()
    sum_sequence_parallel_grads(mine_norm, tp, "test.gathered.grads")
    close(mine.grad, block(x.grad, tp, 1), f"{what}: input's gradient")
    close(mine_norm.weight.grad, norm.weight.grad, f"{what}: norm's weight's gradient")
    close(mine_norm.bias.grad, norm.bias.grad, f"{what}: norm's bias's gradient")
    for layer, w in zip(layers, wholes, strict=True):
        close(layer.weight.grad, block(w.weight.grad, tp, 0), f"{what}: weight's gradient")


def check_embedding(mesh, replica: int, step: int, sequence_parallel: bool) -> None:
    tp = mesh.tp_group
    what = f"embedding sequence_parallel={sequence_parallel} step {step}"
    torch.manual_seed(50 + step)
    whole = nn.Embedding(VOCAB, WIDTH).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(700 * replica + step))
    upstream = seeded(800 * replica + step, BATCH, SEQ, WIDTH)
    layer = VocabParallelEmbedding(whole, tp, "test.embedding", sequence_parallel=sequence_parallel)
    (whole(ids) * upstream).sum().backward()
    out = layer(ids)
    part = (lambda t: block(t, tp, 1)) if sequence_parallel else (lambda t: t)
    close(out, part(whole(ids).detach()), f"{what}: output")
    (out * part(upstream)).sum().backward()
    close(layer.weight.grad, block(whole.weight.grad, tp, 0), f"{what}: weight's gradient")


def check_cross_entropy(mesh, replica: int, step: int) -> None:
    tp = mesh.tp_group
    what = f"cross-entropy step {step}"
    logits = (3 * seeded(900 * replica + step, BATCH, SEQ, VOCAB)).requires_grad_()
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * replica + step))
    weights = seeded(1100 * replica + step, BATCH, SEQ)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(BATCH, SEQ)
    (expected * weights).sum().backward()
    mine = block(logits, tp, -1).detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, tp, "test.loss")
    close(loss, expected.detach(), f"{what}: loss")
    (loss * weights).sum().backward()
    close(mine.grad, block(logits.grad, tp, -1), f"{what}: logits' gradient")


def check_rng(mesh) -> None:
    """Dropout inside a tensor-parallel region (the tracker's fork) draws a mask of its own on each
    rank of the group; outside, the same on every rank; the tracker's state, saved and loaded, draws
    the same masks again; torch's own generator goes on as if the region had not been."""
    tp = mesh.tp_group
    torch.manual_seed(5)  # the run's seed: the same on every rank
    tracker = RNGTracker(5, tp)
    ones = torch.ones(256, dtype=torch.float64)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    outside = F.dropout(ones, 0.5)
    insides, outsides = (all_gather(t.unsqueeze(0), tp, f"test.rng.{what}", 0)
                         for t, what in ((inside, "inside"), (outside, "outside")))
    assert all(torch.equal(outsides[0], row) for row in outsides), "outside a region: one mask on every rank"
    assert not any(torch.equal(insides[0], row) for row in insides[1:]), "inside: each rank's own mask"
    torch.manual_seed(5)
    assert torch.equal(F.dropout(ones, 0.5), outside), "the region left torch's own generator as it was"
    saved = tracker.state_dict()
    with tracker.fork():
        first = F.dropout(ones, 0.5)
    with tracker.fork():
        assert not torch.equal(F.dropout(ones, 0.5), first), "each region goes on from the last"
    tracker.load_state_dict(saved)
    with tracker.fork():
        assert torch.equal(F.dropout(ones, 0.5), first), "the saved state draws the same mask again"


def check_gpt_dropout(mesh, sequence_parallel: bool) -> None:
    """The GPT with dropout split by its plan, the attention's and the MLP's hidden dropout drawn
    from the tracker: three steps, after which every rank of a tensor-parallel group holds the same
    replicated weights (the norms', the positions': the masks of what the ranks hold whole agreed,
    else their gradients would differ), and the tracker's generator moved. With sequence
    parallelism the residual stream's dropout acts on each rank's part, its masks drawn apart; the
    norms' gradients are summed over the group."""
    tp = mesh.tp_group
    torch.manual_seed(0)
    whole = TinyGPT(64, 16, width=32, layers=2, heads=4, dropout=0.2).double()
    tracker = RNGTracker(0, tp)
    start = tracker.state.clone()
    model = parallelize(whole, mesh, gpt_plan(whole, sequence_parallel=sequence_parallel), rng=tracker)
    masks: list = []
    model.blocks[0].drop.register_forward_hook(  # the elements it zeroed
        lambda _, args, out: masks.append(((out == 0) & (args[0] != 0)).double()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * mesh.dp_group.rank + step))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        sum_sequence_parallel_grads(model, tp, "test.dropout.sequence")
        optimizer.step()
    what = f"dropout sequence_parallel={sequence_parallel}"
    for name, param in model.named_parameters():
        if getattr(param, "tp_dim", None) is None:  # replicated
            held = all_gather(param.detach().unsqueeze(0), tp, f"test.dropout.{name}", 0)
            assert all(torch.equal(held[0], row) for row in held[1:]), f"{what}: {name} differs across the group"
    assert not torch.equal(tracker.state, start), "the regions drew from the tracker"
    assert masks[0].shape[1] == (16 // tp.size if sequence_parallel else 16), masks[0].shape
    held = all_gather(masks[0].unsqueeze(0), tp, "test.dropout.masks", 0)
    differ = not all(torch.equal(held[0], row) for row in held[1:])
    assert differ == sequence_parallel, f"{what}: the residual dropout's masks differ across the group: {differ}"


def check_checkpointed_dropout(mesh) -> None:
    """Each block of the GPT with dropout recomputed in the backward (activation checkpointing) by
    the tracker's ``checkpoint``: the gradients of one step are bitwise those of the step without
    checkpointing, from the same generators' states; torch's checkpoint alone, which brings back
    torch's generator but not the tracker's, recomputes other masks inside the regions."""
    tp = mesh.tp_group
    torch.manual_seed(0)
    whole = TinyGPT(64, 16, width=32, layers=2, heads=4, dropout=0.2).double()
    tracker = RNGTracker(0, tp)
    model = parallelize(whole, mesh, gpt_plan(whole), rng=tracker)
    blocks = list(model.blocks)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(mesh.dp_group.rank))
    outside, inside = torch.get_rng_state(), tracker.state.clone()

    def gradients(run_block) -> list:
        torch.set_rng_state(outside)
        tracker.state = inside.clone()
        model.zero_grad()
        for index, block in enumerate(blocks):
            model.blocks[index] = Recomputed(block, run_block)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        for index, block in enumerate(blocks):
            model.blocks[index] = block
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients(lambda block, x: block(x))
    ours = gradients(lambda block, x: tracker.checkpoint(block, x))
    torchs = gradients(lambda block, x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True)), "checkpointed: other gradients"
    assert not all(torch.equal(a, b) for a, b in zip(plain, torchs, strict=True)), "the tracker's state mattered not"


class Recomputed(nn.Module):
    """``block`` run by ``run_block(block, x)``: as it is, or checkpointed."""

    def __init__(self, block: nn.Module, run_block) -> None:
        super().__init__()
        self.block, self.run_block = block, run_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_block(self.block, x)


def check(mesh: Mesh) -> None:
    check_rng(mesh)
    for sequence_parallel in (False, True):
        check_gpt_dropout(mesh, sequence_parallel)
    check_checkpointed_dropout(mesh)
    replica = mesh.dp_group.rank  # the ranks of one tensor-parallel group share their inputs
    for step in range(2):
        for gather_output in (False, True):
            check_column(mesh, replica, step, gather_output, sequence_parallel=False)
        check_column(mesh, replica, step, False, sequence_parallel=True)
        check_gathered(mesh, replica, step)
        for sequence_parallel in (False, True):
            check_row(mesh, replica, step, sequence_parallel)
            check_mlp(mesh, replica, step, sequence_parallel)
            check_embedding(mesh, replica, step, sequence_parallel)
        check_cross_entropy(mesh, replica, step)


def main() -> None:
    size = env.detect().size  # the launcher's: process sets are made at hvd.init, before Horovod knows it
    meshes = [Mesh(size, tp) for tp in (2, 4) if tp <= size]
    hvd.init(process_sets=[s for mesh in meshes for s in mesh.process_sets(hvd)] or None)
    for mesh in meshes:
        mesh.bind(hvd)
        check(mesh)
        hvd.barrier()
        if hvd.rank() == 0:
            print(f"tensor parallel: ok at tp {mesh.tp} x dp {mesh.dp}", flush=True)


if __name__ == "__main__":
    main()
