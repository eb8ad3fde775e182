"""A model built on the meta device, its weights made one module at a time (ZeRO stage 3's
shard-by-shard build): no rank ever holds the whole model.

Users build the model as they would, under ``torch.device("meta")``: no memory, and no random
draw. ``replay`` then makes each module's weights in the order the modules were registered (the
order in which an eager build constructs them, for models that assign each module as it is made),
on temporary whole tensors of that module alone, by the module's own ``reset_parameters()``: the
draws an eager build made, in the same order, from the same generator state. Each weight is
handed to ``keep`` (stage 3 copies its rank's slice out) and let go, so a rank's peak is its
slices and the largest module.

A weight shared by two modules (an output layer tied to the embedding) is kept from its first
owner; the later one's draw is made and dropped, as an eager build draws it before the tie.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hvdkit.config import ConfigError


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model`` has a parameter or buffer on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def replay(model: nn.Module, device: torch.device, keep: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
    """Make each meta parameter's initial value on ``device``, module by module, and hand it to
    ``keep(parameter, value)``; meta buffers are made in place (a module's reset_parameters sets
    them, as BatchNorm's running statistics). ConfigError, in one line, for a module holding meta
    weights that has no ``reset_parameters``."""
    first: dict[int, tuple[int, str]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                first.setdefault(id(param), (id(module), name))
    for qualified, module in model.named_modules():
        own = [(name, p) for name, p in module._parameters.items() if p is not None and p.is_meta]
        buffers = [(name, b) for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not own and not buffers:
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ConfigError(f"zero 3: {qualified or 'the model'} ({type(module).__name__}) holds weights on the "
                              f"meta device and has no reset_parameters() to make them; build it on the CPU, or give "
                              f"it one")
        for name, param in own:
            module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
        for name, buffer in buffers:
            module._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            reset()
        for name, param in own:
            value = module._parameters[name].detach()
            module._parameters[name] = param
            if first[id(param)] == (id(module), name):
                keep(param, value)
            del value
