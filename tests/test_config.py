"""fsdp_guide.shard: fsdp_config dictionaries applied with FSDP2 and FSDP1 on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from training import train

from fsdp_guide import launch, shard
from fsdp_guide.config import DEFAULTS, validate
from fsdp_guide.precision import record_dtypes

APIS = ("fsdp2", "fsdp1")


class Blocks(nn.Module):
    """Three 280-parameter blocks (of two Linears below 200 each) and a 68-parameter head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16)) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Wrapped(nn.Module):
    """A trainer-style wrapper: the user's module is ``.model`` and carries the hooks."""

    def __init__(self, checkpoint_first_only=False):
        super().__init__()
        self.model = Blocks()
        self.model.fsdp_wrap_fn = lambda module: module is self.model.head
        if checkpoint_first_only:
            self.model.activation_checkpointing_fn = lambda module: module is self.model.blocks[0]

    def forward(self, x):
        return self.model(x)


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    # requires_grad: reentrant checkpointing only builds a graph from inputs that need one
    return [(torch.randn(8, 16, generator=g).requires_grad_(), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _losses(model, sharded):
    return train(model, torch.optim.SGD(model.parameters(), lr=0.2), _batches(), sharded=sharded)


def _local_fraction(model):
    """This rank's share of the parameters it stores (1.0: a full copy)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    full = sum(p.numel() for p in Blocks().parameters())
    fsdp1 = FSDP.fsdp_modules(model)
    if fsdp1:
        return sum(m._flat_param.numel() for m in fsdp1 if m._flat_param is not None) / full
    return sum(p.to_local().numel() for p in model.parameters()) / full


def _strategies(api, strategies, config):
    reference = _losses(Blocks(), sharded=False)
    results = {}
    for strategy in strategies:
        model = shard(
            Blocks(), {"sharding_strategy": strategy, "mixed_precision": "FULL", "min_params": 200, **config}, api=api
        )
        fraction = _local_fraction(model)
        losses = _losses(model, sharded=True)
        results[strategy] = (round(fraction, 3), max(abs(a - b) for a, b in zip(losses, reference)))
    return results


@pytest.mark.parametrize("api", APIS)
def test_each_strategy_trains_like_one_process_and_stores_what_it_should(api):
    results = launch(_strategies, api, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), {}, world_size=2, output="none")[0]
    fractions = {strategy: fraction for strategy, (fraction, _) in results.items()}
    assert fractions["NO_SHARD"] == 1.0
    assert 0.5 <= fractions["FULL_SHARD"] == fractions["SHARD_GRAD_OP"] <= 0.52  # half, plus FSDP1's padding
    assert all(error < 1e-6 for _, error in results.values()), results


def test_hybrid_shard_shards_within_groups_and_replicates_across_them():
    config = {"data_parallel_shard_degree": 2}
    both = launch(lambda: [_strategies(api, ("HYBRID_SHARD",), config) for api in APIS], world_size=4, output="none")
    for api_results in zip(*both):  # one API, every rank
        fractions = {r["HYBRID_SHARD"][0] for r in api_results}
        assert len(fractions) == 1 and 0.5 <= fractions.pop() <= 0.52  # 4 ranks, shards of 2
        assert all(r["HYBRID_SHARD"][1] < 1e-6 for r in api_results)


def _reshard_after_forward():
    from torch.distributed.tensor import DTensor

    seen = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        model = shard(Blocks(), {"sharding_strategy": strategy, "min_params": 200})
        model(torch.ones(2, 16))
        seen[strategy] = isinstance(model.blocks[0][0].weight, DTensor)
    return seen


def test_shard_grad_op_keeps_fsdp2_parameters_gathered_between_forward_and_backward():
    assert launch(_reshard_after_forward, output="none")[0] == {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def _dtypes(api, mixed_precision, precision):
    model = shard(Blocks(), {"mixed_precision": mixed_precision, "precision": precision, "min_params": 200}, api=api)
    forward = []
    # inside the unit, not the FSDP1 wrapper
    first_linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    first_linear.register_forward_pre_hook(lambda module, args: forward.append(module.weight.dtype))
    with record_dtypes() as dtypes:
        model(torch.ones(2, 16)).float().sum().backward()
    return str(forward[0]).removeprefix("torch."), dtypes.get("backward", "reduce-scatter")


def _all_dtypes(api):
    cases = [("FULL", "bf16"), ("DEFAULT", "bf16"), ("PURE", "fp16"), ({"param_dtype": "bf16"}, "fp32")]
    return [_dtypes(api, mp, precision) for mp, precision in cases]


@pytest.mark.parametrize("api", APIS)
def test_mixed_precision_presets_compute_and_reduce_in_composers_dtypes(api):
    # A dict without reduce_dtype follows torch's rule: reduce in param_dtype, except FSDP2
    # from torch 2.15 on, which reduces in the parameter's own dtype (its MixedPrecisionPolicy
    # docstring, "versionchanged:: 2.15").
    unset = "float32" if api == "fsdp2" and torch.__version__ >= (2, 15) else "bfloat16"
    assert launch(_all_dtypes, api, output="none")[0] == [
        ("float32", "float32"),  # FULL
        ("bfloat16", "float32"),  # DEFAULT: low-precision compute, fp32 gradient reduction
        ("float16", "float16"),  # PURE: both low
        ("bfloat16", unset),
    ]


def _activation_wrappers(api, config, checkpoint_first_only):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, OffloadWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = shard(Wrapped(checkpoint_first_only), {"min_params": 200, "mixed_precision": "FULL", **config}, api=api)
    layout = []
    for module in model.modules():
        if isinstance(module, (FSDP, FSDPModule)):  # what sits directly inside each unit
            inner = module._fsdp_wrapped_module if isinstance(module, FSDP) else module
            chain = []
            while isinstance(inner, ActivationWrapper):
                chain.append("offload" if isinstance(inner, OffloadWrapper) else inner.checkpoint_impl.name)
                inner = inner._checkpoint_wrapped_module
            layout.append((type(inner).__name__.removeprefix("FSDP"), chain))
        if isinstance(module, ActivationWrapper):  # never around a unit: only inside one
            assert not any(isinstance(m, (FSDP, FSDPModule)) for m in list(module.modules())[1:])
    reference = Wrapped()
    return layout, max(abs(a - b) for a, b in zip(_losses(model, True), _losses(reference, False)))


@pytest.mark.parametrize("api", APIS)
def test_activation_checkpointing_goes_inside_each_unit_and_training_is_unchanged(api):
    def run():
        return [
            _activation_wrappers(api, {"activation_checkpointing": True}, False),
            _activation_wrappers(
                api,
                {
                    "activation_checkpointing": True,
                    "activation_checkpointing_reentrant": True,
                    "activation_cpu_offload": True,
                },
                False,
            ),
            _activation_wrappers(api, {"activation_checkpointing": True}, True),
        ]

    (every, error1), (offloaded, error2), (first_only, error3) = launch(run, output="none")[0]
    root, blocks = ("Wrapped", []), [("Sequential", ["NO_REENTRANT"])] * 3
    # units in module order, the root first; fsdp_wrap_fn (found on .model) chose the head though it is below min_params
    assert every == [root, *blocks, ("Linear", ["NO_REENTRANT"])]
    assert offloaded == [root] + [("Sequential", ["offload", "REENTRANT"])] * 3 + [("Linear", ["offload", "REENTRANT"])]
    assert first_only == [
        root,
        ("Sequential", ["NO_REENTRANT"]),
        ("Sequential", []),
        ("Sequential", []),
        ("Linear", []),
    ]
    assert max(error1, error2, error3) < 1e-6


def _offloaded_fsdp2():
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = shard(Blocks(), {"cpu_offload": True, "min_params": 200, "mixed_precision": "FULL"})
    policy = model._get_fsdp_state()._fsdp_param_group.offload_policy
    return (
        type(policy).__name__,
        isinstance(policy, CPUOffloadPolicy),
        max(abs(a - b) for a, b in zip(_losses(model, True), _losses(Blocks(), False))),
    )


def test_cpu_offload_uses_fsdp2s_policy_and_trains_like_one_process():
    name, is_offload, error = launch(_offloaded_fsdp2, output="none")[0]
    assert name == "CPUOffloadPolicy" and is_offload and error < 1e-6


def _verbose(api):
    shard(Blocks(), {"verbose": True, "min_params": 200, "activation_checkpointing": True}, api=api)


@pytest.mark.parametrize("api", APIS)
def test_verbose_prints_the_plan_once_from_rank_0(api, capfd):
    launch(_verbose, api, output="all")
    out = capfd.readouterr().out
    assert "[rank1]" not in out and out.count("fsdp_config -> ") == 1
    assert "blocks.0                 Sequential              280  checkpoint" in out
    assert "(root)                   Blocks                   68" in out
    assert (
        "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)"
        if api == "fsdp2"
        else "MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32, buffer_dtype=bfloat16)"
    ) in out


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"sharding_stratgy": "FULL_SHARD"},
            "unknown fsdp_config key 'sharding_stratgy'; did you mean 'sharding_strategy'?",
        ),
        ({"zzz": 1}, "unknown fsdp_config key 'zzz'. Valid keys: sharding_strategy, min_params"),
        (
            {"sharding_strategy": "FULL_SHRAD"},
            "expected one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD; did you mean 'FULL_SHARD'?",
        ),
        ({"sharding_strategy": 3}, "fsdp_config['sharding_strategy'] = 3: expected one of FULL_SHARD"),
        ({"mixed_precision": "DEFALUT"}, "did you mean 'DEFAULT'?"),
        ({"mixed_precision": {"param_dtype": "bf61"}}, "fsdp_config['mixed_precision.param_dtype'] = 'bf61'"),
        ({"mixed_precision": {"param_type": "bf16"}}, "unknown key 'param_type'"),
        ({"min_params": "1e8"}, "fsdp_config['min_params'] = '1e8': expected a number of parameters >= 0"),
        ({"min_params": float("nan")}, "expected a number of parameters >= 0"),
        ({"cpu_offload": "yes"}, "fsdp_config['cpu_offload'] = 'yes': expected True or False"),
        ({"backward_prefetch": "BACKWARD_PRES"}, "did you mean 'BACKWARD_PRE'?"),
        ({"precision": "bfloat"}, "fsdp_config['precision'] = 'bfloat': expected one of auto, bf16, fp16, fp32"),
        ({"data_parallel_shard_degree": 0}, "expected a positive int"),
    ],
)
def test_bad_input_is_a_value_error_that_names_the_key_and_the_choices(config, message):
    with pytest.raises(ValueError) as err:
        validate(config)
    assert message in str(err.value)


def test_a_config_that_is_not_a_dict_is_a_value_error():
    with pytest.raises(ValueError, match="fsdp_config must be a dict, got list"):
        validate([("sharding_strategy", "FULL_SHARD")])


def _errors():
    def error(config, api="fsdp2", model=None):
        try:
            shard(model or Blocks(), config, api=api)
        except ValueError as err:
            return str(err)
        return "no error"

    class ReturnsDict(Blocks):
        def fsdp_wrap_fn(self, module):
            return {"reshard_after_forward": False}

    return {
        "degree": error({"sharding_strategy": "HYBRID_SHARD", "data_parallel_shard_degree": 3}),
        "prefetch": error({"backward_prefetch": "NONE"}),
        "buffer": error({"mixed_precision": {"buffer_dtype": "bf16"}}),
        "offload1": error({"cpu_offload": True}, api="fsdp1"),
        "wrap_fn": error({}, model=ReturnsDict()),
        "api": error({}, api="fsdp3"),
    }


def test_combinations_that_cannot_work_are_clear_value_errors():
    errors = launch(_errors, output="none")[0]
    assert "needs a world size divisible by it; it is 2" in errors["degree"]
    assert "backward_prefetch='NONE' cannot be honoured by FSDP2" in errors["prefetch"]
    assert "MixedPrecisionPolicy has no buffer dtype" in errors["buffer"]
    assert "cpu_offload=True with api='fsdp1' needs the ranks on an accelerator" in errors["offload1"]
    assert (
        "fsdp_wrap_fn(Linear) returned {'reshard_after_forward': False}: it must return True or False"
        in errors["wrap_fn"]
    )
    assert "api='fsdp3': expected 'fsdp2'" in errors["api"]


def test_hybrid_shard_on_one_rank_is_a_clear_error():
    def run():
        try:
            shard(Blocks(), {"sharding_strategy": "HYBRID_SHARD"})
        except ValueError as err:
            return str(err)

    assert (
        "HYBRID_SHARD shards within groups of ranks and replicates across them: it needs at least 2 ranks"
        in launch(run, world_size=1, output="none")[0]
    )


def test_shard_outside_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="inside fsdp_guide.launch or torchrun"):
        shard(Blocks(), {})


# Anything at all, for validate; for shard, mostly valid dictionaries with at most one bad value,
# so that the real sharding code runs for many combinations and every check is reached.
_ANY = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["FULL_SHRAD", "", "fp8", "bf16", "NONE", "DEFAULT"]),
    st.dictionaries(
        st.sampled_from(["param_dtype", "reduce_dtype", "buffer_dtype", "x"]),
        st.sampled_from(["bf16", "fp16", "fp32", None, "f16", 3]),
        max_size=3,
    ),
)
_CONFIGS = st.dictionaries(st.one_of(st.sampled_from(list(DEFAULTS)), st.text(max_size=12)), _ANY, max_size=6)
_VALID = {
    "sharding_strategy": ["FULL_SHARD", "shard_grad_op", "NO_SHARD", "HYBRID_SHARD"],
    "min_params": [0, 100, 1e8],
    "cpu_offload": [False, True],
    "mixed_precision": [
        "FULL",
        "DEFAULT",
        "pure",
        {"param_dtype": "bf16"},
        {"param_dtype": "fp16", "reduce_dtype": "fp32"},
    ],
    "precision": ["auto", "bf16", "fp16", "fp32"],
    "backward_prefetch": ["BACKWARD_PRE", "BACKWARD_POST", None],
    "activation_checkpointing": [False, True],
    "activation_checkpointing_reentrant": [False, True],
    "activation_cpu_offload": [False, True],
    "data_parallel_shard_degree": [-1, 1, 2],
    "verbose": [False, True],
}
_MOSTLY_VALID = st.fixed_dictionaries({}, optional={key: st.sampled_from(values) for key, values in _VALID.items()})
_SHARD_CONFIGS = st.one_of(
    _MOSTLY_VALID,
    st.tuples(_MOSTLY_VALID, st.sampled_from(list(DEFAULTS)), _ANY).map(lambda t: {**t[0], t[1]: t[2]}),
)


@settings(max_examples=300, deadline=None, database=None)
@given(_CONFIGS)
def test_validate_raises_nothing_but_value_error(config):
    try:
        validate(config)
    except ValueError:
        pass


def _shard_any_config(api):
    outcomes = {"sharded": 0, "ValueError": 0}

    # derandomize: both ranks draw the same dictionaries, so their collectives match.
    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(_SHARD_CONFIGS)
    def check(config):
        try:
            model = shard(Blocks(), config, api=api)
        except ValueError:
            outcomes["ValueError"] += 1
            return
        x = torch.ones(2, 16, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
        model(x).float().sum().backward()  # and it trains

        outcomes["sharded"] += 1

    check()
    return outcomes


@pytest.mark.parametrize("api", APIS)
def test_shard_raises_nothing_but_value_error_for_any_dictionary(api):
    outcomes = launch(_shard_any_config, api, output="none", timeout=600)[0]
    assert outcomes["sharded"] >= 5 and outcomes["ValueError"] >= 5, outcomes  # both paths were exercised


class WithBuffer(Blocks):
    def __init__(self):
        super().__init__()
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, x):
        return super().forward(x) / self.temperature


def _buffer_dtype_in_forward(api):
    model = shard(WithBuffer(), {"mixed_precision": "DEFAULT", "precision": "bf16", "min_params": 200}, api=api)
    seen = []
    inner = model.module if api == "fsdp1" else model
    inner.head.register_forward_pre_hook(lambda module, args: seen.append(inner.temperature.dtype))
    model(torch.ones(2, 16))
    return str(seen[0])


def test_fsdp1_casts_buffers_to_the_preset_dtype_and_fsdp2_keeps_them():
    # FSDP2's MixedPrecisionPolicy has no buffer dtype
    assert launch(lambda: [_buffer_dtype_in_forward(api) for api in APIS], output="none")[0] == [
        "torch.float32",
        "torch.bfloat16",
    ]


def _model_after_a_refused_config():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    model = Blocks()
    before = [name for name, _ in model.named_modules()]
    try:
        shard(model, {"backward_prefetch": "NONE", "activation_checkpointing": True, "min_params": 200})
    except ValueError:
        pass
    return before == [name for name, _ in model.named_modules()] and not any(
        isinstance(m, ActivationWrapper) for m in model.modules()
    )


def test_a_refused_config_leaves_the_model_untouched():
    assert launch(_model_after_a_refused_config, output="none")[0] is True


def _checkpoint_around_units():
    class ChecksTheWholeStack(Blocks):
        def activation_checkpointing_fn(self, module):
            return module is self.blocks  # a ModuleList holding three units

    try:
        shard(ChecksTheWholeStack(), {"activation_checkpointing": True, "min_params": 200})
    except ValueError as err:
        return str(err)


def test_checkpointing_a_module_that_contains_units_is_refused():
    message = launch(_checkpoint_around_units, output="none")[0]
    assert "activation_checkpointing_fn chose 'blocks', which contains FSDP units" in message


def _replicas_after_shard(sync):
    """Each rank seeded differently (as nanoGPT seeds per rank), then sharded with every strategy and API."""
    import hashlib

    import torch.distributed as dist

    from fsdp_guide import summon_full_params

    results = {}
    for api in ("fsdp2", "fsdp1"):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
            torch.manual_seed(1000 + dist.get_rank())
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
            rank0_init = [p.detach().clone() for p in model.parameters()]
            dist.broadcast_object_list(rank0_init, src=0)
            config = {
                "sharding_strategy": strategy,
                "min_params": 50,
                "mixed_precision": "FULL",
                "data_parallel_shard_degree": 2,
                "sync_module_states": sync,
            }
            sharded = shard(model, config, api=api)
            local = b"".join(
                p.detach().to_local().numpy().tobytes() if hasattr(p, "to_local") else p.detach().numpy().tobytes()
                for p in sharded.parameters()
            )
            with summon_full_params(sharded, writeback=False):
                full = [p.detach().clone() for p in sharded.parameters()]
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, hashlib.sha256(local).hexdigest())
            results[(api, strategy)] = (all(torch.equal(a, b) for a, b in zip(full, rank0_init)), len(set(digests)))
    return results


def test_every_strategy_starts_from_rank_0s_weights_however_each_rank_was_seeded():
    for results in launch(_replicas_after_shard, True, world_size=4, output="none", timeout=300):
        for (api, strategy), (equals_rank_0, distinct_shards) in results.items():
            assert equals_rank_0, (api, strategy)
            replicas = {"FULL_SHARD": 4, "SHARD_GRAD_OP": 4, "NO_SHARD": 1, "HYBRID_SHARD": 2}[strategy]
            assert distinct_shards == replicas, (api, strategy)  # replicas hold the same bytes


def test_without_sync_module_states_replicas_keep_their_own_seeds():
    rank_1 = launch(_replicas_after_shard, False, world_size=4, output="none", timeout=300)[1]
    assert rank_1[("fsdp2", "NO_SHARD")] == (False, 4) and rank_1[("fsdp1", "NO_SHARD")] == (False, 4)
