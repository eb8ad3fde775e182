"""Models by name (hvdkit.models): synchronized batch norm."""


import pytest
import torch

from hvdkit.config import ConfigError
from hvdkit.models import sync_batch_norm


def test_sync_batch_norm_is_refused_on_cpus(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal is for CPU-only hosts")
    with pytest.raises(ConfigError, match="SyncBatchNorm runs on GPUs only"):
        sync_batch_norm(model)


def test_sync_batch_norm_converts_layers_keeping_their_state(monkeypatch):
    """hvd.SyncBatchNorm's forward needs a GPU, which this host may not have: torch's CUDA
    check is mocked here to test the conversion only (layers, weights, running stats)."""
    import horovod.torch as hvd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    with torch.no_grad():
        model[1][0].weight.fill_(2.0)
        model[1][0].running_mean.fill_(0.5)
    converted = sync_batch_norm(model)
    layer = converted[1][0]
    assert isinstance(layer, hvd.SyncBatchNorm)
    assert torch.equal(layer.weight, torch.full((3,), 2.0)) and torch.equal(layer.running_mean, torch.full((3,), 0.5))
