"""The differential harness: hvdkit's step against Horovod's DistributedOptimizer, in every rank of
one real job, over the models, optimizers and loops users train (docs/own-loop.md#the-differential-harness).

    mpirun -np N python tests/programs/differential.py [--only NAME,...] [--smoke] [--pow2]

Each cell is a model, an optimizer, the batches of each rank and a loop. Its reference is Horovod's
``DistributedOptimizer`` in the loop users write by hand, on a copy of the same initial weights
(the launch sets ``HOROVOD_FUSION_THRESHOLD=0``, so that the reference reproduces itself); the arms
are hvdkit's step run the ways users run it: the Trainer's step (``hvdkit.trainer.train_step``, what
``Trainer.fit`` calls for each batch), a Session loop calling ``session.backward(loss)``, and one
calling ``loss.backward()`` itself. After the cell's steps each arm's averaged gradients (the
``.grad`` left by the last step), weights and optimizer state are compared with the reference's:
bitwise at 2 ranks (a sum of two and its halving are exact in any order), within the cell's
relative-norm tolerance elsewhere (the ranks' sum goes in another order).

Every rank checks every cell; the ranks' verdicts are gathered, and rank 0 prints one line per cell
and arm, ``differential: <cell> <arm>: ok`` or ``... FAIL <what differs>``, then ``differential:
<cells> cells (<runs> runs), <failed> failed``, a run being one cell's loop; a failing cell does
not stop the launch. Exit status 0 either way (the test reads the lines); an error that ends the
job is the job's.

A row of another kind plugs in as a cell whose ``reference`` and arms are its own: the sharded
(ZeRO) rows compare with the unsharded reference here; the tensor-parallel rows (``tp``) with the
one-process step of the same global batch (``one_process``), their meshes' process sets made at
hvd.init.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import Callable, Optional

import horovod.torch as hvd
import torch
from torch import nn

import hvdkit
from hvdkit import env
from hvdkit.models import TinyGPT
from hvdkit.parallel.grads import sum_sequence_parallel_grads
from hvdkit.parallel.mesh import Mesh
from hvdkit.parallel.norms import clip_grad_norm_
from hvdkit.parallel.pipeline.stages import Pipeline, gpt_stage, sequential_stage, sum_tied_grads
from hvdkit.parallel.plan import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    gpt_plan,
    parallelize,
    whole_state_dict,
)
from hvdkit.rank.start import startup
from hvdkit.trainer import train_step
from hvdkit.zero.optimizer import ShardedOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from reference_models import CausalLM  # noqa: E402  -- tests/reference_models.py

BATCH = 4  # samples per micro-batch per rank
ARMS = ("trainer", "session", "own")


class TwoBuckets(nn.Module):
    """About 1.1 MiB of gradients: two of hvdkit's buckets (the first closes at 1 MiB), so that the
    step that updates each bucket as it lands is the one taken where it applies."""

    def __init__(self, head_dtype: torch.dtype = torch.float32, branch: Optional[Callable[[int], bool]] = None,
                 twice: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 512)
        self.middle = nn.Linear(512, 512)
        self.branch = nn.Linear(512, 512) if branch else None
        self.head = nn.Linear(512, 3).to(head_dtype)
        self.uses_branch, self.twice, self.step = branch, twice, 0

    def forward(self, x):
        h = torch.tanh(self.middle(torch.tanh(self.body(x))))
        if self.twice:  # one parameter used twice in a forward
            h = torch.tanh(self.middle(h))
        if self.branch is not None and self.uses_branch(self.step):
            h = h + torch.tanh(self.branch(h))
        return self.head(h.to(self.head.weight.dtype)).float()


class Tied(nn.Module):
    """A language model's tied input and output embedding, and an optional sparse one."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, sparse=sparse)
        self.mix = nn.Linear(16, 16)
        self.tied = not sparse
        self.out = nn.Linear(16, 50, bias=False)
        if self.tied:
            self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens).mean(1))))


class GlobalNormSGD(torch.optim.SGD):
    """Research code's pattern: SGD whose step first clips by the norm of all its gradients."""

    def __init__(self, params, lr: float = 1.0, max_norm: float = 0.01) -> None:  # Horovod remakes it from params
        super().__init__(params, lr=lr)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


@dataclasses.dataclass
class Cell:
    """One row of the harness. ``model()`` is made under the same seed on every rank; ``optimizer``
    makes the optimizer from the model; ``keys`` are the Session's config keys; ``reference_kwargs``
    go to Horovod's DistributedOptimizer; ``micro`` is K. ``loop`` names the loop shape's variant
    (see ``backward_pass``), ``hook`` a tensor hook on every weight; ``tolerance`` the relative norm
    allowed at other world sizes than 2; ``at`` the world sizes it runs at."""

    name: str
    model: Callable[[], nn.Module] = TwoBuckets
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.SGD(
        m.parameters(), lr=0.5, momentum=0.9)
    keys: dict = dataclasses.field(default_factory=dict)
    reference_kwargs: dict = dataclasses.field(default_factory=dict)
    micro: int = 1
    steps: int = 3
    arms: tuple = ARMS
    tokens: bool = False
    causal_lm: bool = False  # (B, 16) tokens in, each next token the target
    loop: str = "plain"
    hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    tolerance: float = 1e-5
    at: tuple = (2, 3, 4)
    poisoned: Optional[int] = None  # the step whose loss is NaN on every rank: skipped (on_nonfinite skip)
    fp16_scaled: bool = False  # the GPU's amp on this CPU: fp16 autocast and a GradScaler (see hvdkit_arm)
    compared: tuple = ("grads", "weights", "state")
    exact: bool = True  # bitwise at 2 ranks (not where the arm's arithmetic differs: a norm summed by slices)
    tp: int = 0  # tensor parallel: the one-process step is the reference (``one_process``, ``tensor_parallel_arm``)
    plan: Optional[Callable[[nn.Module], dict]] = None  # its hvdkit.parallel.plan
    pp: int = 0  # pipeline stages: the one-process step is the reference (``pipeline_arm``)
    schedule: str = "1f1b"  # the pipeline's (hvdkit.parallel.pipeline.schedules)
    micro_batches: int = 4  # the pipeline's, of each replica's batch of BATCH x micro samples
    cut: Optional[Callable] = None  # (model, stage, stages) -> this rank's stage: the GPT's (gpt_stage) by default


def hf_plan(model) -> dict:
    """The Hugging-Face-shaped model's plan: a few lines, as torch's tensor-parallel tutorials write
    them (the output tied to the embedding, both split by vocabulary rows)."""
    return {"model.embed_tokens": RowwiseParallel(), "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(gather_output=True)}


def hf_sequence_parallel_plan(model) -> dict:
    """The same with sequence parallelism, as torchtitan's plans write it: the first layer's input
    scattered into each rank's part of the sequence, each norm on its part gathering for the split
    layers after it, each row-parallel layer reduce-scattering back into the parts."""
    gathered = ColwiseParallel(input="gathered")
    return {"model.embed_tokens": RowwiseParallel(), "model.layers.0": SequenceParallel(scatter_input=True),
            "model.layers.*_layernorm": SequenceParallel(gather_output=True),
            "model.layers.*.self_attn.[qkv]_proj": gathered, "model.layers.*.mlp.gate_proj": gathered,
            "model.layers.*.mlp.up_proj": gathered,
            "model.layers.*.self_attn.o_proj": RowwiseParallel(output="sequence"),
            "model.layers.*.mlp.down_proj": RowwiseParallel(output="sequence"),
            "model.norm": SequenceParallel(gather_output=True), "lm_head": ColwiseParallel(gather_output=True,
                                                                                          input="gathered")}


def gpt_sequence_parallel_plan(model) -> dict:
    return gpt_plan(model, sequence_parallel=True)


def partial_head(model):
    return torch.optim.SGD(model.head.parameters(), lr=0.5)


def two_groups(model):
    return torch.optim.SGD([{"params": [*model.body.parameters(), *model.middle.parameters()]},
                            {"params": model.head.parameters(), "lr": 0.05, "weight_decay": 0.1}],
                           lr=0.5, momentum=0.9, weight_decay=0.01)


def frozen_body():
    model = TwoBuckets()
    model.body.requires_grad_(False)
    return model


SHARDED = ("weights",)  # ZeRO's gradients and optimizer state are each rank's slices: its weights are compared

CELLS = [
    Cell("fp32"),
    Cell("adam", optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
    Cell("bf16-autocast", keys={"amp": True}),
    Cell("mixed-dtypes", model=lambda: TwoBuckets(torch.float64)),
    Cell("optimizer-over-part", optimizer=partial_head),
    Cell("frozen-layers", model=frozen_body),
    Cell("unused-on-some-ranks", model=lambda: TwoBuckets(branch=lambda step: hvd.rank() % 2 == 1)),
    Cell("unused-on-some-steps", model=lambda: TwoBuckets(branch=lambda step: step % 2 == 0)),
    Cell("used-twice", model=lambda: TwoBuckets(twice=True)),
    Cell("tied-weights", model=Tied, tokens=True),
    Cell("hf-shaped-causal-lm", model=CausalLM, causal_lm=True, optimizer=lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.01, weight_decay=0.1)),
    Cell("sparse-embedding", model=lambda: Tied(sparse=True), tokens=True,
         optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5)),
    Cell("param-groups", optimizer=two_groups),
    Cell("accumulation", micro=2, keys={"batches_per_allreduce": 2}, reference_kwargs={"backward_passes_per_step": 2}),
    Cell("session-and-own-backward", micro=2, keys={"batches_per_allreduce": 2}, arms=("mixed",),
         reference_kwargs={"backward_passes_per_step": 2}),
    Cell("horovod-clipping", arms=("own",), loop="horovod-clip"),
    Cell("nonfinite-step-skipped", keys={"on_nonfinite": "skip"}, poisoned=1),
    Cell("predivide-tensor-by-tensor", keys={"gradient_predivide_factor": 2.0, "on_nonfinite": "skip"}, poisoned=1,
         reference_kwargs={"gradient_predivide_factor": 2.0}),  # Horovod's own path, a skipped step in it
    Cell("clip-grad-norm", keys={"clip_grad_norm": 0.05}, loop="reference-clip"),
    Cell("fp16-gradscaler", keys={"amp": True}, fp16_scaled=True),
    Cell("fp16-compression", keys={"fp16_allreduce": True}, tolerance=1e-2,
         reference_kwargs={"compression": hvd.Compression.fp16}),
    Cell("zero-1", keys={"zero": 1}, compared=SHARDED),
    Cell("zero-2", keys={"zero": 2}, compared=SHARDED),
    Cell("adasum", keys={"use_adasum": True}, reference_kwargs={"op": hvd.Adasum}, at=(2, 4)),
    Cell("global-norm-subclass", optimizer=lambda m: GlobalNormSGD(m.parameters())),
    Cell("tensor-hook", hook=lambda grad: grad.clamp(-1e-3, 1e-3)),
]
# Stage 3 (the weights sharded too) against the same unsharded step, where it applies: not sparse
# gradients, Adasum or an undeclared optimizer subclass (refused), nor a loop that reads the
# parameters' own gradients (Horovod's clipping pattern) or hooks them (their gradients are the units').
STAGE3 = ("fp32", "adam", "bf16-autocast", "mixed-dtypes", "optimizer-over-part", "frozen-layers",
          "unused-on-some-ranks", "unused-on-some-steps", "used-twice", "tied-weights", "hf-shaped-causal-lm",
          "param-groups", "accumulation", "session-and-own-backward", "nonfinite-step-skipped", "clip-grad-norm",
          "fp16-gradscaler", "fp16-compression")
# Not bitwise at 2 ranks: a clipping norm (the slices' squares summed), and K micro-batches (each
# micro-batch's gradient averaged, then the averages summed, as stage 2: no whole gradient kept).
CELLS += [dataclasses.replace(cell, name=f"zero-3-{cell.name}", keys={**cell.keys, "zero": 3}, compared=SHARDED,
                              exact=cell.name != "clip-grad-norm" and cell.micro == 1)
          for cell in CELLS if cell.name in STAGE3]
CELLS += [
    Cell("zero-3-activation-checkpointing", model=lambda: CausalLM(layers=3, checkpointed=True), causal_lm=True,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), keys={"zero": 3},
         compared=SHARDED),
    Cell("zero-3-gpt-groups", model=lambda: TinyGPT(64, 16, width=32, layers=3, dropout=0.1, tie_output=True),
         causal_lm=True, micro=2,  # SGD: Adam would blow up the keys' biases' gradients, zero but for rounding
         keys={"zero": 3, "batches_per_allreduce": 2, "zero_groups": ["blocks.*", "norm"]},
         reference_kwargs={"backward_passes_per_step": 2}, compared=SHARDED, exact=False),
]
# Tensor parallelism against the one-process step of the same global batch, in fp64 (and one row in
# fp32, within 1e-3), 50 steps: each step's loss and the weights at the end (the shards joined).
# Arms: Horovod's DistributedOptimizer over the data-parallel set (or none where it is one rank), ZeRO 1
# sharding within that set, and hvdkit's Session with tp (session.parallelize, setup, backward, step),
# with zero 1 too (ZeRO within the data-parallel set; where that set is one rank, neither ZeRO arm runs).
# At np 4 a data-parallel set of 2 stands beside tp 2: there run the rows where it meets something of
# its own (a tied weight, a norm and a skipped step agreed across both sets, sequence parallelism's sums);
# a model's plan, fp32's rounding and a schedule are the same at either size, and run at np 2 only.
TP_ARMS = ("tp", "tp-zero-1", "tp-session", "tp-session-zero-1")
CELLS += [
    Cell("tp-2-gpt", model=lambda: TinyGPT(64, 16, width=32, layers=2, heads=4).double(), causal_lm=True, tp=2,
         plan=gpt_plan, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=TP_ARMS, compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2, 4)),
    # SGD: Adam would scale the keys' biases' gradients (zero but for rounding: softmax ignores them) to full steps
    Cell("tp-2-gpt-fp32", model=lambda: TinyGPT(64, 16, width=32, layers=2, heads=4), causal_lm=True, tp=2,
         plan=gpt_plan, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=("tp", "tp-session"),
         compared=("losses", "weights"), exact=False, tolerance=1e-3, at=(2,)),
    Cell("tp-2-gpt-tied", model=lambda: TinyGPT(64, 16, width=32, layers=2, heads=4, tie_output=True).double(),
         causal_lm=True, tp=2, plan=gpt_plan, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), steps=50,
         arms=TP_ARMS, compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2, 4)),
    Cell("tp-2-gpt-clip-and-a-nonfinite-step", model=lambda: TinyGPT(64, 16, width=32, layers=2, heads=4).double(),
         causal_lm=True, tp=2, plan=gpt_plan, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
         steps=50, arms=("tp", "tp-session", "tp-session-zero-1"), compared=("losses", "weights"), exact=False,
         tolerance=1e-9, at=(2, 4),
         keys={"clip_grad_norm": 0.05}, poisoned=7),
    Cell("tp-2-hf-shaped-causal-lm", model=lambda: CausalLM().double(), causal_lm=True, tp=2, plan=hf_plan,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), steps=50,
         arms=("tp", "tp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2,)),
    # sequence parallelism: the norms on each rank's part of the sequence, their gradients summed over tp
    Cell("tp-2-gpt-sequence-parallel", model=lambda: TinyGPT(64, 16, width=32, layers=2, heads=4).double(),
         causal_lm=True, tp=2, plan=gpt_sequence_parallel_plan,
         optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=TP_ARMS, compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2, 4)),
    Cell("tp-2-hf-shaped-causal-lm-sequence-parallel", model=lambda: CausalLM().double(), causal_lm=True, tp=2,
         plan=hf_sequence_parallel_plan, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01,
                                                                              weight_decay=0.1),
         steps=50, arms=("tp", "tp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2,)),
]
# Pipelines: the GPT cut in 2 stages, each schedule at pp 2 (np 2), 1F1B at pp 2 x dp 2 (np 4, with the rows
# where the data-parallel set meets a tied weight, a clipping norm or a skipped step); 4 stages; and each stage
# split over a tensor-parallel group, tp 2 x pp 2 (np 4). In the loop users write by hand (Pipeline, Horovod's
# DistributedOptimizer over the data-parallel set; or ZeRO 1 within it) and in hvdkit's Session with pp
# (session.parallelize, setup, session.pipeline.step, step; with zero 1 where there is a data-parallel set).
PP_ARMS = ("pp", "pp-zero-1", "pp-session", "pp-session-zero-1")
CELLS += [
    Cell(f"pp-2-gpt-{schedule}", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4).double(),
         causal_lm=True, pp=2, schedule=schedule, micro=2, micro_batches=4,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), steps=50,
         arms=PP_ARMS if schedule == "1f1b" else ("pp", "pp-session"), compared=("losses", "weights"), exact=False,
         tolerance=1e-9, at=(2, 4) if schedule == "1f1b" else (2,))
    for schedule in ("gpipe", "1f1b")
] + [
    Cell("pp-2-gpt-tied", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4, tie_output=True).double(),
         causal_lm=True, pp=2, micro=2, micro_batches=4,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), steps=50,
         arms=("pp", "pp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2,)),
    # clipped by the whole pipeline's norm, the tied embedding's gradient counted once though both ends hold it
    Cell("pp-2-gpt-tied-clipped", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4,
                                                        tie_output=True).double(),
         causal_lm=True, pp=2, micro=2, micro_batches=4, keys={"clip_grad_norm": 0.05},
         optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=("pp", "pp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2, 4)),
    # a model of the user's own, an nn.Sequential cut at a named child (fp32: the harness's batches of features)
    Cell("pp-2-sequential-mlp", model=lambda: nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)),
         cut=lambda model, stage, stages: sequential_stage(model, stage, stages, cuts=["3"]), pp=2, micro=2,
         micro_batches=4, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=("pp", "pp-zero-1"), compared=("losses", "weights"), exact=False, tolerance=1e-5, at=(2, 4)),
    Cell("pp-2-gpt-fp32", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4), causal_lm=True, pp=2, micro=2,
         micro_batches=4, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=("pp", "pp-zero-1"), compared=("losses", "weights"), exact=False, tolerance=1e-3, at=(2, 4)),
    Cell("pp-2-gpt-clip-and-a-nonfinite-step", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4).double(),
         causal_lm=True, pp=2, micro=2, micro_batches=4,
         optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), steps=50,
         arms=("pp", "pp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(2, 4),
         keys={"clip_grad_norm": 0.05}, poisoned=7),
] + [
    # 4 stages at np 4: the middle stages receive and send both ways; the tied ends are a set of their own
    # (the untied GPT's 4 stages are these without that set)
    Cell("pp-4-gpt-tied-1f1b", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4, tie_output=True).double(),
         causal_lm=True, pp=4, micro=2, micro_batches=4,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), steps=50,
         arms=("pp", "pp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(4,)),
] + [
    Cell("tp-2-pp-2-gpt-1f1b", model=lambda: TinyGPT(64, 16, width=32, layers=4, heads=4).double(),
         causal_lm=True, tp=2, pp=2, plan=gpt_plan, micro=2, micro_batches=4,
         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), steps=50,
         arms=("pp", "pp-session"), compared=("losses", "weights"), exact=False, tolerance=1e-9, at=(4,)),
]
SMOKE = ("fp32", "optimizer-over-part", "mixed-dtypes", "zero-1", "zero-3-hf-shaped-causal-lm",  # horovodrun --gloo
         "tp-2-gpt-tied", "tp-2-gpt-sequence-parallel", "pp-2-gpt-1f1b")
MESHES: dict[tuple, Mesh] = {}  # (tp, pp) -> the mesh of its rows, made at hvd.init (main)


def mesh_of(cell: Cell) -> Mesh:
    return MESHES[(cell.tp or 1, cell.pp or 1)]


def batch_of(cell: Cell, rank: int, step: int) -> tuple:
    """This rank's batch of ``step``: K micro-batches of BATCH samples, the same in every arm."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    samples = BATCH * cell.micro
    if cell.causal_lm:
        tokens = torch.randint(0, 64, (samples, 17), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    if cell.tokens:
        return torch.randint(0, 50, (samples, 5), generator=generator), torch.randint(0, 50, (samples,),
                                                                                      generator=generator)
    return torch.randn(samples, 8, generator=generator), torch.randint(0, 3, (samples,), generator=generator)


def loss_of(model, micro) -> torch.Tensor:
    x, y = micro
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss * float("nan") if getattr(model, "poisoned", False) else loss


def made(cell: Cell):
    """The cell's model and optimizer, the same initial weights on every rank and in every arm."""
    torch.manual_seed(0)
    model = cell.model()
    if cell.hook is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(cell.hook)
    return model, cell.optimizer(model)


def observed(model, optimizer) -> dict:
    """What is compared: each trained parameter's gradient (dense) and weight, and the optimizer's
    state, by parameter order."""
    params = [p for p in model.parameters()]
    grads = [None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
             for p in params]
    state = []
    for p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                state.append((key, value.detach().clone()))
    return {"grads": grads, "weights": [p.detach().clone() for p in params], "state": state}


def reference(cell: Cell) -> dict:
    """Horovod's DistributedOptimizer in the loop users write by hand."""
    model, inner = made(cell)
    optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **cell.reference_kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu") if cell.fp16_scaled else None
    for step in range(cell.steps):
        model.step, model.poisoned = step, step == cell.poisoned
        optimizer.zero_grad()
        x, y = batch_of(cell, hvd.rank(), step)
        for micro in zip(x.split(BATCH), y.split(BATCH), strict=True):
            with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16,
                                enabled=cell.keys.get("amp", False)):  # as session.autocast() on a CPU
                loss = loss_of(model, micro)
            (scaler.scale(loss / cell.micro) if scaler else loss / cell.micro).backward()
        if model.poisoned:  # the hand-written guard: reduced, found not finite, not stepped
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                pass
        elif scaler:  # Horovod's pattern with a GradScaler
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        elif cell.loop in ("horovod-clip", "reference-clip"):  # Horovod's clipping pattern
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cell.keys.get("clip_grad_norm", 0.05))
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    return observed(model, optimizer)


def hvdkit_arm(cell: Cell, arm: str, log_dir: str) -> dict:
    """hvdkit's step, ``arm`` being the loop shape (see the module docstring; ``mixed``: the first
    micro-batch through ``session.backward``, the second through ``loss.backward()``)."""
    keys = {"seed": 0, "batch_size": BATCH, "logger": "none", "log_dir": log_dir, **cell.keys}
    session = hvdkit.Session(**keys)
    if cell.fp16_scaled:  # what the Session sets with amp on a GPU, here on the CPU's fp16 kernels
        session.amp_dtype, session.scaler = torch.float16, torch.amp.GradScaler("cpu")
    model, inner = made(cell)
    model, optimizer = session.setup(model, inner)
    for step in range(cell.steps):
        model.step, model.poisoned = step, step == cell.poisoned
        batch = batch_of(cell, session.rank, step)
        if arm == "trainer":
            train_step(session, model, loss_of, batch)
            continue
        optimizer.zero_grad()
        for index, micro in enumerate(session.micro_batches(batch) if arm != "own" else
                                      list(zip(*(part.split(BATCH) for part in batch), strict=True))):
            with session.autocast():
                loss = loss_of(model, micro)
            if arm == "session" or (arm == "mixed" and index == 0):
                session.backward(loss)
            elif cell.fp16_scaled:
                session.scaler.scale(loss / cell.micro).backward()
            else:
                (loss / cell.micro).backward()
        if cell.loop == "horovod-clip":
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with optimizer.skip_synchronize():
                session.step()
        else:
            session.step()
    result = observed(model, optimizer)
    if cell.keys.get("zero") == 3:  # the parameters are emptied: the weights are gathered whole
        whole = optimizer.model_state_dict()
        result["weights"] = [whole[name] for name, _ in model.named_parameters()]
    session.finish()
    return result


def one_process(cell: Cell) -> dict:
    """Tensor parallelism's reference: the whole model on this rank alone, stepped on the global
    batch (every data-parallel replica's share); each step's loss on this rank's replica's share."""
    model, optimizer = made(cell)
    mesh = mesh_of(cell)
    losses, clip = [], cell.keys.get("clip_grad_norm")
    for step in range(cell.steps):
        model.poisoned = step == cell.poisoned
        shares = [batch_of(cell, replica, step) for replica in range(mesh.dp)]
        with torch.no_grad():
            losses.append(loss_of(model, shares[mesh.dp_group.rank]))
        optimizer.zero_grad()
        loss_of(model, tuple(torch.cat(parts) for parts in zip(*shares, strict=True))).backward()
        if clip is None or torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)):
            optimizer.step()  # a step whose gradient is not finite is skipped
    return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()],
            "by_name": {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}}


def stage_of(theirs: dict, ours: dict) -> dict:
    """The one process's results that a pipeline stage holds: its parameters by name, and the
    losses where it is the last stage (the others compute none)."""
    return {"losses": theirs["losses"] if ours["losses"] else [],
            "weights": [theirs["by_name"][name] for name in ours["names"]]}


def pipeline_arm(cell: Cell, arm: str, log_dir: str) -> dict:
    """The GPT cut into ``cell.pp`` stages (hvdkit.parallel.pipeline), each replica's batch run as
    ``cell.micro_batches`` micro-batches by ``cell.schedule``, each stage's gradients averaged over
    its data-parallel set by Horovod's DistributedOptimizer (``pp``; none where the set is one rank)
    or reduce-scattered by ZeRO 1 within it (``pp-zero-1``), clipped by the whole pipeline's norm
    where the cell clips (a non-finite one skips the step on every rank), in the loop users write:
    this rank's stage's weights, and each step's loss on the last stage."""
    if arm.startswith("pp-session"):
        return pipeline_session(cell, log_dir, zero=1 if arm.endswith("zero-1") else 0)
    mesh = mesh_of(cell)
    torch.manual_seed(0)
    stage = (cell.cut or gpt_stage)(cell.model(), mesh.pp_group.rank, mesh.pp)
    names = [name for name, _ in stage.named_parameters()]
    if cell.tp:  # each stage split over its tensor-parallel group
        stage = parallelize(stage, mesh, cell.plan(stage))
    optimizer = cell.optimizer(stage)
    dp = mesh.dp_group
    if dp.size > 1 and arm == "pp":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=stage.named_parameters(),
                                             backward_passes_per_step=cell.micro_batches, process_set=dp.process_set)
    elif dp.size > 1:  # ZeRO 1 within the data-parallel set, its gradients reduced once the micro-batches are in
        optimizer = ShardedOptimizer(optimizer, hvd, 1, backward_passes_per_step=cell.micro_batches,
                                     process_set=dp.process_set)
    # MPI's point-to-point wherever there is an MPI world, more ranks than cores too: the Session's arm
    # takes the transport the product chooses (Horovod's broadcasts where the ranks share cores)
    pipeline = Pipeline(stage, mesh, cell.schedule, cell.micro_batches,
                        transport="mpi" if hvd.mpi_enabled() else "horovod")
    losses, clip, poisoned = [], cell.keys.get("clip_grad_norm"), [False]
    loss_fn = poisonable_loss(poisoned)

    for step in range(cell.steps):
        poisoned[0] = step == cell.poisoned
        optimizer.zero_grad()
        inputs, targets = batch_of(cell, dp.rank, step)
        per_micro_batch = pipeline.step(inputs, targets, loss_fn)
        if pipeline.is_last:
            losses.append(torch.stack(per_micro_batch).mean())
        if dp.size > 1:
            optimizer.synchronize()  # Horovod's clipping pattern: averaged over dp, then clipped
        sum_tied_grads(stage, mesh, f"differential.{cell.name}.tied")  # an embedding tied to the last stage's head
        norm = None if clip is None else clip_grad_norm_(stage.parameters(), clip, mesh.tp_group,
                                                          f"differential.{cell.name}.norm", stages=mesh.pp_group)
        with optimizer.skip_synchronize() if dp.size > 1 else contextlib.nullcontext():
            if norm is None or torch.isfinite(norm):  # the whole pipeline's norm on every rank: all skip alike
                optimizer.step()
    joined = whole_state_dict(stage, mesh.tp_group, f"differential.{cell.name}.{arm}") if cell.tp else dict(
        stage.named_parameters())
    return {"losses": losses, "weights": [joined[name].detach().clone() for name in names], "names": names}


def poisonable_loss(poisoned: list):
    """The last stage's loss: cross-entropy over a GPT's logits, NaN while ``poisoned[0]``."""
    def loss_fn(logits, targets):
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss * float("nan") if poisoned[0] else loss
    return loss_fn


def session_and_own_model(cell: Cell, keys: dict):
    """hvdkit's Session with ``keys`` (and ``on_nonfinite: skip`` where the cell poisons a step), and the
    cell's whole model made on this rank, with weights of its own off rank 0: the Session's
    parallelize gives every rank rank 0's."""
    session = hvdkit.Session(**keys, **({"on_nonfinite": "skip"} if cell.poisoned is not None else {}))
    torch.manual_seed(0)
    whole = cell.model()
    if hvd.rank() != 0:
        with torch.no_grad():
            for param in whole.parameters():
                param.add_(1.0)
    return session, whole


def pipeline_session(cell: Cell, log_dir: str, zero: int = 0) -> dict:
    """hvdkit's Session with ``pp`` (and ``tp``), in the loop users write: this rank's stage cut by
    session.parallelize from its own whole model (the Session gives every rank rank 0's weights), each
    replica's batch stepped by session.pipeline.step, its gradients averaged over the data-parallel set,
    clipped by the whole pipeline's norm, a non-finite step skipped on every stage
    (``on_nonfinite: skip``): this rank's stage's weights, and each step's loss on the last stage."""
    keys = {"seed": 0, "batch_size": BATCH, "logger": "none", "log_dir": log_dir, "tp": cell.tp or 1, "pp": cell.pp,
            "micro_batches": cell.micro_batches, "pp_schedule": cell.schedule, "zero": zero, **cell.keys}
    session, whole = session_and_own_model(cell, keys)
    stage = session.parallelize(whole)  # cut, then split by the GPT's plan under tp
    model, optimizer = session.setup(stage, cell.optimizer(stage))
    names = [name for name, _ in model.named_parameters()]
    losses, replica, poisoned = [], session.mesh.dp_group.rank, [False]
    loss_fn = poisonable_loss(poisoned)

    for step in range(cell.steps):
        poisoned[0] = step == cell.poisoned
        optimizer.zero_grad()
        per_micro_batch = session.pipeline.step(batch_of(cell, replica, step), loss_fn)
        if session.pipeline.is_last:
            losses.append(torch.stack(per_micro_batch).mean())
        session.step()
    joined = whole_state_dict(model, session.mesh.tp_group, f"differential.{cell.name}.session")
    session.finish()
    return {"losses": losses, "weights": [joined[name] for name in names], "names": names}


def tensor_parallel_arm(cell: Cell, arm: str, log_dir: str) -> dict:
    """The model split by ``cell.plan`` over the tensor-parallel group, each replica stepping on its
    share of the global batch, the gradients averaged over the data-parallel set: by Horovod's
    DistributedOptimizer (``tp``) or by ZeRO 1 sharding the state within the set (``tp-zero-1``)."""
    if arm.startswith("tp-session"):
        return tensor_parallel_session(cell, log_dir, zero=1 if arm.endswith("zero-1") else 0)
    mesh = mesh_of(cell)
    torch.manual_seed(0)
    whole = cell.model()
    names = [name for name, _ in whole.named_parameters()]
    model = parallelize(whole, mesh, cell.plan(whole))
    optimizer = cell.optimizer(model)
    dp = mesh.dp_group
    if dp.size > 1 and arm == "tp":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             process_set=dp.process_set)
    elif dp.size > 1:
        optimizer = ShardedOptimizer(optimizer, hvd, 1, process_set=dp.process_set)
    losses, clip = [], cell.keys.get("clip_grad_norm")
    for step in range(cell.steps):
        model.poisoned = step == cell.poisoned
        optimizer.zero_grad()
        loss = loss_of(model, batch_of(cell, dp.rank, step))
        losses.append(loss.detach().clone())
        loss.backward()
        if dp.size > 1:
            optimizer.synchronize()  # Horovod's clipping pattern: averaged over dp, then clipped
        # the sequence-parallel parameters' gradients, each rank's of its part: summed over tp
        sum_sequence_parallel_grads(optimizer if dp.size > 1 else model, mesh.tp_group,
                                    f"differential.{cell.name}.sequence")
        norm = None if clip is None else clip_grad_norm_(model.parameters(), clip, mesh.tp_group,
                                                          f"differential.{cell.name}.norm")
        with optimizer.skip_synchronize() if dp.size > 1 else contextlib.nullcontext():
            if norm is None or torch.isfinite(norm):  # the same norm on every rank of the mesh: all skip alike
                optimizer.step()
    joined = whole_state_dict(model, mesh.tp_group, f"differential.{cell.name}.{arm}")
    return {"losses": losses, "weights": [joined[name] for name in names]}


def tensor_parallel_session(cell: Cell, log_dir: str, zero: int = 0) -> dict:
    """hvdkit's Session with ``tp``, in the loop users write: its model split by session.parallelize
    (from this rank's own whole model: the Session gives every rank rank 0's weights), its gradients
    averaged over the data-parallel set, clipped by the whole model's norm, a non-finite step
    skipped on every rank (``on_nonfinite: skip``)."""
    keys = {"seed": 0, "batch_size": BATCH, "logger": "none", "log_dir": log_dir, "tp": cell.tp, "zero": zero,
            **cell.keys}
    session, whole = session_and_own_model(cell, keys)
    names = [name for name, _ in whole.named_parameters()]
    model = session.parallelize(whole, cell.plan(whole))
    model, optimizer = session.setup(model, cell.optimizer(model))
    losses, replica = [], session.mesh.dp_group.rank
    for step in range(cell.steps):
        model.poisoned = step == cell.poisoned
        optimizer.zero_grad()
        loss = loss_of(model, batch_of(cell, replica, step))
        losses.append(loss.detach().clone())
        session.backward(loss)
        session.step()
    joined = whole_state_dict(model, session.mesh.tp_group, f"differential.{cell.name}.session")
    session.finish()
    return {"losses": losses, "weights": [joined[name] for name in names]}


def differences(ours: dict, theirs: dict, exact: bool, tolerance: float, compared: tuple,
                whose: str = "Horovod's") -> list[str]:
    """What differs, by kind and index: bitwise where ``exact``, else beyond ``tolerance`` in the
    relative norm of the difference; ``whose``: the reference, as the lines name it."""
    said = []
    for kind in compared:
        if len(ours[kind]) != len(theirs[kind]):
            said.append(f"{kind}: {len(ours[kind])} tensors, {whose} {len(theirs[kind])}")
            continue
        for index, (a, b) in enumerate(zip(ours[kind], theirs[kind], strict=True)):
            if kind == "state":
                (_, a), (_, b) = a, b
            if (a is None) != (b is None):
                said.append(f"{kind}[{index}]: {'none' if a is None else 'one'}, {whose} "
                            f"{'none' if b is None else 'one'}")
                continue
            if a is None:
                continue
            if a.dtype != b.dtype or a.shape != b.shape:
                said.append(f"{kind}[{index}]: {a.dtype} {tuple(a.shape)}, {whose} {b.dtype} {tuple(b.shape)}")
                continue
            if exact and torch.equal(a, b):
                continue
            a64, b64 = a.double(), b.double()
            if torch.equal(a64.isnan(), b64.isnan()):  # a NaN where the reference has one agrees (a poisoned loss)
                a64, b64 = a64.nan_to_num(0.0), b64.nan_to_num(0.0)
            scale = b64.norm().item() or 1.0
            relative = (a64 - b64).norm().item() / scale
            if exact or not relative <= tolerance:
                ratio = (a64 * b64).sum().item() / (b64 * b64).sum().item() if b64.norm() > 0 else float("nan")
                said.append(f"{kind}[{index}]: relative difference {relative:.2e}, ours/{whose} {ratio:.3f}")
    return said


def run(cells: list[Cell]) -> int:
    """Every cell on every rank; one verdict line per cell and arm on rank 0. The count failed."""
    failed = 0
    with tempfile.TemporaryDirectory(prefix="hvdkit-differential-") as scratch:
        for cell in cells:
            theirs = one_process(cell) if cell.tp or cell.pp else reference(cell)
            for arm in cell.arms:
                if arm.endswith("zero-1") and mesh_of(cell).dp == 1:
                    continue  # ZeRO within a data-parallel set of one rank: nothing to shard
                try:
                    arm_of = pipeline_arm if cell.pp else tensor_parallel_arm if cell.tp else hvdkit_arm
                    ours = arm_of(cell, arm, os.path.join(scratch, f"{cell.name}-{arm}"))
                    said = differences(ours, stage_of(theirs, ours) if cell.pp else theirs,
                                       hvd.size() == 2 and cell.exact, cell.tolerance, cell.compared,
                                       "one process's" if cell.tp or cell.pp else "Horovod's")
                except Exception as error:  # noqa: BLE001  -- the cell's failure, said; the launch goes on
                    said = [f"{type(error).__name__}: {error}".splitlines()[0]]
                everyone = hvd.allgather_object(said, name=f"differential.{cell.name}.{arm}")
                problems = [f"rank {rank}: {'; '.join(lines[:3])}" for rank, lines in enumerate(everyone) if lines]
                failed += bool(problems)
                if hvd.rank() == 0:
                    verdict = "ok" if not problems else "FAIL " + " | ".join(problems[:2])
                    print(f"differential: {cell.name} {arm}: {verdict}", flush=True)
    if hvd.rank() == 0:
        runs = sum(len([arm for arm in cell.arms if not (arm.endswith("zero-1") and mesh_of(cell).dp == 1)])
                   for cell in cells)
        print(f"differential: {len(cells)} cells ({runs} runs), {failed} failed", flush=True)
    return failed


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="these cells, comma-separated")
    parser.add_argument("--smoke", action="store_true", help=f"the smoke subset: {', '.join(SMOKE)}")
    args = parser.parse_args(argv)
    # hvdkit's own settings, as a Session sets them before Horovod starts, so that the arms run as in
    # a user's job (every Session after finds Horovod started).
    for name, value in {**startup.performance_settings(False), **startup.reproducible_settings()}.items():
        os.environ.setdefault(name, value)
    size = env.detect().size  # the launcher's: the meshes' process sets are made at hvd.init
    MESHES.update({(cell.tp or 1, cell.pp or 1): Mesh(size, cell.tp or 1, cell.pp or 1) for cell in CELLS
                   if (cell.tp or cell.pp) and size % ((cell.tp or 1) * (cell.pp or 1)) == 0})
    shared: dict = {}  # the meshes' sets by their ranks: each made once
    hvd.init(process_sets=[s for mesh in MESHES.values() for s in mesh.process_sets(hvd, shared)] or None)
    for mesh in MESHES.values():
        mesh.bind(hvd)
    startup.place_process(hvd.local_rank(), hvd.local_size())  # the Session's torch threads for the reference too
    chosen = [cell for cell in CELLS if (hvd.size() in cell.at or hvd.size() not in (2, 3, 4))
              and (not (cell.tp or cell.pp) or (cell.tp or 1, cell.pp or 1) in MESHES)]
    if args.smoke:
        chosen = [cell for cell in chosen if cell.name in SMOKE]
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {cell.name for cell in CELLS}
        if unknown:
            print(f"differential: no cell named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        chosen = [cell for cell in chosen if cell.name in names]
    run(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
