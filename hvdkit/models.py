"""Models by name: small built-in nets, torchvision's classification models, a tiny GPT; and
synchronized batch norm for any model."""

from __future__ import annotations

import random
from typing import Callable, Optional

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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: query, key, value and output projections of their own
    (``q``, ``k``, ``v``, ``o``: what tensor parallelism splits, by columns and by rows), over
    torch's scaled_dot_product_attention."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if width % heads:
            raise ConfigError(f"model: width {width} is not a multiple of the {heads} heads")
        self.heads, self.head_width, self.dropout = heads, width // heads, dropout
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # The heads are read from q's output: tensor parallelism gives each rank a block of them.
        q, k, v = (projection(x).view(batch, length, -1, self.head_width).transpose(1, 2)
                   for projection in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                       is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    """A pre-norm Transformer block: x + attention(norm1(x)), then x + down(gelu(up(norm2(x))))."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(width), CausalSelfAttention(width, heads, dropout)
        self.norm2, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        # The MLP's hidden features: a block of them on each rank under tensor parallelism, whose
        # masks are drawn apart (hvdkit.parallel.rng); ``drop`` acts on what every rank holds whole.
        self.drop_hidden = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.drop(self.down(self.drop_hidden(nn.functional.gelu(self.up(self.norm2(x))))))


class TinyGPT(nn.Module):
    """A decoder-only Transformer over bytes: token and position embeddings, pre-norm causal
    self-attention blocks (``Block``: each with its own initial weights), a final norm and a
    linear head, tied to the token embedding with ``tie_output``. Input (B, T) token ids; output
    (B, T, vocab) logits of each next token.

    Checkpoints of the earlier layout (torch's TransformerEncoder: ``blocks.layers.N.self_attn
    .in_proj_weight`` holding q, k and v in one tensor) load as they are (``load_state_dict``), and
    resume with their optimizer state (``upgrade_checkpoint``); ``packed_state_dict`` writes this
    model's weights in that layout."""

    def __init__(self, vocab: int, seq_len: int, width: int = 128, layers: int = 4, heads: int = 4,
                 dropout: float = 0.0, tie_output: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie_output:
            self.head.weight = self.tokens.weight
        self._register_load_state_dict_pre_hook(_unpack_on_load)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.drop(self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def packed_state_dict(self) -> dict:
        """This model's weights named and packed as the earlier layout's (for a tool that reads
        those): q, k and v of each block in one ``in_proj`` tensor."""
        return _packed(self.state_dict())

    def upgrade_checkpoint(self, model_state: dict, optimizer_state: Optional[dict]) -> tuple[dict, Optional[dict]]:
        """A checkpoint's model and optimizer state in this layout, where they are in the earlier
        one (else as they are): each packed tensor split in q, k and v, and the optimizer's
        per-parameter state (momentum, Adam's moments, by parameter index) split and renumbered
        alike. Called by the resume (hvdkit.rank.resume.checkpoints) before it loads them."""
        if not any(name.endswith(_PACKED[0]) for name in model_state):
            return model_state, optimizer_state
        unpacked = _unpacked(model_state)
        if optimizer_state is None or "param_groups" not in optimizer_state:  # ZeRO's shards: by bucket
            return unpacked, optimizer_state
        old_names = list(model_state)  # the earlier layout's parameters, in their order, and nothing else
        new_index = {name: index for index, name in enumerate(name for name, _ in self.named_parameters())}
        state, groups = {}, []
        for group in optimizer_state["param_groups"]:
            params = []
            for index in group["params"]:
                old = old_names[index]
                for new, part in _split_names(old):
                    if new not in new_index:  # a tied output given an untied checkpoint's head
                        raise ConfigError(f"checkpoint: its {old} has no place in this model's parameters")
                    params.append(new_index[new])
                    if index in optimizer_state["state"]:
                        # each its own tensor: Adam counts a parameter's steps in place, in its "step"
                        state[new_index[new]] = {key: _part(value, part, 3) if _splits(value) else _own(value)
                                                 for key, value in optimizer_state["state"][index].items()}
            groups.append({**group, "params": sorted(params)})
        return unpacked, {**optimizer_state, "state": state, "param_groups": groups}


# The earlier layout's names, in a block's order, and this layout's for each.
_PACKED = ("self_attn.in_proj_weight", "self_attn.in_proj_bias")
_RENAMED = {"self_attn.out_proj.weight": "attention.o.weight", "self_attn.out_proj.bias": "attention.o.bias",
            "linear1.weight": "up.weight", "linear1.bias": "up.bias", "linear2.weight": "down.weight",
            "linear2.bias": "down.bias", "norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias",
            "norm2.weight": "norm2.weight", "norm2.bias": "norm2.bias"}


def _split_names(old: str) -> list[tuple[str, Optional[int]]]:
    """This layout's names for an earlier one's parameter, with the third of it each takes (None: whole)."""
    if not old.startswith("blocks.layers."):
        return [(old, None)]
    block, rest = old.removeprefix("blocks.layers.").split(".", 1)
    if rest in _PACKED:
        kind = "weight" if rest.endswith("weight") else "bias"
        return [(f"blocks.{block}.attention.{letter}.{kind}", part) for part, letter in enumerate("qkv")]
    return [(f"blocks.{block}.{_RENAMED[rest]}", None)]


def _splits(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _own(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _part(tensor: torch.Tensor, part: Optional[int], parts: int) -> torch.Tensor:
    return tensor if part is None else tensor.chunk(parts)[part].clone()


def _unpacked(state: dict) -> dict:
    return {new: _part(value, part, 3) for old, value in state.items() for new, part in _split_names(old)}


def _packed(state: dict) -> dict:
    """The inverse of ``_unpacked``: q, k and v of each block concatenated in the earlier names."""
    back = {}
    for name, value in state.items():
        if not name.startswith("blocks."):
            back[name] = value
            continue
        block, rest = name.removeprefix("blocks.").split(".", 1)
        if rest.startswith("attention.") and rest[len("attention.")] in "qkv":
            kind = rest.rsplit(".", 1)[1]
            key = f"blocks.layers.{block}.self_attn.in_proj_{kind}"
            if key not in back:
                back[key] = torch.cat([state[f"blocks.{block}.attention.{letter}.{kind}"] for letter in "qkv"])
            continue
        back[f"blocks.layers.{block}.{next(old for old, new in _RENAMED.items() if new == rest)}"] = value
    return back


def _unpack_on_load(state_dict, prefix, *args) -> None:
    """load_state_dict's pre-hook: an earlier layout's names and packed tensors, made this one's in place."""
    mine = {name: value for name, value in state_dict.items() if name.startswith(prefix)}
    if not any(name.endswith(_PACKED[0]) for name in mine):
        return
    for name in mine:
        del state_dict[name]
    state_dict.update((prefix + name, value) for name, value in
                      _unpacked({name[len(prefix):]: value for name, value in mine.items()}).items())


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
