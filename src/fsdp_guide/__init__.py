"""fsdp_guide: the reference package of the FSDP Guide.

``import fsdp_guide`` does not import torch: a notebook that only launches
ranks keeps its kernel light, and each rank imports torch itself. The helpers
that need torch load on first use.
"""

from importlib import import_module

from fsdp_guide.launcher import LaunchError, launch

__all__ = [
    "launch",
    "run",
    "Ranks",
    "LaunchError",
    "device",
    "executed_on",
    "summon_full_params",
    "auto_wrap",
    "describe_sharding",
    "shard",
]
__version__ = "0.1.0"

_LAZY = {
    "device": "fsdp_guide.devices",
    "executed_on": "fsdp_guide.executed",
    "summon_full_params": "fsdp_guide.summon",
    "auto_wrap": "fsdp_guide.wrap",
    "describe_sharding": "fsdp_guide.describe",
    "shard": "fsdp_guide.config",
    "run": "fsdp_guide.launcher",
    "Ranks": "fsdp_guide.live",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fsdp_guide' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython) -> None:
    """``%load_ext fsdp_guide``: the ``%%ranks``, ``%ranks`` and ``%torchrun`` magics (:mod:`fsdp_guide._magics`)."""
    from fsdp_guide._magics import load_ipython_extension

    load_ipython_extension(ipython)
