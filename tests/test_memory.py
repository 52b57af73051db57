"""fsdp_guide.memory: the ZeRO paper's figures, and estimates checked against live tensors on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_guide import launch, shard
from fsdp_guide.memory import estimate, measure

PSI = 7.5e9  # the ZeRO paper's Figure 1: 7.5B parameters, 64 devices, fp16, mixed-precision Adam (K = 12)


@pytest.mark.parametrize(
    "strategy, params, grads, optimizer",
    [
        ("DDP", 2 * PSI, 2 * PSI, 12 * PSI),  # baseline: (2 + 2 + K) psi = 120 GB
        ("NO_SHARD", 2 * PSI, 2 * PSI, 12 * PSI),
        ("SHARD_GRAD_OP", 2 * PSI, 2 * PSI / 64, 12 * PSI / 64),  # P_os+g: 2 psi + (2 + K) psi / Nd = 16.6 GB
        ("FULL_SHARD", 2 * PSI / 64, 2 * PSI / 64, 12 * PSI / 64),  # P_os+g+p: (2 + 2 + K) psi / Nd = 1.9 GB
    ],
)
def test_estimate_reproduces_the_zero_papers_figure_1(strategy, params, grads, optimizer):
    m = estimate(PSI, 64, strategy, param_dtype=torch.float16, optimizer="adam", master_weights=True)
    assert (m.params, m.grads, m.optimizer) == (params, grads, optimizer)
    assert (
        round(m.total / 1e9, 1) == {"DDP": 120.0, "NO_SHARD": 120.0, "SHARD_GRAD_OP": 16.6, "FULL_SHARD": 1.9}[strategy]
    )


def test_estimate_counts_dtypes_and_optimizers():
    fp32_adam = estimate(1000, 1, "DDP")
    assert (fp32_adam.params, fp32_adam.grads, fp32_adam.optimizer) == (4000, 4000, 8000)
    bf16_sgd = estimate(1000, 4, "FULL_SHARD", param_dtype=torch.bfloat16, grad_dtype=torch.float32, optimizer="sgd")
    assert (bf16_sgd.params, bf16_sgd.grads, bf16_sgd.optimizer) == (500, 1000, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_params=-1, world_size=2, strategy="DDP"), "num_params=-1: expected a number of parameters >= 0"),
        (dict(num_params=10, world_size=0, strategy="DDP"), "world_size=0: expected a positive int"),
        (dict(num_params=10, world_size=2, strategy="ZERO3"), "strategy='ZERO3': expected one of DDP, NO_SHARD"),
        (dict(num_params=10, world_size=2, strategy="DDP", optimizer="lion"), "optimizer='lion': expected one of adam"),
        (
            dict(num_params=10, world_size=2, strategy="DDP", param_dtype="bf16"),
            "param_dtype='bf16': expected a torch dtype",
        ),
    ],
)
def test_estimate_rejects_bad_input_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate(**kwargs)


def test_measure_counts_a_tied_parameter_once():
    embedding = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight
    assert measure(nn.ModuleList([embedding, head])).params == 100 * 16 * 4


def test_measure_counts_an_optimizers_own_master_copies_and_not_the_models_parameters():
    model = nn.Linear(100, 10, bias=False).half()
    masters = [p.detach().float().clone() for p in model.parameters()]  # what a master-weight optimizer steps
    optimizer = torch.optim.Adam(masters)
    masters[0].grad = torch.ones_like(masters[0])
    optimizer.step()
    got, expected = measure(model, optimizer), estimate(1000, 1, "DDP", param_dtype=torch.float16, master_weights=True)
    assert (got.params, got.optimizer) == (expected.params, expected.optimizer) == (1000 * 2, 1000 * (4 + 4 + 4))
    plain = torch.optim.Adam(model.float().parameters())
    model(torch.ones(1, 100)).sum().backward()
    plain.step()
    assert measure(model, plain).optimizer == 1000 * (4 + 4)  # the model's parameters are not optimizer state


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)), nn.Linear(64, 10))


def _measured_over_estimated():
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, world = sum(p.numel() for p in _model().parameters()), dist.get_world_size()
    ratios = {}
    for strategy in ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
        for api in ("ddp",) if strategy == "DDP" else ("fsdp2", "fsdp1"):
            config = {"sharding_strategy": strategy, "min_params": 1000, "mixed_precision": "FULL"}
            model = DDP(_model()) if api == "ddp" else shard(_model(), config, api=api)
            optimizer = torch.optim.Adam(model.parameters())
            x = torch.randn(4, 64)
            model(x).sum().backward()
            optimizer.step()
            predicted = estimate(n, world, strategy)
            at_rest = measure(model, optimizer)
            ratios[(strategy, api)] = [
                at_rest.params / predicted.params,
                at_rest.grads / predicted.grads,
                at_rest.optimizer / predicted.optimizer,
            ]
            if strategy == "SHARD_GRAD_OP":  # its full parameters exist from forward to backward
                optimizer.zero_grad()
                model(x)
                ratios[(strategy + " in step", api)] = [measure(model, optimizer).params / predicted.params]
    return ratios


@pytest.mark.parametrize("world_size", [2, 4])
def test_measure_matches_estimate_up_to_padding_on_real_ranks(world_size):
    ratios = launch(_measured_over_estimated, world_size=world_size, output="none")[0]
    for (strategy, api), values in ratios.items():
        if strategy == "SHARD_GRAD_OP":  # at rest FSDP keeps only shards: params are 1/N, like FULL_SHARD
            expected = [1 / world_size, 1, 1]
        elif strategy == "SHARD_GRAD_OP in step":  # the gathered parameters, and FSDP's shard beside them
            expected = [1 + 1 / world_size]
        else:
            expected = [1, 1, 1]
        for value, want in zip(values, expected):
            assert want <= value <= want * 1.01, (strategy, api, values)  # padding only adds, and little


def _saved_around_an_fsdp2_forward():
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.memory import saved_for_backward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)  # the root: the layers below it reshard after forward
    with saved_for_backward() as saved:
        loss = model(torch.ones(8, 64)).sum()
    loss.backward()  # the freed weights are gathered again for it
    return saved.nbytes, saved.held_at_exit


def test_saved_for_backward_tells_the_weights_fsdp_frees_after_forward_from_what_stays():
    for nbytes, held in launch(_saved_around_an_fsdp2_forward, world_size=2, output="none"):
        weights = 64 * 64 * 4  # the second layer's gathered weight (the first's input needs no gradient)
        activations = 2 * 8 * 64 * 4  # the input, and the ReLU's output (the second matmul's input)
        assert (nbytes, held) == (weights + activations, activations)


def _grads_held_while_accumulating(skip):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    # bf16 compute reduced in fp32: FSDP2 moves the gradients to fp32 buffers of its own while sync is off
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if "bf16" in skip else None
    if skip == "all-reduce":  # HSDP: 2 replicas
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    held = []
    for last in (False, False, True):  # two micro-batches accumulated, then the whole reduction
        if skip.startswith("gradient sync"):
            model.set_requires_gradient_sync(last)
        else:
            model.set_requires_all_reduce(last)
        model(torch.ones(8, 64)).sum().backward()
        held.append(measure(model).grads)
    return held


@pytest.mark.parametrize("skip, world_size", [("gradient sync", 2), ("gradient sync, bf16", 2), ("all-reduce", 4)])
def test_measure_counts_the_gradients_fsdp2_accumulates_outside_grad(skip, world_size):
    full = 2 * 64 * 64 * 4  # fp32 bytes of both weights
    for held in launch(_grads_held_while_accumulating, skip, world_size=world_size, output="none"):
        if skip.startswith("gradient sync"):  # whole fp32 gradients while sync is off, then this rank's shards
            assert held == [full, full, full // 2]
        else:  # HSDP on 2 x 2: the reduce-scattered shards summed until the all-reduce, then .grad
            assert held == [full // 2, full // 2, full // 2]
