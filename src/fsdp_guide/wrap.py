"""``auto_wrap``: FSDP1's ``auto_wrap_policy`` for FSDP2's ``fully_shard``.

FSDP1 takes a wrap policy and wraps the chosen submodules itself; ``fully_shard``
has no policy argument. ``auto_wrap`` asks torch's own policy code which
modules a policy chooses, exactly as FSDP1 would, then applies ``fully_shard``
to them bottom-up and finally to the root. (torch's ``enable_wrap``/``wrap``
already accept ``wrapper_cls=fully_shard``, so they need nothing here.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

# Private, but they are the policy semantics FSDP1 uses; re-implementing them
# would drift from what FSDP1 chooses for the same policy.
from torch.distributed.fsdp.wrap import _Policy, _recursive_wrap

__all__ = ["auto_wrap"]


def auto_wrap(module: nn.Module, policy: _Policy | Callable[..., bool], **fully_shard_kwargs: Any) -> nn.Module:
    """Apply ``fully_shard`` to every submodule ``policy`` chooses (children first), then to ``module``.

    Args:
        module: the model (the root FSDP unit).
        policy: a torch wrap policy, as FSDP1's ``auto_wrap_policy`` takes it:
            a policy object (``ModuleWrapPolicy``, ``CustomPolicy``, ...) or a
            policy function such as ``functools.partial(size_based_auto_wrap_policy,
            min_num_params=...)``. Keyword arguments a ``CustomPolicy`` returns for
            a module are passed to that module's ``fully_shard`` call.
        fully_shard_kwargs: passed to every ``fully_shard`` call (``mesh``,
            ``reshard_after_forward``, ``mp_policy``, ``offload_policy``, ...).

    A submodule the policy chooses that shares a parameter with a module outside it (an
    embedding tied to the output layer) is not made a unit: FSDP2 shards a tied weight in
    one unit, holding all its users, so its parameters stay with the smallest unit around
    them (often the root).

    Returns:
        ``module``, sharded in place (its class is now an ``FSDPModule``).

    Example:

    >>> import torch.nn as nn
    >>> from torch.distributed.fsdp import FSDPModule
    >>> from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    >>> from fsdp_guide import auto_wrap, launch
    >>> def units():
    ...     model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    ...     auto_wrap(model, ModuleWrapPolicy({nn.Linear}))
    ...     return [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    >>> launch(units, world_size=2, output="none")[0]
    ['(root)', '0', '2']
    """
    for target, kwargs in _chosen_modules(module, policy):
        fully_shard(target, **{**fully_shard_kwargs, **kwargs})
    return fully_shard(module, **fully_shard_kwargs)


def _chosen_modules(root: nn.Module, policy) -> list[tuple[nn.Module, dict]]:
    """The submodules ``policy`` chooses, children before parents, with their own kwargs."""
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(root, ignored_modules=set(), root_kwargs={})
    elif callable(policy):
        chosen = {}

        def record(module, **kwargs):  # a "wrapper" that only notes the choice
            chosen[module] = kwargs
            return module

        _recursive_wrap(root, policy, record, ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
    else:
        raise TypeError(
            f"policy must be a torch wrap policy (e.g. ModuleWrapPolicy({{nn.Linear}})) or a policy function "
            f"(e.g. functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)), got {type(policy).__name__}"
        )
    bottom_up = reversed(list(root.modules()))  # pre-order reversed: every child before its parent
    shared = _sharing_outside(root)
    return [(m, chosen[m]) for m in bottom_up if m in chosen and m is not root and m not in shared]


def _sharing_outside(root: nn.Module) -> set[nn.Module]:
    """The submodules holding a parameter that a module outside them holds too (a tied embedding and head).

    Such a module cannot be a unit of its own: FSDP2 needs every user of a parameter in the
    unit that shards it (torch 2.13 refuses a second owner at the first forward, "already
    managed by another FSDP group": ``FSDPState._validate_no_duplicate_params``), so its
    parameters stay with the smallest unit around all of them. Written by hand: torch's wrap
    policies look at one module at a time.
    """
    owners: dict[int, list[str]] = {}  # a parameter -> the names of the modules holding it
    for name, param in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    tied = [names for names in owners.values() if len(set(names)) > 1]
    sharing = set()
    for prefix, module in root.named_modules():
        for names in tied:
            inside = [name for name in names if name == prefix or name.startswith(prefix + ".")]
            if prefix and inside and len(inside) < len(names):
                sharing.add(module)
    return sharing
