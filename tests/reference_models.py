"""Models the tests build as users' code builds them, shared by the tests of the step, of sharded
weights and of tensor and pipeline parallelism:

- ``PackedGPT``: hvdkit's built-in GPT as it was until 2026-12-06 (torch's TransformerEncoder, q,
  k and v packed in one ``in_proj_weight``): the layout of the checkpoints written before, which
  hvdkit.models.TinyGPT loads and resumes.
- ``CausalLM``: a causal language model shaped as Hugging Face's are (``model.embed_tokens``, a
  ModuleList ``model.layers`` of decoder layers with ``self_attn.{q,k,v,o}_proj``, a gated
  ``mlp.{gate,up,down}_proj``, RMS norms, ``lm_head`` tied to the embedding), written here:
  transformers is not a dependency.
"""

import torch
import torch.utils.checkpoint
from torch import nn


class PackedGPT(nn.Module):
    """TinyGPT's earlier layout: one TransformerEncoderLayer deep-copied into every block."""

    def __init__(self, vocab: int, seq_len: int, width: int = 16, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        return self.head(self.norm(self.blocks(x, mask=self.mask[:length, :length], is_causal=True)))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads  # Hugging Face's: the heads are what q's output holds
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(width), Attention(width, heads)
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(width), MLP(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int,
                 checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed  # each layer's activations recomputed in the backward (HF's)
        self.embed_tokens, self.embed_positions = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.layers = nn.ModuleList(DecoderLayer(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens) + self.embed_positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return self.norm(x)


class CausalLM(nn.Module):
    """(B, T) token ids in, (B, T, vocab) logits out; the output projection is the embedding."""

    def __init__(self, vocab: int = 64, seq_len: int = 16, width: int = 32, layers: int = 2, heads: int = 4,
                 checkpointed: bool = False) -> None:
        super().__init__()
        self.model = Decoder(vocab, seq_len, width, layers, heads, checkpointed)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))
