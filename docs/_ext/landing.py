"""The landing page's map of the tutorials, and the tips grouped the same way.

The groups and each tutorial's one-line outcome are kept here (``GROUPS``); what a card
says a page needs and how long it runs is read from the page's own opening ("What you
need", with the time ``bench/bench_site.py --record`` writes there), so a card cannot
disagree with its page. A tip belongs to the group of the first tutorial it links to.
``tests/test_site.py`` checks that every tutorial has a card and every tip a group.

Sphinx is imported only by ``setup``; the rest is plain text processing, testable alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]


class Group(NamedTuple):
    title: str
    blurb: str
    pages: dict[str, tuple[str, str]]  # page stem -> (card title, what the reader comes away with)
    also: tuple[str, ...] = ()  # lines for pages that are not tutorials (reStructuredText)


GROUPS = {
    "start": Group(
        "Start here",
        "Shard a model, train it, and see that nothing changed.",
        {
            "quickstart": ("Quickstart", "Shard a model on two processes; the losses match one process."),
            "interactive": (
                "Exploring interactively",
                "Ranks that stay up across cells: each rank's shard, a step, a torchrun script.",
            ),
            "digits": ("A first real model", "A dataset split across ranks, a training loop, evaluation."),
            "migration": ("From FSDP1 to FSDP2", "Every FSDP1 argument's FSDP2 form, the same losses, the checkpoint."),
            "deepspeed_zero": (
                "From DeepSpeed ZeRO to FSDP2",
                "The same losses as ZeRO-1, -2 and -3; bf16 matched; a ZeRO checkpoint resumed.",
            ),
        },
    ),
    "right": Group(
        "Get it right",
        "The mistakes that train silently wrong, and the rules that avoid them.",
        {
            "pitfalls": ("The step on shards", "Clip by the global norm, the optimizer after sharding, pointwise."),
            "muon": (
                "Muon on shards",
                "Newton-Schulz needs whole matrices: route each to one rank, equal to one process bit for bit.",
            ),
            "outside_forward": ("Outside forward", "Other methods, edited weights and DTensor operations, done right."),
            "checkpoint_placement": ("Checkpointing inside the unit", "Collectives counted for every placement."),
            "deterministic_init": ("Deterministic init", "Why N ranks can end up with N identical shards."),
            "loss_and_accumulation": ("Loss and accumulation", "Normalise the loss over ranks and micro-batches."),
            "world_sizes": (
                "Equal across world sizes?",
                "What is bit-equal on 1, 2 and 4 ranks, what is rounding, and how to tell a bug from it.",
            ),
            "no_sync": ("Accumulating without sync", "What skipping the gradient sync saves, and costs."),
            "enable_wrap": (
                "Choosing units",
                "Mark units by hand or by policy; build a model that never exists whole.",
            ),
            "state_attributes": ("What FSDP keeps", "The state on each parameter, before and after each step."),
            "summon_full_params": ("Custom init", "Initialise a sharded model's weights in place."),
        },
    ),
    "fast": Group(
        "Fit it in memory and make it fast",
        "Bytes per rank, bytes on the wire, and the knobs.",
        {
            "memory": ("Memory per rank", "A model of each rank's memory, checked against ZeRO."),
            "checkpoint_variants": (
                "Activation checkpointing, measured",
                "Every variant's memory, recompute and collectives; the HF cache to turn off.",
            ),
            "communication": ("Communication", "What FSDP sends and when, counted on the wire."),
            "collective_hooks": (
                "Your own collectives",
                "Custom all-gather and reduce-scatter, buffers in flight, hooks.",
            ),
            "fsdp2_controls": ("Prefetching by hand", "Start all-gathers earlier; skip one backward does not need."),
            "failed_step": ("A failed step", "Catch an exception mid-backward and train on as one process does."),
            "placements": ("Choosing placements", "Shard along dim 1, keep tied weights in one unit, ignore one."),
            "mixed_precision": ("Mixed precision", "What runs in bf16 and what stays fp32, made visible."),
            "fp16_scaler": ("float16 needs a gradient scaler", "float16 stops learning without one; bf16 needs none."),
            "fp8": ("FP8 with torchao", "Float8 training under FSDP2, against bf16."),
            "fp8_memory": ("FP8 memory", "Activations and a second master copy: why FP8 can use more."),
            "compile": ("torch.compile", "Where to compile a sharded model, and how to check it."),
            "compile_recompiles": ("Recompiles and dynamo's logs", "What recompiles, and what the logs say."),
            "compile_checkpointing": (
                "Checkpointing with compile",
                "Activation checkpointing and compile, in each order.",
            ),
            "compiled_autograd": (
                "Compiled autograd and the optimizer",
                "What compiles past the blocks, and what breaks.",
            ),
        },
    ),
    "tune": Group(
        "Fine-tune and checkpoint",
        "Weights in from the Hub, training, weights out.",
        {
            "finetune_hf": ("Fine-tune a Hugging Face model", "Load once, shard, train, save safetensors."),
            "trainer_fsdp": (
                "Trainer and Accelerate: check the config",
                "An FSDP2 fsdp_config on CPU ranks trains as DDP; unknown keys vanish; check first.",
            ),
            "fsdp_config_map": (
                "From fsdp_config to fully_shard",
                "Each key as the fully_shard calls Accelerate makes, generated; the same by hand.",
            ),
            "peft_resume": (
                "Resume LoRA through Accelerate",
                "The Trainer's full state dict kept only rank 0's adapter slices (accelerate 1.14); check every rank.",
            ),
            "hf_dcp_export": (
                "Hugging Face weights from every rank",
                "DCP's writer: each rank writes its shards as safetensors, no gather.",
            ),
            "lora": ("LoRA on a sharded model", "Adapters on a sharded base, like one process, and the export."),
            "qlora": (
                "QLoRA: a 4-bit base",
                "bitsandbytes NF4 under fully_shard: its bytes sharded, what a rank holds against bf16 LoRA.",
            ),
            "qlora_pitfalls": (
                "QLoRA: three ways it breaks",
                "Sharded before quantised, bf16 codes under a casting policy, NaN bit patterns.",
            ),
            "qlora_adapters": (
                "QLoRA: save and merge the adapters",
                "Every rank's slice saved, loaded in one process; merged without rounding the update away.",
            ),
            "qlora_cpu_repack": (
                "QLoRA on a CPU",
                "One evaluation repacks the 4-bit weights: another loss, no gradients; the switch.",
            ),
            "frozen_weights": (
                "Frozen weights",
                "One dtype among a unit's trainable parameters; the frozen base still all-gathered.",
            ),
            "beyond_the_step": (
                "Evaluation and generation",
                "Evaluate under no_grad, count an uneven eval set once, generate token by token.",
            ),
            "ema_and_teacher": ("An EMA and a frozen teacher", "A second copy of the weights, kept on the shards."),
            "fsdp_config": (
                "A config dictionary",
                "A Composer-style fsdp_config: each strategy and precision preset run.",
            ),
        },
    ),
    "scale": Group(
        "Scale out",
        "Beyond one machine and beyond data parallelism.",
        {
            "llm": ("The LLM recipe", "Train a small GPT: the recipe's order, the loss curve, one file out."),
            "llm_checkpoints": ("Exact checkpoints", "Stop, crash, save in the background, resume: the same losses."),
            "mfu": ("MFU, computed right", "FLOPs per token checked by torch's counter; a published MFU reproduced."),
            "rank_dies": ("When a rank dies", "torchrun restarts every rank from the last checkpoint, bit for bit."),
            "torchft_recovery": (
                "torchft: the others keep training",
                "Replica groups; the restarted one takes a peer's state.",
            ),
            "tensor_parallel": (
                "Tensor parallelism",
                "FSDP and TP on a 2-D mesh: the plan, and each step's collectives.",
            ),
            "tp_exactness": ("2-D equals one process", "FSDP x TP trains as one process; a 2-D mesh alone is HSDP."),
            "tp_gradients": (
                "A TP model's gradients",
                "Partial sums, clipping across two meshes, implicit replication.",
            ),
            "loss_parallel": (
                "Loss parallel",
                "Embedding and output layer split by vocabulary; logits never gathered.",
            ),
            "tp_attention": ("Attention under TP", "GQA heads that divide the TP degree; context parallel, GPU only."),
            "tp_checkpoints": (
                "2-D checkpoints",
                "A 2 x 2 run's DCP checkpoint loaded on 2 ranks, exported to one file.",
            ),
            "pipeline": (
                "Pipeline stages",
                "FSDP2 inside pipeline stages on a 2-D mesh: exact, and all-gathers per micro-batch.",
            ),
            "pipeline_bubble": ("The pipeline bubble", "GPipe and 1F1B timed and drawn: each stage's idle time."),
            "experts": ("Experts", "Mixture of experts: all-to-all, experts on their own mesh, the divide factor."),
            "uneven_experts": ("Uneven experts", "The load, experts a rank never calls, fewer experts than ranks."),
            "weight_sync": ("Weights to an inference copy", "An RL trainer's sync: gathered, per parameter, bucketed."),
            "cluster": ("On a cluster", "torchrun and SLURM commands; HSDP on a 2 x 2 mesh, executed."),
        },
    ),
    "broken": Group(
        "When it breaks",
        "Hangs, errors and wrong numbers, traced to their cause.",
        {
            "debugging_hangs": (
                "Debugging a hang",
                "Uneven evaluation batches; the stacks, DETAIL, monitored_barrier, the flight recorder.",
            ),
            "hang_branch": (
                "A unit on some ranks only",
                "A data-dependent branch; the hang surfaces one collective later.",
            ),
            "hang_state_dict": ("A state dict on rank 0 only", "The gather every rank must call, seen with py-spy."),
            "set_order": ("Collectives in a set's order", "Wrong sums under torchrun, right ones in the notebook."),
        },
        also=(
            ":ref:`Errors, indexed <errors-index>`: every error message the pages reproduce, linked to the cell.",
            ":ref:`Symptoms <symptoms>`: out of memory, slow, hangs, wrong numbers; to the cells that show them.",
        ),
    ),
}


def page_source(stem: str) -> Path:
    return next(p for p in (ROOT / "tutorials" / f"{stem}.py", ROOT / "docs" / f"{stem}.py") if p.exists())


def pages() -> list[Path]:
    """The source of every page with a card: every page that executes."""
    return [page_source(stem) for group in GROUPS.values() for stem in group.pages]


def needs(stem: str) -> dict[str, object]:
    """What the page's "What you need" paragraph says: the ranks, the optional libraries, Linux, the time."""
    lines = page_source(stem).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# **What you need**")), None)
    if start is None:
        raise ValueError(f"{stem}: the page has no '**What you need**' paragraph for its card")
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("# "))
    words = " ".join(line[2:].strip() for line in lines[start:end])
    ranks = {int(n) for m in re.finditer(r"(\d+)(?:,? and (\d+))? processes", words) for n in m.groups() if n}
    ranks |= {int(n) for n in re.findall(r"(\d+) for one cell", words)}
    seconds = re.search(r"about (\d+) seconds|about (a) minute", words)
    if not ranks or seconds is None:
        raise ValueError(f"{stem}: its '**What you need**' names no number of processes or no time: {words!r}")
    return {
        "ranks": sorted(ranks),
        "libraries": [lib for lib in ("transformers", "peft", "torchao", "py-spy") if re.search(rf"\b{lib}\b", words)],
        "linux": "Linux" in words,
        "seconds": 60 if seconds.group(2) else int(seconds.group(1)),
    }


def footer(stem: str) -> str:
    n = needs(stem)
    parts = [f"about {n['seconds']} s", " or ".join(map(str, n["ranks"])) + " ranks", *n["libraries"]]
    return " · ".join(parts + (["Linux"] if n["linux"] else []))


def label(stem: str) -> str:
    return re.search(r"^# \(([\w-]+)\)=", page_source(stem).read_text(), re.M).group(1)


def map_lines() -> list[str]:
    """The tutorials by goal: one sphinx-design card per group, a line per tutorial (reStructuredText)."""
    lines = [".. role:: needs", "", ".. grid:: 1 1 2 3", "   :gutter: 3", "   :class-container: goal-map", ""]
    for group in GROUPS.values():
        lines += [
            f"   .. grid-item-card:: {group.title}",
            "      :class-card: goal-card",
            "",
            f"      {group.blurb}",
            "",
        ]
        for stem, (title, outcome) in group.pages.items():
            lines += [f"      - :ref:`{title} <{label(stem)}>`: {outcome} :needs:`{footer(stem)}`", ""]
        lines += [f"      - {line}" for line in group.also] + [""]
    return lines


def _labels() -> dict[str, str]:
    """Every label of the pages with a card -> its page stem."""
    found = {}
    for source in pages():
        found |= {name: source.stem for name in re.findall(r"^# \(([\w-]+)\)=", source.read_text(), re.M)}
    return found


def tips() -> list[tuple[str, str, str]]:
    """Every tip of docs/fsdp_tips.rst as (label, title, page stem of the first tutorial it links to)."""
    text = (ROOT / "docs" / "fsdp_tips.rst").read_text()
    labels, found = _labels(), []
    for name, title, body in re.findall(
        r"^\.\. _(tip-[\w-]+):\n\n([^\n]+)\n-+\n(.*?)(?=^\.\. _tip-|\Z)", text, re.M | re.S
    ):
        pages = [labels[ref] for ref in re.findall(r":ref:`(?:[^`<]*<)?([\w-]+)>?`", body) if ref in labels]
        if not pages:
            raise ValueError(f"{name} links to no tutorial: a tip links to the cell that proves it")
        found.append((name, title, pages[0]))
    return found


def group_of(stem: str) -> str:
    return next(key for key, group in GROUPS.items() if stem in group.pages)


def tips_lines() -> list[str]:
    """The tips as lists under the landing page's groups."""
    by_group = {key: [] for key in GROUPS}
    order = [stem for group in GROUPS.values() for stem in group.pages]
    for name, _title, stem in sorted(tips(), key=lambda tip: order.index(tip[2])):  # stable: the page's order within
        by_group[group_of(stem)].append(f"- :ref:`{name}` ({GROUPS[group_of(stem)].pages[stem][0]})")
    lines = []
    for key, items in by_group.items():
        if items:
            title = f"{GROUPS[key].title} ({len(items)})"
            lines += [title, "-" * len(title), "", *items, ""]
    return lines


def setup(app):
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    def generated(lines_of, sources):
        class Generated(SphinxDirective):
            def run(self):
                self.env.note_dependency(__file__)
                for source in sources():
                    self.env.note_dependency(str(source))
                node = nodes.container()
                nested_parse_with_titles(self.state, StringList(lines_of(), source=self.name), node)
                return node.children

        return Generated

    app.add_directive("tutorial-map", generated(map_lines, pages))
    app.add_directive("tips-by-goal", generated(tips_lines, lambda: [ROOT / "docs" / "fsdp_tips.rst", *pages()]))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
