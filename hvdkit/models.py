"""Models by name: small built-in nets, torchvision's classification models, a tiny GPT; and
synchronized batch norm for any model."""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch
from torch import nn

from hvdkit.config import ConfigError

# torchvision classification models offered by name; any other name of
# torchvision.models.list_models(torchvision.models) works too.
TORCHVISION_MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_small",
                      "mobilenet_v3_large", "efficientnet_b0", "vgg11", "densenet121")


class UnknownModel(ConfigError):
    pass


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators: the same initial weights (and the same draws
    after them) in every run with this seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def mlp(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """Two hidden layers, no batch norm or dropout: data parallelism is exact for it."""
    features = in_channels * image_size * image_size
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 128), nn.ReLU(),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, num_classes))


def cnn(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """Two conv layers and a classifier: the default model, >= 97% on the embedded digits."""
    pooled = image_size // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * pooled * pooled, 128), nn.ReLU(), nn.Linear(128, num_classes))


BUILTIN: dict[str, Callable[[int, int, int], nn.Module]] = {"mlp": mlp, "cnn": cnn}


class TinyGPT(nn.Module):
    """A decoder-only Transformer over bytes: token and position embeddings, pre-norm causal
    self-attention blocks (torch's TransformerEncoderLayer with a causal mask), a linear head.
    Input (B, T) token ids; output (B, T, vocab) logits of each next token."""

    def __init__(self, vocab: int, seq_len: int, width: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        x = self.blocks(x, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))


LANGUAGE_MODELS: dict[str, Callable[[int, int], nn.Module]] = {"gpt-tiny": TinyGPT}


def build_language_model(name: str, vocab: int, seq_len: int) -> nn.Module:
    if name not in LANGUAGE_MODELS:
        raise UnknownModel(f"model {name!r} is not a language model; with --dataset text choose one of: "
                           f"{', '.join(LANGUAGE_MODELS)}")
    return LANGUAGE_MODELS[name](vocab, seq_len)


class _RepeatChannels(nn.Module):
    """Feeds grayscale images to torchvision models, which expect three channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def names() -> list[str]:
    return [*BUILTIN, *TORCHVISION_MODELS, *LANGUAGE_MODELS]


def build(name: str, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    if name in LANGUAGE_MODELS:
        raise UnknownModel(f"model {name!r} is a language model: use it with --dataset text")
    if name in BUILTIN:
        return BUILTIN[name](in_channels, image_size, num_classes)
    import torchvision

    if name not in torchvision.models.list_models(torchvision.models):
        raise UnknownModel(f"unknown model {name!r}; choose one of: {', '.join(names())}")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if in_channels == 1:
        model = nn.Sequential(_RepeatChannels(), model)
    elif in_channels != 3:
        raise UnknownModel(f"model {name!r} takes 1 or 3 channels, the data has {in_channels}")
    return model


def sync_batch_norm(model: nn.Module) -> nn.Module:
    """``model`` with each BatchNorm layer replaced by ``hvd.SyncBatchNorm``, weights and
    running statistics kept. Call it before creating the optimizer: it makes new parameters.
    Horovod's SyncBatchNorm runs on GPUs only, so on a CPU-only host this is refused."""
    import horovod.torch as hvd

    if not torch.cuda.is_available():
        raise ConfigError("sync_batch_norm: Horovod's SyncBatchNorm runs on GPUs only and this host has none; "
                          "drop sync_batch_norm (--sync-batch-norm) on CPUs")

    if isinstance(model, nn.modules.batchnorm._BatchNorm) and not isinstance(model, hvd.SyncBatchNorm):
        synced = hvd.SyncBatchNorm(model.num_features, model.eps, model.momentum, model.affine,
                                   model.track_running_stats)
        state = model.state_dict()
        synced.load_state_dict(state)
        return synced.to(next(iter(state.values())).device) if state else synced
    for name, child in model.named_children():
        setattr(model, name, sync_batch_norm(child))
    return model
