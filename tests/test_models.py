"""Models by name (hvdkit.models): synchronized batch norm; the GPT and the checkpoints of its earlier layout."""

import copy

import pytest
import torch

from hvdkit.config import ConfigError
from hvdkit.models import sync_batch_norm
from reference_models import CausalLM, PackedGPT


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


def _gpts():
    from hvdkit.models import TinyGPT

    torch.manual_seed(0)
    packed = PackedGPT(32, 8).double()
    torch.manual_seed(1)
    return packed, TinyGPT(32, 8, width=16, layers=2, heads=4).double()


def test_the_gpt_loads_a_checkpoint_of_its_packed_layout_and_computes_the_same():
    """In fp64 the separate q, k, v and o projections over scaled_dot_product_attention give what
    torch's TransformerEncoderLayer gives from the same weights; and back: packed_state_dict loads
    into the earlier layout."""
    packed, gpt = _gpts()
    tokens = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(2))
    gpt.load_state_dict(packed.state_dict())
    torch.testing.assert_close(gpt(tokens), packed(tokens), rtol=0, atol=1e-12)
    assert "blocks.0.attention.k.weight" in gpt.state_dict() and "blocks.layers.0.self_attn.in_proj_weight" \
        in gpt.packed_state_dict()
    torch.manual_seed(3)
    again = PackedGPT(32, 8).double()
    again.load_state_dict(gpt.packed_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), packed.state_dict().values(),
                                                 strict=True))


def test_a_packed_checkpoints_adam_state_resumes_as_the_same_training():
    """upgrade_checkpoint splits Adam's moments as it splits the weights: two steps in the earlier
    layout, then one more in each layout from there, end at the same weights (fp64)."""
    packed, gpt = _gpts()
    batches = [torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]

    def step(model, optimizer, tokens):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    adam = torch.optim.Adam(packed.parameters(), lr=0.01)
    for tokens in batches[:2]:
        step(packed, adam, tokens)
    saved = copy.deepcopy((packed.state_dict(), adam.state_dict()))  # as a checkpoint file holds them: no alias
    model_state, optimizer_state = gpt.upgrade_checkpoint(*saved)
    gpt.load_state_dict(model_state)
    resumed = torch.optim.Adam(gpt.parameters(), lr=0.01)
    resumed.load_state_dict(optimizer_state)
    step(packed, adam, batches[2])
    step(gpt, resumed, batches[2])
    for name, value in gpt.packed_state_dict().items():
        torch.testing.assert_close(value, packed.state_dict()[name], rtol=0, atol=1e-12, msg=name)
    assert gpt.upgrade_checkpoint(model_state, optimizer_state) == (model_state, optimizer_state), \
        "a checkpoint of this layout is left as it is"
    from hvdkit.models import TinyGPT

    tied = TinyGPT(32, 8, width=16, layers=2, heads=4, tie_output=True)
    with pytest.raises(ConfigError, match="^checkpoint: its head.weight has no place in this model's parameters$"):
        tied.upgrade_checkpoint(*saved)


def test_each_block_of_the_gpt_starts_with_its_own_weights_and_the_output_may_be_tied():
    from hvdkit.models import TinyGPT

    torch.manual_seed(0)
    gpt = TinyGPT(32, 8, width=16, layers=2, heads=4)
    assert not torch.equal(gpt.blocks[0].attention.q.weight, gpt.blocks[1].attention.q.weight)
    tied = TinyGPT(32, 8, width=16, layers=2, heads=4, tie_output=True)
    assert tied.head.weight is tied.tokens.weight
    assert sum(p.numel() for p in gpt.parameters()) - sum(p.numel() for p in tied.parameters()) == 32 * 16


def test_the_gpts_dropout_acts_in_training_only():
    from hvdkit.models import TinyGPT

    torch.manual_seed(0)
    gpt = TinyGPT(32, 8, width=16, layers=2, heads=4, dropout=0.5)
    tokens = torch.randint(0, 32, (2, 8))
    assert not torch.equal(gpt(tokens), gpt(tokens))
    gpt.eval()
    assert torch.equal(gpt(tokens), gpt(tokens))


def test_the_hugging_face_shaped_model_ties_its_output_and_is_causal():
    """The shape the sharded and model-parallel tests train (tests/reference_models.py): a later
    token changes no earlier logit, and the output projection is the embedding."""
    torch.manual_seed(0)
    model = CausalLM()
    tokens = torch.randint(0, 64, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "model.layers.1.self_attn.k_proj.weight" in dict(model.named_parameters())


@pytest.mark.slow
def test_a_checkpoint_of_the_packed_gpt_resumes_in_a_real_job(tmp_path):
    """Through the Session's resume (hvdkit.rank.resume.checkpoints, TinyGPT.upgrade_checkpoint),
    weights and momentum included: a third step from the earlier layout's checkpoint gives the
    earlier layout's third step, to fp32's rounding of the packed against the separate projections."""
    import re
    import sys

    from conftest import REPO, run
    from hvdkit.checks import selftest

    proc = run(["mpirun", "-np", "2", sys.executable, str(REPO / "tests" / "programs" / "gpt_resume.py"),
                str(tmp_path)], env=selftest.mpi_root_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(r"gpt resume: steps (\d+) (\d+), weights differ by (\S+)", proc.stdout)
    assert said and said.group(1) == said.group(2) == "3", proc.stdout[-2000:]
    assert float(said.group(3)) <= 1e-6, said.group(0)
