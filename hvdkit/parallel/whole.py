"""A tensor-parallel or pipelined model's state joined whole for a checkpoint, and a whole state split again.

A checkpoint of a tensor-parallel run holds the whole model and the whole optimizer state, as a
data-parallel run's does: every split parameter (``tp_dim``, hvdkit.parallel.plan) joined along
that dimension in rank order (hvdkit.parallel.plan's ``whole_state_dict``), and so each of its
optimizer tensors of the parameter's shape (Adam's moments, SGD's momentum). So it resumes at any
tensor-parallel size, tp 1 included (each rank takes its block of what it reads:
``own_model_state``, ``own_optimizer_state``), and exports as it is.
The optimizer state's parameters are numbered in the model's parameter order, which parallelize
keeps (each planned module is replaced in place, its weight and bias as the whole module's).

Joining is a collective of the tensor-parallel group (every rank of it calls alike, at the same
point); splitting is not (each rank takes its block of the same whole state). A snapshot in host
memory is written by each rank of a group on its own, with no collective in the step
(``block_dims`` says how it is split), and joined by the rank that reads them (``joined_blocks``).

A pipeline's stages hold disjoint parts of the model under the whole model's names: each stage's
state, whole across its tensor-parallel group, goes to the pipeline's first rank, which joins them
and numbers the optimizer's state in the whole model's order (``joined_stages``); each stage takes
its entries back by name (``own_stage_state``, ``own_stage_optimizer_state``), then its blocks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from hvdkit.parallel.ops import all_gather, block


def split_dims(params: list) -> dict[int, int]:
    """The optimizer state's parameter number -> its ``tp_dim``, for the split parameters of
    ``params`` (the parameters in the order the optimizer's state_dict numbers them)."""
    return {index: p.tp_dim for index, p in enumerate(params) if getattr(p, "tp_dim", None) is not None}


def whole_optimizer_state(saved: dict, params: list, group, name: str) -> dict:
    """An optimizer state_dict over ``params`` (``saved``: this rank's) with each split parameter's
    tensors of its shape joined whole, on the CPU; its scalars (Adam's step) as they are, alike on
    every rank."""
    dims = split_dims(params)
    state = {}
    for index, per_parameter in sorted(saved["state"].items()):
        joined = {}
        for key, value in per_parameter.items():
            if torch.is_tensor(value) and index in dims and value.shape == params[index].shape and group.size > 1:
                value = all_gather(value, group, f"{name}.{index}.{key}", dims[index])
            joined[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
        state[index] = joined
    return {"state": state, "param_groups": saved["param_groups"]}


def own_model_state(model: nn.Module, whole: dict, group) -> dict:
    """This rank's blocks of a whole state_dict, for ``model`` split over ``group``."""
    dims = {name: p.tp_dim for name, p in model.named_parameters(remove_duplicate=False)
            if getattr(p, "tp_dim", None) is not None}
    return {key: block(value, group, dims[key]) if key in dims else value for key, value in whole.items()}


def own_optimizer_state(whole: dict, params: list, group) -> dict:
    """This rank's blocks of a whole optimizer state_dict (``whole_optimizer_state``'s, or a
    data-parallel run's), for an optimizer over ``params`` of a model split over ``group``."""
    dims = split_dims(params)
    state = {}
    for index, per_parameter in whole["state"].items():
        index = int(index)
        whole_shape = None
        if index in dims:
            whole_shape = list(params[index].shape)
            whole_shape[dims[index]] *= group.size
        own = {}
        for key, value in per_parameter.items():
            if torch.is_tensor(value) and whole_shape is not None and list(value.shape) == whole_shape:
                value = block(value, group, dims[index])
            own[key] = value
        state[index] = own
    return {"state": state, "param_groups": whole["param_groups"]}


def block_dims(model: nn.Module, params: list) -> dict:
    """How this rank's state is split, for ``joined_blocks``: each split model tensor's dimension by
    its state_dict name; each split parameter's optimizer number -> (dimension, its block's shape)."""
    return {"model": {name: p.tp_dim for name, p in model.named_parameters(remove_duplicate=False)
                      if getattr(p, "tp_dim", None) is not None},
            "optimizer": {index: (dim, tuple(params[index].shape)) for index, dim in split_dims(params).items()}}


def whole_sharded_state(optimizer, dp_group, name: str) -> dict:
    """The torch state_dict of a ZeRO optimizer (hvdkit.zero.optimizer.ShardedOptimizer over
    ``dp_group``'s set) as one optimizer over this rank's parameters would have it: each bucket's
    slices of each state tensor allgathered over the set, then cut into the parameters' shapes. Every
    rank of the set calls it alike (each holds state for the same buckets, from the first step on)."""
    state: dict[int, dict] = {}
    for n, (piece, bucket) in enumerate(zip(optimizer.slices, optimizer.buckets, strict=True)):
        for key, value in sorted(optimizer.inner.state.get(piece, {}).items()):
            flat = value
            if torch.is_tensor(value) and value.dim() and dp_group.size > 1:
                flat = all_gather(value, dp_group, f"{name}.{n}.{key}", 0)
            for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True):
                whole = torch.is_tensor(value) and value.dim()
                size = math.prod(shape)
                state.setdefault(i, {})[key] = flat[offset:offset + size].view(shape).clone() if whole else value
    groups, first = [], 0
    for options, count in zip(optimizer.group_options(), optimizer.group_sizes, strict=True):
        groups.append({**options, "params": list(range(first, first + count))})
        first += count
    return {"state": state, "param_groups": groups}


def joined_blocks(blocks: list[dict]) -> dict:
    """One whole state from each tensor-parallel rank's own (``blocks``, in rank order, as each rank
    wrote it, with ``tp_block``: ``block_dims``): each split tensor of the model and of the optimizer
    joined along its dimension, the rest rank 0's. No collective: a snapshot's blocks, read by one rank."""
    first, dims = blocks[0], blocks[0]["tp_block"]
    model = {key: torch.cat([block["model"][key] for block in blocks], dim=dims["model"][key])
             if key in dims["model"] else value for key, value in first["model"].items()}
    state = {}
    for index, per_parameter in first["optimizer"]["state"].items():
        dim, shape = dims["optimizer"].get(index, (None, None))
        state[index] = {key: torch.cat([block["optimizer"]["state"][index][key] for block in blocks], dim=dim)
                        if dim is not None and torch.is_tensor(value) and tuple(value.shape) == shape else value
                        for key, value in per_parameter.items()}
    return {**first, "model": model, "optimizer": {"state": state, "param_groups": first["optimizer"]["param_groups"]}}


def by_name(saved: dict, params: list, module: nn.Module) -> dict:
    """An optimizer state_dict over ``params`` (numbered as the optimizer numbers them) of a pipeline
    stage ``module`` (hvdkit.parallel.pipeline.stages.with_whole_names), its parameters named as in the
    whole model: ``state`` by name, and each param group's ``params`` as names."""
    name_of = {id(param): name for param, name in zip(module.parameters(), module.own_parameter_names, strict=True)}
    names = [name_of[id(param)] for param in params]
    return {"state": {names[int(index)]: value for index, value in saved["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in saved["param_groups"]]}


def joined_stages(model_state: dict, optimizer_state: dict, module: nn.Module, params: list, pp_group, hvd,
                  name: str) -> Optional[tuple[dict, dict]]:
    """The whole model's state and its optimizer's, from each stage's (``model_state``,
    ``optimizer_state``: this stage's, whole across its tensor-parallel group, over ``params``), on the
    pipeline's first rank: the state_dicts' keys are the whole model's already (a stage keeps its
    modules' names), and the optimizer's state is numbered again in the whole model's parameter order,
    as an optimizer over the whole model numbers it, so that the checkpoint resumes at any mesh, one
    process included. Every stage's part goes over the pipeline's set once (a broadcast from each
    stage in turn); the ranks of ``pp_group`` call it alike. None on its other ranks."""
    mine = (model_state, by_name(optimizer_state, params, module))
    parts = [hvd.broadcast_object(mine if stage == pp_group.rank else None, root_rank=rank, name=f"{name}.{stage}",
                                  process_set=pp_group.process_set) for stage, rank in enumerate(pp_group.ranks)]
    if pp_group.rank != 0:
        return None
    number = {parameter: index for index, parameter in enumerate(module.whole_parameter_names)}
    model, state, groups = {}, {}, []
    for stage_model, stage_optimizer in parts:
        model.update(stage_model)
        state.update({number[parameter]: value for parameter, value in stage_optimizer["state"].items()})
        for index, group in enumerate(stage_optimizer["param_groups"]):
            if index == len(groups):
                groups.append({**group, "params": []})
            groups[index]["params"] += [number[parameter] for parameter in group["params"]]
    for group in groups:
        group["params"].sort()
    return model, {"state": dict(sorted(state.items())), "param_groups": groups}


def own_stage_state(module: nn.Module, whole_model: dict) -> dict:
    """The entries of a whole model's state_dict that pipeline stage ``module`` holds (its keys are
    the whole model's); a key it lacks is left out, for load_state_dict to name."""
    return {key: whole_model[key] for key in module.state_dict() if key in whole_model}


def own_stage_optimizer_state(whole_state: dict, params: list, module: nn.Module, own_groups: list) -> dict:
    """This stage's part of a whole model's optimizer state_dict (``joined_stages``', or one
    process's over ``model.parameters()``), numbered as this stage's optimizer numbers ``params``;
    ``own_groups``: its param groups (their ``params``), whose options the whole state's replace."""
    number = {parameter: index for index, parameter in enumerate(module.whole_parameter_names)}
    name_of = {id(param): name for param, name in zip(module.parameters(), module.own_parameter_names, strict=True)}
    state = {}
    for index, param in enumerate(params):
        saved = whole_state["state"].get(number[name_of[id(param)]])
        if saved is not None:
            state[index] = saved
    groups = [{**whole_group, "params": own["params"]}
              for whole_group, own in zip(whole_state["param_groups"], own_groups, strict=True)]
    return {"state": state, "param_groups": groups}
