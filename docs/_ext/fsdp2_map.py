"""The FSDP2 map: every public name of the installed torch's FSDP2, what it does, and where a page executes it.

The names come from torch itself at build time (``public_names``), so the map is complete
for whatever torch builds the site; what each does, the release that brought it and the
page that executes it are kept here (``MAP``). ``tests/test_fsdp2_map.py`` fails when the
installed torch has a name the map does not know (run it on a new torch: ``nox -s
torch``), and ``tests/test_site.py`` checks that each link lands on a cell using the name.

Sphinx is imported only by ``setup``: the torch sessions test this file without it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]


class Entry(NamedTuple):
    since: str  # the first release in the supported range (2.9 to newest) that has it
    what: str  # one line
    page: str | None = None  # the page (tutorial stem) with the cell labelled ``label(name)``
    gpu: str | None = None  # why it does nothing on CPU with gloo, cited to torch's source


# First releases: 2.9, 2.13 and 2.15 are checked by the test on the torch each session
# installs (2.9.1, 2.13.0, the newest); 2.10, 2.12 and 2.14 were read from the sources in
# those releases' wheels on PyPI.
MAP = {
    "fully_shard": Entry(
        "2.9",
        "Shards a module's parameters as DTensors and gathers them around its forward and backward.",
        "quickstart",
    ),
    "fully_shard(module=)": Entry(
        "2.9",
        "The module, or a list of modules whose parameters form one unit (one all-gather, one reduce-scatter).",
        "quickstart",
    ),
    "fully_shard(mesh=)": Entry(
        "2.9",
        "The data-parallel device mesh: 1-D shards, 2-D replicates over dim 0 and shards over dim 1 (HSDP).",
        "tensor_parallel",
    ),
    "fully_shard(reshard_after_forward=)": Entry(
        "2.9",
        "Free the gathered parameters after forward (True) or keep them for backward (False); an int reshards to "
        "groups of that size instead (not executed on these pages).",
        "communication",
    ),
    "fully_shard(shard_placement_fn=)": Entry(
        "2.9", "Per parameter, the dim to shard on (Shard(dim)) instead of dim 0.", page="placements"
    ),
    "fully_shard(mp_policy=)": Entry("2.9", "The unit's MixedPrecisionPolicy.", "mixed_precision"),
    "fully_shard(offload_policy=)": Entry(
        "2.9", "OffloadPolicy() (none) or CPUOffloadPolicy(): sharded state kept on the CPU.", page="memory"
    ),
    "fully_shard(ignored_params=)": Entry(
        "2.9", "Parameters FSDP leaves alone: not sharded, not moved, their gradients not reduced.", "placements"
    ),
    "fully_shard(dp_mesh_dims=)": Entry(
        "2.12",
        "Names the data-parallel dims of a full SPMD mesh whose parameters are already DTensors.",
        page="tp_exactness",
    ),
    "FSDPModule": Entry(
        "2.9", "The class fully_shard mixes into a sharded module; it carries the methods below.", "enable_wrap"
    ),
    "FSDPModule.unshard": Entry(
        "2.9", "All-gathers this unit's parameters now; async_op=True returns an UnshardHandle.", "fsdp2_controls"
    ),
    "FSDPModule.reshard": Entry("2.9", "Frees this unit's gathered parameters, leaving the shards.", "beyond_the_step"),
    "FSDPModule.reset_iter_state": Entry(
        "2.13",
        "After a forward or backward raised: waits for collectives in flight, reshards and clears the step's state.",
        "failed_step",
    ),
    "FSDPModule.set_requires_gradient_sync": Entry(
        "2.9", "Turns gradient reduction off (accumulate locally) or on: FSDP2's no_sync.", "no_sync"
    ),
    "FSDPModule.set_requires_all_reduce": Entry(
        "2.9",
        "HSDP: reduce-scatter but skip the all-reduce across replicas while accumulating.",
        "no_sync",
    ),
    "FSDPModule.set_is_last_backward": Entry(
        "2.9",
        "Whether the next backward is the step's last: only then does FSDP wait for reductions and clear its state.",
        page="collective_hooks",
    ),
    "FSDPModule.set_reshard_after_forward": Entry(
        "2.9",
        "Changes reshard_after_forward at run time (e.g. keep the model gathered for generation).",
        "beyond_the_step",
    ),
    "FSDPModule.set_reshard_after_backward": Entry(
        "2.9",
        "Keeps gathered parameters after backward (no new all-gather for the next micro-batch).",
        "frozen_weights",
    ),
    "FSDPModule.set_unshard_in_backward": Entry(
        "2.9",
        "False: backward does not gather this unit again (its parameters are not needed for gradients).",
        "fsdp2_controls",
    ),
    "FSDPModule.set_modules_to_forward_prefetch": Entry(
        "2.9",
        "The units whose all-gathers this unit starts in its forward, instead of one at a time.",
        "fsdp2_controls",
    ),
    "FSDPModule.set_modules_to_backward_prefetch": Entry(
        "2.9",
        "The units whose all-gathers this unit starts in its backward, instead of the default one ahead.",
        "communication",
    ),
    "FSDPModule.set_gradient_divide_factor": Entry(
        "2.9", "Divides reduced gradients by this factor instead of the data-parallel size.", "loss_and_accumulation"
    ),
    "FSDPModule.set_reduce_scatter_divide_factor": Entry(
        "2.9", "Deprecated name of set_gradient_divide_factor (it warns and calls it).", page="collective_hooks"
    ),
    "FSDPModule.set_force_sum_reduction_for_comms": Entry(
        "2.9",
        "Reduces with SUM and divides separately, instead of AVG or PREMUL_SUM (which gloo lacks).",
        "loss_and_accumulation",
    ),
    "FSDPModule.set_reduce_scatter_unused_params": Entry(
        "2.13",
        "Reduce-scatters zeros for parameters that got no gradient, so every rank joins the same collectives.",
        "uneven_experts",
    ),
    "FSDPModule.set_custom_all_gather": Entry(
        "2.9",
        "Replaces the all-gather with your object: its buffer allocation and its collective.",
        page="collective_hooks",
    ),
    "FSDPModule.set_custom_reduce_scatter": Entry(
        "2.9",
        "Replaces the gradient reduce-scatter with your object: its buffer allocation and its collective.",
        page="collective_hooks",
    ),
    "FSDPModule.set_all_reduce_hook": Entry(
        "2.9",
        "A hook on each reduced gradient: after the reduce-scatter (FSDP) or the all-reduce (HSDP).",
        page="collective_hooks",
    ),
    "FSDPModule.set_separate_reduce_scatter_group": Entry(
        "2.13",
        "Gives the gradient reduce-scatter its own process group, so it can overlap the all-gathers.",
        page="collective_hooks",
    ),
    "FSDPModule.set_reduce_scatter_max_input_buffers": Entry(
        "2.13", "How many reduce-scatter input buffers may be in flight at once (default 1).", page="collective_hooks"
    ),
    "FSDPModule.set_post_optim_event": Entry(
        "2.9",
        "The next forward's all-gathers wait for this event (the optimizer step's) instead of the whole stream.",
        gpu="the event is only waited on by the all-gather streams (`_root_pre_forward` in `_fsdp_state.py`); "
        "on a CPU mesh `torch.cpu.Stream.wait_event` does nothing (`torch/cpu/__init__.py`)",
    ),
    "FSDPModule.set_allocate_memory_from_process_group_for_comm": Entry(
        "2.9",
        "Allocates the collectives' buffers with the process group's allocator (NCCL zero-copy, SHARP).",
        gpu="`ProcessGroupAllocMixin.allocate` (`_fsdp_collectives.py`) uses `torch.empty` unless the backend "
        "`supports_tensor_alloc(device)`, which gloo does not",
    ),
    "FSDPModule.set_symm_mem_for_comm": Entry(
        "2.12",
        "Allocates the all-gather (and SUM reduce-scatter) buffers from NCCL symmetric memory.",
        gpu="`SymmMemAllocMixin` (`_fsdp_collectives.py`) sets the symmetric-memory backend to NCCL and "
        "allocates inside `torch.cuda.use_mem_pool`",
    ),
    "MixedPrecisionPolicy": Entry("2.9", "The dtypes a unit computes, reduces and returns in.", "mixed_precision"),
    "MixedPrecisionPolicy.param_dtype": Entry(
        "2.9", "The dtype parameters are gathered in and forward and backward compute in.", "mixed_precision"
    ),
    "MixedPrecisionPolicy.reduce_dtype": Entry("2.9", "The dtype gradients are reduced in.", "mixed_precision"),
    "MixedPrecisionPolicy.output_dtype": Entry(
        "2.9", "The dtype the unit's forward outputs are cast to.", page="mixed_precision"
    ),
    "MixedPrecisionPolicy.cast_forward_inputs": Entry(
        "2.9", "Whether the unit casts its floating-point forward inputs to param_dtype.", page="mixed_precision"
    ),
    "MixedPrecisionPolicy.param_dtype_override_fn": Entry(
        "2.15", "Per parameter, a dtype that overrides param_dtype (e.g. keep norms in fp32)."
    ),
    "OffloadPolicy": Entry("2.9", "No offloading: the default offload_policy.", page="memory"),
    "CPUOffloadPolicy": Entry(
        "2.9",
        "Keeps sharded parameters, gradients and optimizer states on the CPU; copies to the device for compute.",
        page="memory",
    ),
    "CPUOffloadPolicy.pin_memory": Entry(
        "2.9",
        "Pins the CPU copies so host-to-device copies can be asynchronous (default True).",
        gpu="pinning needs an accelerator (`Tensor.pin_memory()` in `_fsdp_param.py`); on a CPU-only build it "
        'raises "Cannot access accelerator device when none is available"',
    ),
    "UnshardHandle": Entry("2.9", "What unshard(async_op=True) returns.", "fsdp2_controls"),
    "UnshardHandle.wait": Entry(
        "2.9", "Waits for that all-gather and registers the gathered parameters.", "fsdp2_controls"
    ),
    "DataParallelMeshDims": Entry(
        "2.12", "Which named dims of a full mesh are the shard and the replicate dims.", page="tp_exactness"
    ),
    "DataParallelMeshDims.shard": Entry("2.12", "The mesh dim name(s) FSDP shards over.", page="tp_exactness"),
    "DataParallelMeshDims.replicate": Entry(
        "2.12", "The mesh dim name(s) replicated over (HSDP).", page="tp_exactness"
    ),
    "register_fsdp_forward_method": Entry(
        "2.9",
        "Makes a method other than forward (e.g. generate) gather and free parameters like forward.",
        "beyond_the_step",
    ),
    "share_comm_ctx": Entry(
        "2.10",
        "Lets several FSDP roots (pipeline stages) share one set of communication streams and state.",
        page="collective_hooks",
    ),
    "GradientReductionHandle": Entry("2.15", "What finalize_backward(async_op=True) returns."),
    "GradientReductionHandle.wait": Entry("2.15", "Waits for the gradient reductions and frees their buffers."),
    "FSDPModule.finalize_backward": Entry(
        "2.15", "Under manual finalization: finishes the gradient reductions and resharding of the backward."
    ),
    "FSDPModule.set_manual_backward_finalization": Entry(
        "2.15", "Root only: backward ends when you call finalize_backward(), not automatically."
    ),
    "FSDPModule.set_keep_unsharded_storage": Entry(
        "2.15", "Keeps the gathered parameters' storage across reshards (fixed addresses, for CUDA graphs)."
    ),
}


def public_names() -> dict[str, str]:
    """Every public FSDP2 name of the installed torch -> its kind.

    FSDP2's exports (the ``__all__`` of ``torch.distributed.fsdp._fully_shard``, which
    ``torch.distributed.fsdp`` re-exports beside FSDP1's names), their public methods and
    dataclass fields, and ``fully_shard``'s parameters.
    """
    import torch.distributed.fsdp._fully_shard as fsdp2

    names = {}
    for export in fsdp2.__all__:
        obj = getattr(fsdp2, export)
        names[export] = "class" if inspect.isclass(obj) else "function"
        if inspect.isclass(obj):
            names |= {f"{export}.{a}": "method" for a, v in vars(obj).items() if not a.startswith("_") and callable(v)}
            if dataclasses.is_dataclass(obj):
                names |= {f"{export}.{f.name}": "field" for f in dataclasses.fields(obj)}
    names |= {f"fully_shard({p}=)": "parameter" for p in inspect.signature(fsdp2.fully_shard).parameters}
    return names


def label(name: str) -> str:
    """The label of the cell that executes ``name``: ``fsdp2-`` and the name in lower case, with hyphens."""
    return "fsdp2-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def pattern(name: str) -> str:
    """What the labelled cell's code must contain: a call, a keyword argument or the name itself."""
    if name.startswith("fully_shard("):
        parameter = name[len("fully_shard(") : -2]
        return "fully_shard(" if parameter == "module" else f"{parameter}="
    owner, _, member = name.rpartition(".")
    if owner == "FSDPModule" or owner.endswith("Handle"):
        return f".{member}("
    if owner:  # a dataclass field, set by keyword
        return f"{member}="
    return name


@functools.cache  # a page links several names: read its title once
def _title(page: str) -> str:
    source = next(p for p in (ROOT / "tutorials" / f"{page}.py", ROOT / "docs" / f"{page}.py") if p.exists())
    title = re.search(r"^# # (.+)$", source.read_text(), re.M).group(1)
    return re.sub(r"[`<>]", "", title)  # plain text: it becomes a reference's text


def _rows(names: list[str], installed: dict[str, str]) -> list[str]:
    rows = []
    for name in names:
        entry = MAP[name]
        if entry.page:
            where = f":ref:`{_title(entry.page)} <{label(name)}>`"
        elif entry.gpu:
            where = f"GPU only, not executed here: {entry.gpu}"
        elif name in installed:
            where = "not executed on a page yet"
        else:
            where = "not in the torch this site runs"
        rows += [f"   * - ``{name}``", f"     - {entry.since}", f"     - {entry.what}", f"     - {where}"]
    return rows


def _table(title: str, rows: list[str]) -> list[str]:
    return [
        f".. list-table:: {title}",
        "   :header-rows: 1",
        "   :widths: 30 8 40 22",
        "",
        "   * - Name",
        "     - Since",
        "     - What it does",
        "     - Executed in",
        *rows,
        "",
    ]


GROUPS = {
    "``fully_shard`` and its parameters": lambda n: n.startswith("fully_shard"),
    "``FSDPModule``, the methods of a sharded module": lambda n: n.startswith("FSDPModule"),
    "Policies, handles and the other exports": lambda n: not n.startswith(("fully_shard", "FSDPModule")),
}


def map_lines() -> list[str]:
    """The map as reStructuredText: one table per group of the installed torch's names, then the newer ones."""
    import torch

    installed = public_names()
    unknown = sorted(set(installed) - set(MAP))
    if unknown:
        raise ValueError(
            f"torch {torch.__version__} has FSDP2 names the map does not know: {unknown}; "
            "add them to MAP in docs/_ext/fsdp2_map.py"
        )
    lines = []
    for title, belongs in GROUPS.items():
        lines += _table(title, _rows([n for n in MAP if n in installed and belongs(n)], installed))
    newer = [n for n in MAP if n not in installed]
    if newer:
        lines += _table(f"In releases newer than torch {torch.__version__.split('+')[0]}", _rows(newer, installed))
    return lines


def setup(app):
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class FSDP2Map(SphinxDirective):
        """``.. fsdp2-map::``: the tables, generated from the torch that builds the site."""

        def run(self):
            self.env.note_dependency(__file__)
            node = nodes.container()
            nested_parse_with_titles(self.state, StringList(map_lines(), source="fsdp2-map"), node)
            return node.children

    app.add_directive("fsdp2-map", FSDP2Map)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
