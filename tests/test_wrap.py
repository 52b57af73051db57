"""fsdp_guide.auto_wrap chooses the same FSDP units as FSDP1's auto_wrap_policy, and trains the same."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy
from training import train

from fsdp_guide import auto_wrap, launch


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


class Tiny(nn.Module):
    def __init__(self, dim=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


POLICIES = {
    "blocks": lambda: ModuleWrapPolicy({Block}),
    "linears": lambda: ModuleWrapPolicy({nn.Linear}),
    "size>=300": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=300),
    "custom": lambda: CustomPolicy(lambda m: isinstance(m, nn.Sequential)),
}


def _units(policy_name):
    fsdp1 = FSDP(Tiny(), auto_wrap_policy=POLICIES[policy_name](), device_id=torch.device("cpu"))
    fsdp1_units = sorted(
        n.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for n, m in fsdp1.named_modules()
        if isinstance(m, FSDP)
    )
    fsdp2 = auto_wrap(Tiny(), POLICIES[policy_name]())
    fsdp2_units = sorted(n for n, m in fsdp2.named_modules() if isinstance(m, FSDPModule))
    return fsdp1_units, fsdp2_units


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_auto_wrap_chooses_the_units_fsdp1_chooses(policy_name):
    fsdp1_units, fsdp2_units = launch(_units, policy_name, world_size=2, output="none")[0]
    assert fsdp2_units == fsdp1_units
    assert "" in fsdp2_units and len(fsdp2_units) > 1  # the root, and at least one nested unit


def _batches(steps=4):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        yield torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _train_losses(sharded):
    model = Tiny()
    if sharded:
        auto_wrap(model, ModuleWrapPolicy({Block}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train(model, optimizer, _batches(), sharded=sharded)


def test_auto_wrapped_model_trains_like_one_process():
    sharded = launch(_train_losses, True, world_size=2, output="none")[0]
    single = _train_losses(False)
    assert max(abs(a - b) for a, b in zip(sharded, single, strict=True)) < 1e-5


def _forward_dtypes():
    model = auto_wrap(Tiny(), ModuleWrapPolicy({Block}), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = str(module.weight.dtype)

        return hook

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(record(name))
    model(torch.randn(2, 4))
    return seen


def test_fully_shard_kwargs_reach_every_unit():
    seen = launch(_forward_dtypes, world_size=2, output="none")[0]
    assert seen and set(seen.values()) == {"torch.bfloat16"}, seen


def test_a_policy_that_is_not_a_policy_is_refused():
    with pytest.raises(TypeError, match="policy must be a torch wrap policy"):
        auto_wrap(Tiny(), {nn.Linear})


def _tied_gpt_training(how, steps=3):
    """A GPT whose embedding and output layer share one weight, with 65 rows (2 ranks hold 33 and 32)."""
    import torch.distributed as dist

    from fsdp_guide import shard
    from fsdp_guide.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=16))
    model.init_weights()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=500)  # chooses the embedding and head
    if how == "auto_wrap":
        auto_wrap(model, policy)
    elif how == "shard":
        shard(model, {"min_params": 500, "mixed_precision": "FULL"})  # fp32, as one process trains
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world, rank = (dist.get_world_size(), dist.get_rank()) if how != "one process" else (1, 0)
    losses = []
    for step in range(steps):
        tokens = torch.randint(65, (2 * 2, 9), generator=torch.Generator().manual_seed(step))
        mine = tokens.chunk(world)[rank]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return units, losses


@pytest.mark.parametrize("how", ["auto_wrap", "shard"])
def test_a_tied_embedding_and_head_stay_in_one_unit_and_train_like_one_process(how):
    # The policy chooses the embedding and the head, each alone; they share a weight, so
    # neither becomes a unit (torch 2.13 would refuse at the first forward), and the root holds both.
    units, sharded = launch(_tied_gpt_training, how, world_size=2, output="none")[0]
    assert 65 * 16 >= 500  # the size the policy asks for: alone, the embedding and the head would be units
    assert "" in units and len(units) > 1 and not {"tok_emb", "lm_head"} & set(units), units
    _, single = _tied_gpt_training("one process")
    assert max(abs(a - b) for a, b in zip(sharded, single, strict=True)) < 1e-5


class _TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight of 41 rows: 2 ranks hold 21 and 20."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body, self.head = nn.Embedding(41, 16), nn.Linear(16, 16), nn.Linear(16, 41, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


def _tied_lm_training(units, steps=3):
    """Three SGD steps; whether the weight is still shared, and the embedding's weight after them."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    model = _TiedLM()
    if units == "separate":
        fully_shard(model.emb), fully_shard(model.head)
    elif units == "one":
        fully_shard([model.emb, model.head])  # the fix: one unit for both users of the weight
    if units != "one process":
        fully_shard(model)
    world, rank = (dist.get_world_size(), dist.get_rank()) if units != "one process" else (1, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        ids = torch.randint(0, 41, (4, 8), generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 41), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model.emb.weight
    return model.head.weight is weight, (weight.full_tensor() if isinstance(weight, dt.DTensor) else weight.detach())


def test_tied_weights_in_separate_units_are_refused_on_2_13_and_later_and_silently_untied_before():
    from fsdp_guide import LaunchError

    _, alone = _tied_lm_training("one process")
    if torch.__version__ >= (2, 13):
        with pytest.raises(LaunchError, match="already managed by another FSDP group"):
            launch(_tied_lm_training, "separate", world_size=2, output="none")
    else:  # torch 2.9.1, the oldest supported: no error, two weights trained apart
        tied, weight = launch(_tied_lm_training, "separate", world_size=2, output="none")[0]
        assert not tied and (weight - alone).abs().max() > 1e-2
    tied, weight = launch(_tied_lm_training, "one", world_size=2, output="none")[0]
    assert tied and (weight - alone).abs().max() < 1e-5  # every row of the uneven shards updated as one process
