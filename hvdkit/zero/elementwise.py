"""Which optimizers update each element from its own gradient and state alone, so that stepping
part of a parameter, or part of the parameters, is what the whole step makes of it: the sharded
step (hvdkit.zero.optimizer) and the step of each gradient bucket as it lands
(hvdkit.rank.step.training) ask ``elementwise``."""

from __future__ import annotations

import torch

# Optimizers whose update of an element depends on that element's gradient and state alone, so
# that stepping a slice is stepping the parameter. Adafactor (factored rows and columns), Muon
# (whole matrices), LBFGS (a closure) and SparseAdam (sparse gradients) are not. The classes
# themselves, not their subclasses (``elementwise``): a subclass's step() may compute a statistic
# over every parameter first (a global-norm clip), which a slice or a bucket stepped alone changes.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD)


def elementwise(optimizer: torch.optim.Optimizer, declared: bool = False) -> bool:
    """Whether ``optimizer`` (the user's, not a wrapper of hvdkit's or Horovod's) updates each
    element on its own: its class is one of ELEMENTWISE itself, or the user declared it so
    (``elementwise_optimizer``). Whoever steps part of its parameters alone asks this: the
    sharded step (hvdkit.zero.optimizer), the step of each bucket as it lands (hvdkit.rank.step.training)."""
    return declared or type(optimizer) in ELEMENTWISE
