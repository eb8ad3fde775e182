"""``parallelize(model, mesh, plan)``: tensor parallelism applied by module name, in the shape of
torch's ``parallelize_module`` (a plan maps module names, fnmatch patterns as ``blocks.*.up``, to
styles: ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``RandomInRegion``). What a
style does to a layer is hvdkit.parallel.tensor's; which layers it applies to is the plan's, so
adding a model is writing a plan.

Each planned module is replaced by its parallel form holding this rank's block of its weights,
taken from the whole module (built from the same seed on every rank, so the split model computes
what the whole one does). A weight tied across two planned modules (an embedding and its output
layer, split alike by vocabulary rows) stays one parameter. Each split parameter says how
(``tp_dim``: the dimension split over the tensor-parallel group), for ``whole_state_dict`` and
for the step's norms; the rest are replicated on the group's ranks (a sequence-parallel one marked
``sequence_parallel``: its gradients are summed over the group, hvdkit.parallel.grads).

Attention is split by heads: a plan that splits q, k and v by columns gives each rank whole
heads (their features are consecutive), as many as the heads over tp; hvdkit's GPT and models
shaped as Hugging Face's read the number of heads from the projection's output.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from hvdkit.config import ConfigError
from hvdkit.parallel.ops import all_gather, gather_from_sp, scatter_to_sp
from hvdkit.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class ColwiseParallel:
    """An nn.Linear split by its output features (ColumnParallelLinear): its output stays in
    blocks, for a RowwiseParallel layer after it, or is joined (``gather_output``: an output
    layer whose logits the loss takes whole). ``input``: "whole" (the same on every rank),
    "sequence" (each rank's part of the sequence, gathered by this layer) or "gathered" (gathered
    by the SequenceParallel module before it, for several layers that read it: q, k and v)."""

    gather_output: bool = False
    unit: int = 1  # each rank's block holds whole units of this many features: an attention head's width
    input: str = "whole"

    def apply(self, module: nn.Module, group, name: str) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"tp: the plan splits {name} by columns, which is a {type(module).__name__}, "
                              f"not an nn.Linear")
        units = module.out_features // self.unit
        if self.unit > 1 and units % group.size:
            raise ConfigError(f"tp: {group.size} does not divide {name}'s {units} heads of {self.unit} features; "
                              f"give a tp that divides the heads")
        split = ColumnParallelLinear(module, group, name, gather_output=self.gather_output, input=self.input)
        _split_as(split, {"weight": 0, "bias": 0})
        return split


@dataclass(frozen=True)
class RowwiseParallel:
    """An nn.Linear split by its input features (RowParallelLinear: its input is a ColwiseParallel
    layer's blocks), or an nn.Embedding split by rows of the vocabulary (VocabParallelEmbedding:
    the ids whole). ``output``: "whole" on every rank, or "sequence", each rank's part of the
    sequence (reduce-scattered: sequence parallelism, where a row-parallel bias is a
    sequence-parallel parameter)."""

    output: str = "whole"

    def apply(self, module: nn.Module, group, name: str) -> nn.Module:
        if self.output not in ("whole", "sequence"):
            raise ConfigError(f"tp: {name}'s output {self.output!r} is not whole or sequence")
        parts = self.output == "sequence"
        if isinstance(module, nn.Linear):
            split = RowParallelLinear(module, group, name, sequence_parallel=parts)
            _split_as(split, {"weight": 1})
        elif isinstance(module, nn.Embedding):
            split = VocabParallelEmbedding(module, group, name, sequence_parallel=parts)
            _split_as(split, {"weight": 0})
        else:
            raise ConfigError(f"tp: the plan splits {name} by rows, which is a {type(module).__name__}, "
                              f"not an nn.Linear or nn.Embedding")
        return split


@dataclass(frozen=True)
class SequenceParallel:
    """A module between the tensor-parallel regions that runs on each rank's part of the sequence
    (along ``seq_dim``), as torch's ``SequenceParallel``: a norm, a dropout, or a block whose
    residual stream is in parts. Its own parameters (a norm's) are marked ``sequence_parallel``:
    each rank's gradient is of its part, summed over the group (hvdkit.parallel.grads). A dropout
    draws from the RNG tracker, each part its own masks. ``scatter_input``: its input arrives whole
    on every rank (the embeddings' sum) and each rank keeps its part (the backward gathers).
    ``gather_output``: its output is gathered whole for the ColwiseParallel(input="gathered")
    layers after it (the backward reduce-scatters). Not replaced: its submodules are planned as well."""

    scatter_input: bool = False
    gather_output: bool = False
    seq_dim: int = 1

    def apply(self, module: nn.Module, group, name: str, rng=None) -> nn.Module:
        for param in module.parameters(recurse=False):
            param.sequence_parallel = True
        if self.scatter_input:
            module.register_forward_pre_hook(
                lambda _, args: (scatter_to_sp(args[0], group, f"{name}.sequence", self.seq_dim), *args[1:]))
        if self.gather_output:
            module.register_forward_hook(
                lambda _, __, out: gather_from_sp(out, group, f"{name}.sequence", self.seq_dim))
        if isinstance(module, nn.Dropout) and module.p:
            RandomInRegion().apply(module, group, name, rng)
        return module


@dataclass(frozen=True)
class RandomInRegion:
    """A module inside a tensor-parallel region whose random draws (dropout) act on this rank's
    block: its forward draws from the RNG tracker's generator (hvdkit.parallel.rng), each rank its
    own masks. Not replaced: its submodules are planned as well."""

    def apply(self, module: nn.Module, group, name: str, rng=None) -> nn.Module:
        if rng is None:
            raise ConfigError(f"tp: the plan draws {name}'s randomness in a tensor-parallel region: give "
                              f"parallelize an RNG tracker (rng=RNGTracker(seed, mesh.tp_group))")
        forks: list = []

        def enter(*_):
            forks.append(rng.fork())
            forks[-1].__enter__()

        def leave(*_):
            forks.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


def _split_as(module: nn.Module, dims: dict[str, int]) -> None:
    for name, dim in dims.items():
        param = getattr(module, name, None)
        if param is not None:
            param.tp_dim = dim


def parallelize(model: nn.Module, mesh, plan: dict[str, object], rng=None) -> nn.Module:
    """``model`` with each module a pattern of ``plan`` names replaced by its style's parallel
    form over ``mesh``'s tensor-parallel group (every rank of the job calls it alike, after
    building the whole model from the same seed; no collective). The first pattern that matches
    a module's name is its style; a module inside a replaced one is left to it. ``rng``: the
    RNGTracker that RandomInRegion's modules draw from. ConfigError, in one line, for a pattern
    that names no module or a size the group does not divide."""
    group = mesh.tp_group
    if group is None:
        raise ConfigError("tp: parallelize takes a mesh bound to Horovod (mesh.bind(hvd) after hvd.init)")
    used: set[str] = set()  # the modules replaced
    hooked: set[str] = set()  # the modules whose draws are the tracker's
    originals: dict[int, tuple] = {}  # id of a whole weight -> (how it was split, its block)
    for name, module in list(model.named_modules()):
        pattern = next((p for p in plan if name and fnmatch.fnmatchcase(name, p)), None)
        if pattern is None or any(name.startswith(f"{done}.") for done in used):
            continue
        if isinstance(plan[pattern], (RandomInRegion, SequenceParallel)):
            plan[pattern].apply(module, group, name, rng)
            hooked.add(name)
            continue
        used.add(name)
        wholes = {key: param for key, param in module.named_parameters(recurse=False)}
        try:
            split = plan[pattern].apply(module, group, name)
        except ConfigError:
            raise
        except ValueError as exc:  # hvdkit.parallel.tensor's: a size the group does not divide
            raise ConfigError(f"tp: {name}: {exc}") from None
        for key, whole in wholes.items():
            block = getattr(split, key)
            tied = originals.get(id(whole))
            if tied is not None and tied[0] == (getattr(block, "tp_dim", None), tuple(block.shape)):
                setattr(split, key, tied[1])  # one parameter, as the whole model's were
            else:
                originals[id(whole)] = ((getattr(block, "tp_dim", None), tuple(block.shape)), block)
        model.set_submodule(name, split)
    unused = [pattern for pattern in plan if not any(fnmatch.fnmatchcase(name, pattern) for name in used | hooked)]
    if unused:
        raise ConfigError(f"tp: the plan's {', '.join(unused)} names no module of {type(model).__name__}")
    stale = next((name for name, param in model.named_parameters(remove_duplicate=False) if id(param) in originals),
                 None)
    if stale is not None:  # tied to a weight the plan split: the two would no longer be one
        raise ConfigError(f"tp: {stale} is tied to a weight the plan splits, and the plan leaves it whole; split "
                          f"both alike (an embedding by rows, its output layer by columns), or untie them")
    return model


def whole_state_dict(model: nn.Module, group, name: str = "hvdkit.tp.export") -> dict:
    """The model's state_dict with every split parameter joined whole (in rank order along its
    ``tp_dim``), on the CPU: every rank of ``group`` calls it alike and gets the same."""
    split = {id(p): p.tp_dim for p in model.parameters() if getattr(p, "tp_dim", None) is not None}
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for key, value in model.state_dict().items():
        dim = split.get(id(params[key])) if key in params else None
        if dim is not None and group.size > 1:
            value = all_gather(value, group, f"{name}.{key}", dim)
        state[key] = value.detach().to("cpu", copy=True)
    return state


def gpt_plan(model: nn.Module, loss_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, object]:
    """The plan of hvdkit's GPT (hvdkit.models.TinyGPT): the token embedding by vocabulary rows,
    each block's q, k and v by heads and its output projection by rows, its MLP's up by columns
    and down by rows, the output layer by vocabulary (its logits joined, unless ``loss_parallel``:
    then kept in blocks for vocab_parallel_cross_entropy). The position embedding and the norms are
    replicated. With dropout, the attention's (on this rank's heads) and the MLP's hidden one draw
    from the RNG tracker (parallelize's ``rng``). ``sequence_parallel``: between the split layers
    each rank holds its part of the sequence, from the embeddings' dropout (which scatters it) to
    the final norm; each norm gathers the sequence for the layers after it, each row-parallel layer
    reduce-scatters into the parts. A pipeline stage of the GPT
    (hvdkit.parallel.pipeline.stages.GPTStage) gets the plan of the modules it holds."""
    blocks = list(model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks)
    width = blocks[0].attention.head_width if blocks else 1
    into = "gathered" if sequence_parallel else "whole"
    out = "sequence" if sequence_parallel else "whole"
    heads = ColwiseParallel(unit=width, input=into)
    plan = {"tokens": RowwiseParallel(), "blocks.*.attention.q": heads,
            "blocks.*.attention.k": heads, "blocks.*.attention.v": heads,
            "blocks.*.attention.o": RowwiseParallel(output=out), "blocks.*.up": ColwiseParallel(input=into),
            "blocks.*.down": RowwiseParallel(output=out),
            "head": ColwiseParallel(gather_output=not loss_parallel, input=into)}
    dropout = any(isinstance(m, nn.Dropout) and m.p for m in model.modules())
    if dropout:
        plan.update({"blocks.*.attention": RandomInRegion(), "blocks.*.drop_hidden": RandomInRegion()})
    if sequence_parallel:
        gathering = SequenceParallel(gather_output=True)  # for the split layers after it
        plan.update({"drop": SequenceParallel(scatter_input=True), "blocks.*.norm1": gathering,
                     "blocks.*.norm2": gathering, "norm": gathering})
        if dropout:  # the residual stream's, on each rank's part
            plan["blocks.*.drop"] = SequenceParallel()
    names = [name for name, _ in model.named_modules()]  # a pipeline stage's part of the GPT holds some
    return {pattern: style for pattern, style in plan.items() if any(fnmatch.fnmatchcase(n, pattern) for n in names)}
