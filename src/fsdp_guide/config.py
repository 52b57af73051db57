"""``shard``: apply a trainer-style ``fsdp_config`` dictionary with FSDP1 or FSDP2.

Trainer libraries (MosaicML Composer first) configure FSDP with a flat
dictionary of strings and numbers. ``shard`` reads the same dictionary and
returns the model sharded either by ``FullyShardedDataParallel`` (FSDP1) or by
``fully_shard`` (FSDP2). A setting FSDP2 has no equivalent for is a ``ValueError``
when asked for explicitly (``backward_prefetch="NONE"``, a ``buffer_dtype``); where
FSDP2 does something close instead (``BACKWARD_POST`` prefetching, the presets'
buffer dtype), the ``verbose`` plan and the reference table say what.

Two functions, so the checks can run without a process group:
``validate`` normalises the dictionary (every mistake is a ``ValueError``
naming the key, the valid choices and the closest one), ``shard`` applies it.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_guide.devices import device

__all__ = ["shard", "validate", "FsdpConfig", "MIXED_PRECISION_PRESETS"]

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NONE")
_PRESETS = ("FULL", "DEFAULT", "PURE")
_PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_APIS = ("fsdp2", "fsdp1")
_DTYPES = {  # the spellings Composer accepts (composer/distributed/mosaic_parallelism.py)
    torch.float32: ("fp32", "float32", "torch.float32"),
    torch.float16: ("fp16", "float16", "half", "torch.float16"),
    torch.bfloat16: ("bf16", "bfloat16", "torch.bfloat16"),
}
_DTYPE_NAMES = {name: dtype for dtype, names in _DTYPES.items() for name in names}
_MP_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")

# Composer's meaning of the three names, with LOW the dtype ``precision`` picks;
# None means "keep the parameter's own dtype" (fp32 for an fp32 model).
MIXED_PRECISION_PRESETS = {
    "FULL": {"param_dtype": None, "reduce_dtype": None, "buffer_dtype": None},
    "DEFAULT": {"param_dtype": "LOW", "reduce_dtype": torch.float32, "buffer_dtype": "LOW"},
    "PURE": {"param_dtype": "LOW", "reduce_dtype": "LOW", "buffer_dtype": "LOW"},
}

DEFAULTS: dict[str, Any] = {
    "sharding_strategy": "FULL_SHARD",
    "min_params": 1e8,
    "cpu_offload": False,
    "mixed_precision": "DEFAULT",
    "precision": "auto",
    "backward_prefetch": "BACKWARD_POST",
    "activation_checkpointing": False,
    "activation_checkpointing_reentrant": False,
    "activation_cpu_offload": False,
    "data_parallel_shard_degree": -1,
    "sync_module_states": True,
    "verbose": False,
}


@dataclass(frozen=True)
class FsdpConfig:
    """A validated ``fsdp_config``: every key present, every value canonical."""

    sharding_strategy: str
    min_params: int
    cpu_offload: bool
    mixed_precision: dict  # param_dtype / reduce_dtype / buffer_dtype -> torch.dtype or None
    mixed_precision_name: str  # FULL, DEFAULT, PURE, or "custom" for a dict
    precision: torch.dtype  # the low-precision dtype DEFAULT and PURE use
    backward_prefetch: str
    activation_checkpointing: bool
    activation_checkpointing_reentrant: bool
    activation_cpu_offload: bool
    data_parallel_shard_degree: int
    sync_module_states: bool
    verbose: bool


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"fsdp_config[{key!r}] = {value!r}: expected {expected}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices`` (case-insensitive), or a ValueError suggesting the closest."""
    if hasattr(value, "name") and not isinstance(value, str):  # a torch enum such as ShardingStrategy.FULL_SHARD
        value = value.name
    if not isinstance(value, str):
        raise _bad(key, value, f"one of {', '.join(choices)} (a string)")
    by_upper = {c.upper(): c for c in choices}
    if value.upper() in by_upper:
        return by_upper[value.upper()]
    close = difflib.get_close_matches(value.upper(), list(by_upper), n=1, cutoff=0.5)
    hint = f"; did you mean {by_upper[close[0]]!r}?" if close else ""
    raise _bad(key, value, f"one of {', '.join(choices)}{hint}")


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "True or False")
    return value


def _dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in _DTYPES:
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    close = difflib.get_close_matches(str(value).lower(), list(_DTYPE_NAMES), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise _bad(key, value, f"None, a torch dtype or one of {', '.join(_DTYPE_NAMES)}{hint}")


def _low_precision(value: Any) -> torch.dtype:
    """``precision``: 'auto' is :func:`~fsdp_guide.precision.low_precision_dtype`.

    That is bf16 on any CPU and on CUDA from compute capability 8, else fp16."""
    from fsdp_guide.precision import low_precision_dtype

    choice = _choice("precision", value, _PRECISIONS)
    return low_precision_dtype() if choice == "auto" else _DTYPE_NAMES[choice]


def _mixed_precision(value: Any, low: torch.dtype) -> dict:
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in _MP_KEYS]
        if unknown:
            raise _bad(
                "mixed_precision", value, f"a dict with keys among {', '.join(_MP_KEYS)}; unknown key {unknown[0]!r}"
            )
        return {k: _dtype(f"mixed_precision.{k}", value.get(k)) for k in _MP_KEYS}
    preset = MIXED_PRECISION_PRESETS[_choice("mixed_precision", value, _PRESETS)]
    return {k: low if dtype == "LOW" else dtype for k, dtype in preset.items()}


def _min_params(value: Any) -> int:
    # isfinite only on floats: math.isfinite(10**400) raises OverflowError
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or isinstance(value, float)
        and not math.isfinite(value)
        or value < 0
    ):
        raise _bad("min_params", value, "a number of parameters >= 0, such as 1e8")
    return int(value)


def _shard_degree(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
        raise _bad(
            "data_parallel_shard_degree", value, "a positive int (ranks per shard group), or -1 for the ranks per node"
        )
    return value


def validate(fsdp_config: Mapping[str, Any]) -> FsdpConfig:
    """Check ``fsdp_config`` and fill in the defaults; every mistake is a ``ValueError``.

    Example:

    >>> from fsdp_guide.config import validate
    >>> validate({"sharding_strategy": "shard_grad_op", "mixed_precision": "PURE", "precision": "fp16"}).mixed_precision
    {'param_dtype': torch.float16, 'reduce_dtype': torch.float16, 'buffer_dtype': torch.float16}
    >>> validate({"sharding_stratgy": "FULL_SHARD"})
    Traceback (most recent call last):
    ...
    ValueError: unknown fsdp_config key 'sharding_stratgy'; did you mean 'sharding_strategy'? Valid keys: ...
    """
    if not isinstance(fsdp_config, Mapping):
        raise ValueError(f"fsdp_config must be a dict, got {type(fsdp_config).__name__}")
    for key in fsdp_config:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), list(DEFAULTS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(f"unknown fsdp_config key {key!r}{hint} Valid keys: {', '.join(DEFAULTS)}")
    c = {**DEFAULTS, **fsdp_config}
    low = _low_precision(c["precision"])
    return FsdpConfig(
        sharding_strategy=_choice("sharding_strategy", c["sharding_strategy"], _STRATEGIES),
        min_params=_min_params(c["min_params"]),
        cpu_offload=_flag("cpu_offload", c["cpu_offload"]),
        mixed_precision=_mixed_precision(c["mixed_precision"], low),
        mixed_precision_name="custom"
        if isinstance(c["mixed_precision"], Mapping)
        else _choice("mixed_precision", c["mixed_precision"], _PRESETS),
        precision=low,
        backward_prefetch=_choice(
            "backward_prefetch", "NONE" if c["backward_prefetch"] is None else c["backward_prefetch"], _PREFETCH
        ),
        activation_checkpointing=_flag("activation_checkpointing", c["activation_checkpointing"]),
        activation_checkpointing_reentrant=_flag(
            "activation_checkpointing_reentrant", c["activation_checkpointing_reentrant"]
        ),
        activation_cpu_offload=_flag("activation_cpu_offload", c["activation_cpu_offload"]),
        data_parallel_shard_degree=_shard_degree(c["data_parallel_shard_degree"]),
        sync_module_states=_flag("sync_module_states", c["sync_module_states"]),
        verbose=_flag("verbose", c["verbose"]),
    )


def shard(model: nn.Module, fsdp_config: Mapping[str, Any], *, api: str = "fsdp2") -> nn.Module:
    """Shard ``model`` as ``fsdp_config`` says, with FSDP2 (``fully_shard``) or FSDP1; returns it ready to train.

    Units: every submodule for which the model's ``fsdp_wrap_fn(module)`` is True,
    or whose parameters not yet in a unit number at least ``min_params``; then the
    root. A submodule sharing a parameter with a module outside it (an embedding tied to
    the output layer) is never a unit of its own: the tied weight stays in the smallest
    unit holding all its users, as FSDP2 requires. Activation checkpointing goes *inside*
    each unit (the model's ``activation_checkpointing_fn(module)`` chooses, else every
    unit is checkpointed). Both hooks are looked up on the model, then on ``model.model``.
    Call it on every rank, after the process group is up (inside
    :func:`fsdp_guide.launch` or torchrun). Build the optimizer afterwards.

    Args:
        model: the model, with real (not ``meta``) tensors; FSDP moves them to the rank's device.
        fsdp_config: the dictionary; see :func:`fsdp_guide.config.validate` and :ref:`fsdp-config-reference`.
        api: ``"fsdp2"`` (``fully_shard``, returns ``model`` itself) or
            ``"fsdp1"`` (returns a ``FullyShardedDataParallel`` wrapping it).

    Example:

    >>> import torch.nn as nn
    >>> from fsdp_guide import launch, shard
    >>> def local_shapes():
    ...     model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    ...     shard(model, {"min_params": 50, "mixed_precision": "FULL"})  # units: the 72-parameter Linear, the root
    ...     return [tuple(p.to_local().shape) for p in model.parameters()]
    >>> launch(local_shapes, world_size=2, output="none")[0]
    [(4, 8), (4,), (1, 8), (1,)]
    """
    config = validate(fsdp_config)
    if api not in _APIS:
        raise ValueError(f"api={api!r}: expected 'fsdp2' (fully_shard) or 'fsdp1' (FullyShardedDataParallel)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard() needs the process group: call it on every rank, inside fsdp_guide.launch or torchrun"
        )
    _check_combination(config, api)  # before anything changes the model
    if config.sync_module_states:
        _broadcast_from_rank_0(model)
    units = _plan_units(model, config)
    checkpointed = _apply_activation_checkpointing(model, config, units)
    units = [checkpointed.get(unit, unit) for unit in units]  # the checkpoint wrapper becomes the unit
    sizes = _unit_sizes(model, units)
    sharded, settings = (_shard_fsdp1 if api == "fsdp1" else _shard_fsdp2)(model, config, units)
    if config.verbose and dist.get_rank() == 0:
        print(_plan(sharded, api, settings, sizes))
    return sharded


@torch.no_grad()
def _broadcast_from_rank_0(model: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers, so replicas agree however each rank was seeded.

    By hand because FSDP1's ``sync_module_states`` needs the module on a GPU and FSDP2
    has none; one broadcast per tensor, through the rank's device (NCCL takes GPU tensors only)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        on_device = tensor.to(device())
        dist.broadcast(on_device, src=0)
        if on_device is not tensor:
            tensor.copy_(on_device)


def _check_combination(config: FsdpConfig, api: str) -> None:
    """Valid settings that cannot work together, or with this API, or on this machine."""
    world = dist.get_world_size()
    if config.sharding_strategy == "HYBRID_SHARD":
        if world < 2:
            raise ValueError(
                "HYBRID_SHARD shards within groups of ranks and replicates across them: it needs at least "
                "2 ranks, and there is 1. Use FULL_SHARD, or launch more ranks."
            )
        if world % _hybrid_shard_size(config):
            raise ValueError(
                f"HYBRID_SHARD with data_parallel_shard_degree={_hybrid_shard_size(config)} needs a world "
                f"size divisible by it; it is {world}. Choose a divisor of {world}."
            )
    if (
        api == "fsdp2"
        and config.mixed_precision_name == "custom"
        and config.mixed_precision["buffer_dtype"] is not None
    ):
        raise ValueError(
            "mixed_precision['buffer_dtype'] cannot be honoured by FSDP2: MixedPrecisionPolicy has no buffer "
            "dtype (buffers keep their own). Remove the key, or use api='fsdp1'."
        )
    if api == "fsdp2" and config.backward_prefetch == "NONE":
        raise ValueError(
            "backward_prefetch='NONE' cannot be honoured by FSDP2: it always prefetches the next unit in "
            "backward. Use 'BACKWARD_PRE' or 'BACKWARD_POST' (both mean that), or api='fsdp1'."
        )
    if api == "fsdp1" and config.cpu_offload and device().type == "cpu":
        raise ValueError(
            "cpu_offload=True with api='fsdp1' needs the ranks on an accelerator: FSDP1 pins the host memory it "
            "offloads to, and on a CPU-only machine the parameters already live in host memory. Use api='fsdp2' "
            "(CPUOffloadPolicy(pin_memory=False)) or cpu_offload=False."
        )


def _hybrid_shard_size(config: FsdpConfig) -> int:
    """Ranks per shard group: the setting, or by default the ranks of one node as torchrun reports them."""
    if config.data_parallel_shard_degree != -1:
        return config.data_parallel_shard_degree
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _model_hook(model: nn.Module, name: str) -> Callable[[nn.Module], Any] | None:
    """``model.<name>``, else ``model.model.<name>`` (trainers wrap the user's module as ``.model``)."""
    for owner in (model, getattr(model, "model", None)):
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def _plan_units(model: nn.Module, config: FsdpConfig) -> list[nn.Module]:
    """The submodules that become FSDP units, children before parents (the root is not listed)."""
    from fsdp_guide.wrap import _chosen_modules

    wrap_fn = _model_hook(model, "fsdp_wrap_fn")

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        wanted = wrap_fn(module) if wrap_fn is not None else False
        if not isinstance(wanted, bool):
            raise ValueError(f"fsdp_wrap_fn({type(module).__name__}) returned {wanted!r}: it must return True or False")
        return wanted or nonwrapped_numel >= config.min_params

    return [module for module, _ in _chosen_modules(model, policy)]


def _apply_activation_checkpointing(model: nn.Module, config: FsdpConfig, units: list[nn.Module]) -> dict:
    """Wrap the chosen modules with torch's checkpoint/offload wrappers; returns {module: its outermost wrapper}."""
    if not (config.activation_checkpointing or config.activation_cpu_offload):
        return {}
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        ActivationWrapper,
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if config.activation_checkpointing_reentrant else CheckpointImpl.NO_REENTRANT
    chosen_by_model = _model_hook(model, "activation_checkpointing_fn")
    unit_set = set(units)

    def wrap(module: nn.Module) -> nn.Module:
        if config.activation_checkpointing:
            module = checkpoint_wrapper(module, checkpoint_impl=impl)
        return offload_wrapper(module) if config.activation_cpu_offload else module

    def contains_a_unit(module: nn.Module) -> bool:
        return any(m in unit_set for m in list(module.modules())[1:])

    def check(module: nn.Module) -> bool:
        if chosen_by_model is not None:
            return bool(chosen_by_model(module))
        return module in unit_set and not contains_a_unit(module)  # default: the innermost units

    for name, module in model.named_modules():
        if module is not model and check(module) and contains_a_unit(module):
            raise ValueError(
                f"activation_checkpointing_fn chose {name!r}, which contains FSDP units: the checkpoint "
                "would sit around them and gather them again in backward. Choose the units themselves, "
                "or modules inside them."
            )
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=check)
    outermost = {}
    for module in model.modules():  # pre-order: an outer wrapper comes before the one inside it
        if isinstance(module, ActivationWrapper):
            inner = module
            while isinstance(inner, ActivationWrapper):
                inner = inner._checkpoint_wrapped_module
            outermost.setdefault(inner, module)
    return outermost


def _mesh(config: FsdpConfig):
    """1-D for FULL_SHARD and SHARD_GRAD_OP; (replicate, shard) for HYBRID_SHARD and NO_SHARD (shard size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if config.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device().type, (world,), mesh_dim_names=("shard",))
    shard_size = 1 if config.sharding_strategy == "NO_SHARD" else _hybrid_shard_size(config)
    return init_device_mesh(device().type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "keep" if dtype is None else str(dtype).removeprefix("torch.")


def _shard_fsdp2(model: nn.Module, config: FsdpConfig, units: list[nn.Module]):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp.wrap import CustomPolicy

    from fsdp_guide.wrap import auto_wrap

    mp = config.mixed_precision
    mesh = _mesh(config)
    reshard = config.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
    pin = device().type == "cuda"  # pinning is for copies to an accelerator; ranks on the CPU compute in host memory
    settings = {
        "sharding_strategy": f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, reshard_after_forward={reshard}"
        + (" (the root: False)" if reshard else ""),
        "mixed_precision": f"MixedPrecisionPolicy(param_dtype={_dtype_name(mp['param_dtype'])}, "
        f"reduce_dtype={_dtype_name(mp['reduce_dtype'])}); buffers keep their dtype",
        "cpu_offload": f"CPUOffloadPolicy(pin_memory={pin})" if config.cpu_offload else "OffloadPolicy() (none)",
        "backward_prefetch": "implicit: the next unit, like BACKWARD_PRE",
    }
    unit_set = set(units)
    auto_wrap(
        model,
        CustomPolicy(lambda module: {"reshard_after_forward": reshard} if module in unit_set else False),
        mesh=mesh,
        # The root's backward starts right after its forward: resharding it would only
        # gather it again (FSDP1 keeps its root gathered too; torch's default None means
        # the same for the root, and False says it for every release).
        reshard_after_forward=False,
        mp_policy=MixedPrecisionPolicy(param_dtype=mp["param_dtype"], reduce_dtype=mp["reduce_dtype"]),
        offload_policy=CPUOffloadPolicy(pin_memory=pin) if config.cpu_offload else OffloadPolicy(),
    )
    return model, settings


def _shard_fsdp1(model: nn.Module, config: FsdpConfig, units: list[nn.Module]):
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy

    mp = config.mixed_precision
    hybrid = config.sharding_strategy == "HYBRID_SHARD"
    unit_set = set(units)
    kwargs = dict(
        sharding_strategy=ShardingStrategy[config.sharding_strategy],
        auto_wrap_policy=CustomPolicy(lambda module: module in unit_set),
        mixed_precision=MixedPrecision(**mp) if any(mp.values()) else None,
        cpu_offload=CPUOffload(offload_params=config.cpu_offload),
        backward_prefetch=None if config.backward_prefetch == "NONE" else BackwardPrefetch[config.backward_prefetch],
        device_id=device(),
        use_orig_params=True,  # the optimizer and summon_full_params see the original parameters
        device_mesh=_mesh(config) if hybrid else None,
    )
    settings = {
        "sharding_strategy": f"ShardingStrategy.{config.sharding_strategy}"
        + (f", device_mesh {tuple(kwargs['device_mesh'].shape)}" if hybrid else ""),
        "mixed_precision": "MixedPrecision(" + ", ".join(f"{k}={_dtype_name(v)}" for k, v in mp.items()) + ")",
        "cpu_offload": f"CPUOffload(offload_params={config.cpu_offload})",
        "backward_prefetch": str(kwargs["backward_prefetch"]),
    }
    return FSDP(model, **kwargs), settings


def _unit_sizes(model: nn.Module, units: list[nn.Module]) -> dict:
    """{unit: number of parameters it all-gathers}, i.e. those in no unit inside it; the root last."""
    counted, sizes = set(), {}
    for unit in [*units, model]:  # children before parents
        own = [p for p in unit.parameters() if id(p) not in counted]
        counted.update(id(p) for p in own)
        sizes[unit] = sum(p.numel() for p in own)
    return sizes


def _plan(model: nn.Module, api: str, settings: dict, sizes: dict) -> str:
    """What ``verbose`` prints: the arguments ``shard`` passed to the API, then the units with their sizes."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, OffloadWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    title = "FSDP1 (FullyShardedDataParallel)" if api == "fsdp1" else "FSDP2 (fully_shard)"
    lines = [f"fsdp_config -> {title} on {dist.get_world_size()} ranks"]
    lines += [f"  {key:18} -> {value}" for key, value in settings.items()]
    lines.append("  units (the root last), parameters each all-gathers, activation wrappers:")
    named = list(model.named_modules())
    for name, module in named[1:] + named[:1]:
        if not isinstance(module, (FSDP, FSDPModule)):
            continue
        unit = module._fsdp_wrapped_module if isinstance(module, FSDP) else module
        inner, wrappers = unit, []
        while isinstance(inner, ActivationWrapper):
            wrappers.append("cpu-offload" if isinstance(inner, OffloadWrapper) else "checkpoint")
            inner = inner._checkpoint_wrapped_module
        kind = type(inner).__name__.removeprefix("FSDP") if isinstance(inner, FSDPModule) else type(inner).__name__
        label = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "") or "(root)"
        lines.append(f"    {label:24} {kind:14} {sizes[unit]:>12,}  {' + '.join(wrappers)}".rstrip())
    return "\n".join(lines)
