"""fsdp_guide.summon_full_params on real 2-rank gloo groups: FSDP2/DTensor, FSDP1 and plain modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from training import my_slice, train

from fsdp_guide import launch, summon_full_params


def _run(fn, *args):
    return launch(fn, *args, world_size=2, output="none")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _fsdp2(model):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _fsdp1(model):
    return FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"), use_orig_params=True
    )


def _batch(step, n=8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _custom_init(model):
    """A deterministic per-layer init: weight[i, j] = (i - j) / (depth + 1), bias = depth."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for depth, layer in enumerate(linears):
            rows, cols = layer.weight.shape
            i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
            layer.weight.copy_((i - j).float() / (depth + 1))
            layer.bias.fill_(float(depth))


def _train(model, steps, sharded):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train(model, optimizer, (_batch(step) for step in range(steps)), sharded=sharded)


def _single_process_losses(steps=5):
    model = _mlp()
    _custom_init(model)
    return _train(model, steps, sharded=False)


# ---- FSDP2 / DTensor --------------------------------------------------------------------


def _writeback_survives_training(writeback):
    model = _fsdp2(_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the context
    x, y = _batch(100)
    F.mse_loss(model(my_slice(x)), my_slice(y)).backward()  # a forward (lazy init) already ran
    optimizer.zero_grad()
    before = {name: id(p) for name, p in model.named_parameters()}
    before_local = {name: p.to_local().clone() for name, p in model.named_parameters()}

    with summon_full_params(model, writeback=writeback):
        inside = {name: (type(p).__name__, tuple(p.shape)) for name, p in model.named_parameters()}
        _custom_init(model)

    after = {name: id(p) for name, p in model.named_parameters()}
    same_objects_in_optimizer = all(
        any(q is p for q in optimizer.param_groups[0]["params"]) for p in model.parameters()
    )
    unchanged = all(torch.equal(before_local[n], p.to_local()) for n, p in model.named_parameters())
    # Train on: the optimizer built before the context must update the edited weights.
    losses = train(model, optimizer, (_batch(step) for step in range(5)), sharded=True)
    return {
        "inside": inside,
        "same_ids": before == after,
        "in_optimizer": same_objects_in_optimizer,
        "unchanged": unchanged,
        "losses": losses,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def test_fsdp2_writeback_survives_forward_backward_and_the_optimizer_step():
    results = _run(_writeback_survives_training, True)
    expected = _single_process_losses()
    for r in results:
        assert r["inside"]["0.weight"] == ("Parameter", (8, 6)) and r["inside"]["2.bias"] == ("Parameter", (3,))
        assert r["same_ids"] and r["in_optimizer"] and r["all_dtensor"] and not r["unchanged"]
        assert max(abs(a - b) for a, b in zip(r["losses"], expected, strict=True)) < 1e-5


def test_fsdp2_without_writeback_the_shards_are_untouched():
    for r in _run(_writeback_survives_training, False):
        assert r["inside"]["0.weight"] == ("Parameter", (8, 6))
        assert r["unchanged"] and r["same_ids"] and r["all_dtensor"]


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.emb(tokens))))


def _tied_weights():
    model = fully_shard(_TiedLM())
    with summon_full_params(model):
        tied_inside = model.head.weight is model.emb.weight
        shape_inside = tuple(model.emb.weight.shape)
        with torch.no_grad():
            model.head.weight.copy_(torch.arange(40.0).reshape(10, 4))  # edit through one name
        seen_through_other = model.emb.weight[9, 3].item()
    tied_after = model.head.weight is model.emb.weight and isinstance(model.emb.weight, DTensor)
    full_after = model.emb.weight.full_tensor()
    logits = model(torch.tensor([[1, 2, 3]]))
    return {
        "tied_inside": tied_inside,
        "shape": shape_inside,
        "other": seen_through_other,
        "tied_after": tied_after,
        "full_ok": torch.equal(full_after, torch.arange(40.0).reshape(10, 4)),
        "logits_shape": tuple(logits.shape),
    }


def test_tied_weights_stay_tied_inside_and_after():
    for r in _run(_tied_weights):
        assert r == {
            "tied_inside": True,
            "shape": (10, 4),
            "other": 39.0,
            "tied_after": True,
            "full_ok": True,
            "logits_shape": (1, 3, 10),
        }


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 2)

    def forward(self, x):
        return self.outer(self.inner(x))


def _nested_recurse(recurse):
    model = _Nested()
    fully_shard(model.inner)
    fully_shard(model)
    with summon_full_params(model, recurse=recurse):
        kinds = {name: type(p).__name__ for name, p in model.named_parameters()}
    return kinds


def test_nested_units_and_recurse_false():
    full = {
        "inner.weight": "Parameter",
        "inner.bias": "Parameter",
        "outer.weight": "Parameter",
        "outer.bias": "Parameter",
    }
    assert _run(_nested_recurse, True) == [full, full]
    own_only = {
        "inner.weight": "DTensor",
        "inner.bias": "DTensor",
        "outer.weight": "Parameter",
        "outer.bias": "Parameter",
    }
    assert _run(_nested_recurse, False) == [own_only, own_only]


def _full_grads():
    model = _fsdp2(_mlp())
    x, y = _batch(0)
    F.mse_loss(model(my_slice(x)), my_slice(y)).backward()
    with summon_full_params(model, with_grads=True):
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        for p in model.parameters():
            p.grad.mul_(2)  # written back with the parameters
    doubled = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {name: (grads[name].tolist(), torch.allclose(doubled[name], 2 * grads[name])) for name in grads}


def test_with_grads_shows_the_full_averaged_gradient_and_writes_it_back():
    model = _mlp()
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()  # one process, the whole batch
    for r in _run(_full_grads):
        for name, p in model.named_parameters():
            grad, written_back = r[name]
            assert torch.allclose(torch.tensor(grad), p.grad, atol=1e-6) and written_back


def _exception_inside():
    model = _fsdp2(_mlp())
    originals = [id(p) for p in model.parameters()]
    try:
        with summon_full_params(model):
            with torch.no_grad():
                model[0].bias.fill_(7.0)
            raise KeyError("inside the block")
    except KeyError as exc:
        raised = str(exc)
    restored = [id(p) for p in model.parameters()] == originals
    return raised, restored, model[0].bias.full_tensor().tolist()


def test_an_exception_inside_restores_the_sharded_parameters():
    for raised, restored, bias in _run(_exception_inside):
        assert raised == "'inside the block'" and restored
        assert bias == [7.0] * 8  # written back on the way out, as FSDP1 does


def _rank0_only():
    model = _fsdp2(_mlp())
    with summon_full_params(model, rank0_only=True, writeback=False):
        return type(model[0].weight).__name__, tuple(model[0].weight.shape)


def test_rank0_only_gives_full_parameters_to_rank_0_alone():
    assert _run(_rank0_only) == [("Parameter", (8, 6)), ("DTensor", (8, 6))]


def _offload():
    model = _fsdp2(_mlp())
    with summon_full_params(model, offload_to_cpu=True):
        device = model[0].weight.device.type
        with torch.no_grad():
            model[0].weight.zero_()
    return device, model[0].weight.full_tensor().abs().sum().item()


def test_offload_to_cpu():
    assert _run(_offload) == [("cpu", 0.0), ("cpu", 0.0)]


# ---- FSDP1 and FSDP2 give the same result ----------------------------------------------


def _custom_init_then_train(api):
    model = _fsdp2(_mlp()) if api == "fsdp2" else _fsdp1(_mlp())
    with summon_full_params(model):
        _custom_init(model)
    return _train(model, 5, sharded=True)


def test_fsdp1_and_fsdp2_match_single_process_after_custom_init():
    expected = _single_process_losses()
    fsdp2 = _run(_custom_init_then_train, "fsdp2")[0]
    fsdp1 = _run(_custom_init_then_train, "fsdp1")[0]
    assert max(abs(a - b) for a, b in zip(fsdp2, expected, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(fsdp1, expected, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(fsdp1, fsdp2, strict=True)) < 1e-5


# ---- plain modules and bad input --------------------------------------------------------


def test_a_plain_module_is_left_alone():
    model = _mlp()
    weight = model[0].weight
    with summon_full_params(model):
        assert model[0].weight is weight
    assert model[0].weight is weight


def _mixed():
    model = nn.Sequential(_fsdp1(nn.Linear(4, 4)), fully_shard(nn.Linear(4, 4)))
    try:
        with summon_full_params(model):
            pass
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mixing_fsdp1_and_dtensor_parameters_is_refused():
    for message in _run(_mixed):
        assert "mixes FSDP1 FullyShardedDataParallel instances with DTensor (FSDP2) parameters" in message


def test_rank0_only_with_writeback_is_refused():
    with pytest.raises(ValueError, match="rank0_only=True needs writeback=False"):
        with summon_full_params(_mlp(), rank0_only=True):
            pass
