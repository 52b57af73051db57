"""The errors index: every error and warning message a page's executed output shows, found at build time.

While Sphinx reads an executed page, each code cell whose output has a line like
``RuntimeError: FSDP does not support deepcopy`` gets an id (``error-<cell index>``) and
each such message is kept (``Found``); ``.. errors-index::`` becomes a list of them, each
linked to the cells that show it, once every page is read. Nothing is typed but the fix:
``FIXES`` maps a distinctive part of each message to the fix in one line, with a reference
to where it is executed, and ``tests/test_site.py`` fails for a message without one, so a
new page's errors appear in the index and ask for their fix.

Sphinx is imported only by ``setup``; docutils, which it builds on, at the top (Sphinx
pickles the page with the placeholder node, whose class must then be importable).
"""

from __future__ import annotations

import html
import re
from importlib.metadata import version
from typing import NamedTuple

from docutils import nodes

# An exception or warning class (possibly dotted: torch._dynamo.exc.Unsupported), an
# optional "(details)" and the message. Not inside a longer word or a dotted name. A class
# is a capitalised name ending in one of the suffixes, or dynamo's exactly ``Unsupported``.
MESSAGE = re.compile(
    r"(?<![\w.])((?:[a-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Warning|Expired|Unsupported|Failed)"
    r"|Unsupported))(?: \([^)]*\))?: (\S.*)"
)

# A class whose message starts on the line after a rule of "=", as torchrun's
# ``ChildFailedError`` prints its summary box; the message is the box's first line.
BOXED = re.compile(r"(?<![\w.])((?:[a-z_]\w*\.)*[A-Z]\w*Error): *\n=+\n(\S.*)")

# The indented lines that follow a message ending with a colon: its details, as
# ``load_state_dict`` prints each mismatch on a line of its own, after a tab.
INDENTED = re.compile(r"(?:\n[ \t]+\S[^\n]*)+")


class Found(NamedTuple):
    kind: str  # the exception or warning class, as printed
    message: str  # its first line, as printed
    page: str  # the docname
    cell: str  # the id given to the cell that shows it


def messages(text: str) -> list[tuple[str, str]]:
    """The (class, message) pairs of an output's text, in order, without repeats: each message whole.

    >>> messages("step 1\\nRuntimeError: FSDP does not support deepcopy. Please use state dict\\n")
    [('RuntimeError', 'FSDP does not support deepcopy. Please use state dict')]
    >>> messages("rank 1 raised torch.distributed.DistBackendError: Connection closed by peer")
    [('torch.distributed.DistBackendError', 'Connection closed by peer')]
    >>> messages("caught: {'AssertionError: got {torch.bfloat16, torch.float32}'}")  # printed in a set's repr
    [('AssertionError', 'got {torch.bfloat16, torch.float32}')]
    >>> messages("torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped")
    [('torch._dynamo.exc.Unsupported', 'Attempted to call function marked as skipped')]
    >>> messages("{'UserWarning: a', 'FutureWarning: b (on ranks 0, 1)'}")  # two in one repr, each whole
    [('UserWarning', 'a'), ('FutureWarning', 'b')]
    >>> messages("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \\n=====\\ntrain.py FAILED\\n")
    [('torch.distributed.elastic.multiprocessing.errors.ChildFailedError', 'train.py FAILED')]
    >>> messages("RuntimeError: Error(s) in loading state_dict for Linear:\\n\\tsize mismatch for weight: x.\\nnext")
    [('RuntimeError', 'Error(s) in loading state_dict for Linear: size mismatch for weight: x.')]
    """
    found = []
    at = 0
    while match := MESSAGE.search(text, at):
        at = match.end()
        line_start = text.rfind("\n", 0, match.start(1)) + 1
        message, cut = _outside_its_quotes(match.group(2).strip(), text[line_start : match.start(1)])
        if cut is not None:  # the rest of the repr may hold more messages: look there too
            at = match.start(2) + cut + 1
        elif message.endswith(":") and (details := INDENTED.match(text, match.end())):
            # "Error(s) in loading state_dict for Linear:" says what only its indented lines name
            message = " ".join([message, *details.group(0).split()])
            at = details.end()
        message = re.sub(r"\s*\(on ranks? [\d, ]+\)?$", "", message)  # the launcher's summary of warnings
        pair = (match.group(1), message)
        if pair not in found:
            found.append(pair)
    for match in BOXED.finditer(text):
        if (pair := (match.group(1), match.group(2).strip())) not in found:
            found.append(pair)
    return found


def tables_as_lines(text: str) -> str:
    """An output's text with each HTML table in it (a displayed ``fsdp_guide.table.Table``, which the
    site shows as raw HTML) turned into its cells' text, one cell a line: a message in a cell is then
    found whole, as in the table's text form, and not run on into the next cells' markup.

    >>> tables_as_lines('<table><tr><td>4</td><td>RuntimeError: shape &#x27;[2]&#x27; is invalid</td></tr></table>')
    "4\\nRuntimeError: shape '[2]' is invalid\\n"
    >>> messages(tables_as_lines('<table><tr><th>a</th></tr><tr><td>ValueError: x</td><td>2</td></tr></table>'))
    [('ValueError', 'x')]

    The per-rank output of live ranks (``%%ranks``) too, each group's lines as they were printed:

    >>> from fsdp_guide.live import Output
    >>> messages(tables_as_lines(Output([[("stderr", "NameError: name 'x' is not defined")]])._repr_html_()))
    [('NameError', "name 'x' is not defined")]
    """

    def cells(table: re.Match) -> str:
        return html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"</t[dh]>", "\n", table.group(0))))

    def ranks(block: re.Match) -> str:  # a displayed fsdp_guide.live.Output: a label, then its lines
        return html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"</div>", "\n", block.group(0)))) + "\n"

    text = re.sub(r'<div class="fsdp-guide-ranks">.*?</pre></div>', ranks, text, flags=re.S)
    return re.sub(r"<table\b.*?</table>", cells, text, flags=re.S)


def _unescaped(text: str, quote: str) -> list[int]:
    """Where ``quote`` occurs in ``text`` not escaped by a backslash (as a repr escapes it)."""
    return [i for i, c in enumerate(text) if c == quote and not (i and text[i - 1] == "\\")]


def _outside_its_quotes(message: str, before: str) -> tuple[str, int | None]:
    """The message without the rest of the repr it was printed in, and where it was cut (None if not).

    ``before`` is its line up to the exception's class. A message printed in a quoted string
    (a list's, a set's or a dict's repr) is inside an open quote there (an odd number of
    them), and ends at the first unescaped such quote: a repr quotes a string with a quote
    it does not contain, or escapes it. A message not in quotes is kept whole: its own
    brackets and quotes are part of it."""
    open_quotes = [(_unescaped(before, q)[-1], q) for q in ("'", '"') if len(_unescaped(before, q)) % 2]
    # a repr's opening quote follows a bracket, a comma, a colon or a space ("rank 1's" is no quote)
    open_quotes = [(i, q) for i, q in open_quotes if i == 0 or before[i - 1] in "[{(,: "]
    if not open_quotes:
        return message, None
    quote = max(open_quotes)[1]  # the innermost: the one opened last
    ends = _unescaped(message, quote)
    if not ends:
        return message, None
    return message[: ends[0]].replace("\\" + quote, quote), ends[0]


INDEX_PAGE = "docs/errors"

# A distinctive part of each message -> the fix in one line, with a reference to where it
# is executed (reStructuredText). The first key found in a message is its fix.
FIXES = {
    # loading weights into a sharded model (before "got mixed ...", which this message contains)
    "While copying the parameter named": "A full state dict given to ``load_state_dict`` of a sharded model (its "
    "parameters are DTensors): ``set_model_state_dict(model, full, options=StateDictOptions("
    "full_state_dict=True))``, :ref:`llm-load-errors`.",
    "_orig_mod.": "A checkpoint saved through ``torch.compile(module)``'s wrapper: compile in place with "
    "``module.compile()``, or drop the ``_orig_mod.`` from the names: :ref:`compile-names`.",
    "size mismatch for": "Weights of other shapes: one rank's shards (load sharded checkpoints with DCP, which "
    "reshards) or another model's (load into the model they were saved from): :ref:`llm-load-errors`. LoRA "
    "adapters saved from one rank's local tensors hold part of each matrix: gather them with the full state dict "
    "(:ref:`tip-qlora-save-full-adapters`).",
    "Cannot access accelerator device when none is available": "Pinned host memory asked for on a machine "
    "without an accelerator: ``CPUOffloadPolicy`` pins by default (``fsdp_config['cpu_offload']``, "
    ":ref:`fsdp-config-map-generated`); offloading needs a GPU to offload from, or "
    "``CPUOffloadPolicy(pin_memory=False)``.",
    "Attempted to access the data pointer on an invalid python storage": "``safetensors`` was given a ``DTensor``: "
    "``peft``'s ``save_pretrained`` on a model sharded by FSDP2. Gather a full state dict on every rank and pass it "
    "as ``state_dict=`` on rank 0 (:ref:`tip-qlora-save-full-adapters`).",
    "Merge lora module to 4-bit linear": "Merging re-quantises, rounding much of each adapter's update away: "
    "merge into the base dequantised first (:ref:`tip-qlora-merge-dequantised`).",
    "Missing key in checkpoint state_dict": "The model asks DCP for a key the checkpoint lacks: load into the model "
    "it was saved from, then change it (or ``DefaultLoadPlanner(allow_partial_load=True)``): "
    ":ref:`llm-load-errors`.",
    "Size mismatch between saved": "The model's global shape differs from the checkpoint's: load into the model it "
    "was saved from, then change it: :ref:`llm-load-errors`.",
    # live ranks (fsdp_guide.live)
    "did not end the cell within": "A cell failed on one rank while another waited in a collective: the live "
    "ranks were restarted, empty; run their set-up cells again: :ref:`shown <interactive-failure>`.",
    "name 'loss' is not defined": "A name no cell defined on that rank: each live rank has a namespace of its own, "
    "and a variable set under ``if rank == 0:`` exists on rank 0 only: :ref:`shown <interactive-failure>`.",
    # starting the ranks
    "environment variable RANK expected, but not set": "A torchrun script started with ``python``: start it with "
    "``torchrun --nproc-per-node=N`` (from a notebook, ``fsdp_guide.launch``): :ref:`cluster-launch-errors`.",
    "Default process group has not been initialized": "A collective before ``init_process_group`` (or a script not "
    "started by torchrun): :ref:`cluster-launch-errors`.",
    ".py FAILED": "torchrun's summary, not the error: find the root-cause rank in the box, then that rank's own "
    "lines above it: :ref:`cluster-launch-errors`.",
    "by peer": 'Another rank exited in the middle of a collective (gloo\'s "Connection closed by peer" or '
    '"reset by peer"): this is a consequence; find the rank that failed first (torchrun\'s root cause): '
    ":ref:`cluster-launch-errors`.",
    "EADDRINUSE": "Another job holds ``MASTER_PORT``: a port of its own for each job, or ``torchrun --standalone`` "
    "on one machine: :ref:`cluster-launch-errors`.",
    "waiting for clients": "Rank 0 waited for ranks that never connected: every node started, with the same "
    "``--nnodes`` and endpoint, and able to reach it: :ref:`cluster-launch-errors`.",
    "while trying to connect to": "No store answers at ``MASTER_ADDR:MASTER_PORT``: rank 0 not started, or the "
    "address wrong or unreachable: :ref:`cluster-launch-errors`.",
    "doesn't have NCCL built in": 'A torch without NCCL (a CPU build): ``gloo``, and ``"cpu:gloo,cuda:nccl"`` '
    "only where CUDA is: :ref:`cluster-launch-errors`.",
    "No backend type associated with device type cpu": "A collective on CPU tensors (CPU offload, ``full_tensor()`` "
    'of CPU shards) in a group without a CPU backend (``"nccl"``, or no backend on a GPU machine): '
    '``init_process_group("cpu:gloo,cuda:nccl")``, :ref:`cluster-launch-errors`.',
    "Mesh should not be bigger than default world size": "A mesh shape whose product is not the world size: "
    "(nodes, ranks per node) for ``WORLD_SIZE`` ranks, :ref:`cluster-launch-errors`.",
    # models built on the meta device
    "should be materialized from meta device": "``to_empty(device=...)``, then initialise, before the first forward: "
    ":ref:`a forward before to_empty, and .to() on meta <deterministic-init-meta-errors>`.",
    "Cannot copy out of meta tensor": "``to_empty(device=...)``, not ``.to(device)``, for a model on ``meta``: "
    ":ref:`a forward before to_empty, and .to() on meta <deterministic-init-meta-errors>`.",
    # FSDP1's FlatParameter
    "Must flatten tensors with uniform dtype": "FSDP1 flattens a unit into one dtype: the odd module a unit of its "
    "own (or FSDP2, which asks it only of trainable parameters): :ref:`migration-fsdp1-errors`.",
    "Must flatten tensors with uniform `requires_grad`": "Frozen and trainable parameters in one FSDP1 unit: "
    "``use_orig_params=True`` (or FSDP2): :ref:`migration-fsdp1-errors`.",
    "Cannot flatten integer dtype tensors": "A quantised (integer) parameter in an FSDP1 unit: "
    "``ignored_states=[it]``, or FSDP2: :ref:`migration-fsdp1-errors`.",
    "should only be called on the root FSDP instance": "Call ``clip_grad_norm_`` on the root FSDP1 module (FSDP2: "
    "``torch.nn.utils.clip_grad_norm_``): :ref:`migration-fsdp1-errors`.",
    "FSDP needs a non-CPU accelerator device": 'FSDP1 on CPU ranks: ``device_id=torch.device("cpu")`` with gloo: '
    ":ref:`migration-fsdp1-errors`.",
    "switching to use `NO_SHARD`": "One rank has nothing to shard: test sharding on 2 ranks or more, "
    ":ref:`migration-fsdp1-errors`.",
    "'weight' must be 2-D": "An FSDP1 submodule called outside the root's forward (``generate``, a helper): run it "
    "inside ``summon_full_params(model, recurse=False)``, "
    ":ref:`calls outside the root's forward <summon-outside-forward>`.",
    "out of bounds for storage of size 0": "An FSDP1 parameter used outside the root's forward, its storage freed: "
    "run the call inside ``summon_full_params(model, recurse=False)``, "
    ":ref:`calls outside the root's forward <summon-outside-forward>`.",
    # activation checkpointing
    "element 0 of tensors does not require grad": "Reentrant activation checkpointing where no input requires "
    "grad (a frozen embedding): ``use_reentrant=False``, or ``enable_input_require_grads()``: "
    ":ref:`reentrant checkpointing on a frozen input <pitfalls-reentrant-frozen-input>`.",
    "None of the inputs have requires_grad=True": "Reentrant activation checkpointing records no graph: "
    "``use_reentrant=False``, :ref:`reentrant checkpointing on a frozen input <pitfalls-reentrant-frozen-input>`.",
    "_foreach_norm.Scalar got mixed torch.Tensor and DTensor": "Gradient clipping over DTensors and plain tensors "
    "(ignored parameters, or parameters TP left plain): a norm per group, combined, each group scaled by it: "
    ":ref:`clipping beside ignored parameters <fsdp2-ignored-params-clipping>`, :ref:`tp-clipping`.",
    "got mixed torch.Tensor and DTensor": "A method other than ``forward`` meets sharded parameters: "
    ":ref:`register_fsdp_forward_method <fsdp2-register-fsdp-forward-method>`; under TP, plain tensors beside "
    "DTensors: :ref:`implicit_replication <tp-implicit-replication>`.",
    "in-place operations that require placement changes": "Adafactor's in-place update of a partial DTensor norm "
    "is refused: use a pointwise optimizer (:ref:`pitfalls-pointwise-optimizers`).",
    "Muon only supports 2D parameters": "FSDP1 hands Muon flat 1-D shards; FSDP2 keeps each parameter 2-D: "
    ":ref:`pitfalls-pointwise-optimizers`; Muon on FSDP2 with two collectives a step: :ref:`tutorial-muon`.",
    "returned a view tensor": "Here from ``CommDebugMode``'s hooks, harmless "
    "(:ref:`pitfalls-checkpoint-inside-unit` explains); in your own model, modify outputs out of place, or "
    "``.clone()`` them first.",
    "_scaled_dot_product_flash_attention_for_cpu": "Context parallelism replaces only the GPU attention kernels; "
    "run it on GPUs: :ref:`tp-context-parallel`.",
    "does not have a sharding strategy registered": "Work on ``to_local()`` shards, or ``register_sharding`` for the "
    "op: :ref:`tip-no-sharding-strategy`; from ``c10d.broadcast_`` loading a LoRA full state dict written by "
    "Accelerate 1.14 (it holds rank 0's DTensor slices), the file cannot be repaired: :ref:`peft-resume-check`.",
    "Attempted to call function marked as skipped": "Under ``fullgraph=True``, dynamo met FSDP2's hooks (wrapped in "
    "``torch._dynamo.disable``): compile each block after ``fully_shard``, not the root: :ref:`compile-where`.",
    "FSDP does not support deepcopy": "Keep an EMA as a copy of each shard instead of deep-copying the model: "
    ":ref:`beyond-ema`.",
    "must match the size of tensor b": "From a backward through torch's checkpointing of a Hugging Face model: the "
    "recomputed attention appended to the KV cache again; pass ``use_cache=False``: :ref:`tip-checkpoint-hf-cache`.",
    "Cannot access accelerator device": "``CPUOffloadPolicy(pin_memory=False)`` where there is no accelerator: "
    ":ref:`CPUOffloadPolicy <fsdp2-offloadpolicy>`.",
    "PREMUL_SUM with Gloo": "``set_force_sum_reduction_for_comms(True)`` on gloo: "
    ":ref:`set_force_sum_reduction_for_comms <fsdp2-fsdpmodule-set-force-sum-reduction-for-comms>`.",
    "uniform original parameter dtype": "One dtype among a unit's trainable parameters: "
    ":ref:`tip-lora-dtypes` (three fixes executed in :ref:`lora-dtypes`).",
    "got BFloat16 and Float": "Two dtypes met in one operation: find the bfloat16 operand. Shown here: a bfloat16 "
    "output into a float32 unit, fixed by ``output_dtype=torch.float32`` on the first unit's policy "
    "(:ref:`tip-mixed-policies-boundary`); an input, buffer or parameter outside FSDP's policy does the same.",
    "got Float and BFloat16": "Two dtypes met in one operation: find the float32 operand. Shown here: a float32 "
    "input into a bfloat16 unit, fixed by keeping ``cast_forward_inputs=True`` (the default, "
    ":ref:`tip-mixed-policies-boundary`); a buffer or parameter outside FSDP's policy does the same.",
    "already managed by another FSDP group": "Tied weights go in one unit: ``fully_shard([embedding, output])``, "
    ":ref:`tip-tied-weights-one-unit`.",
    "is invalid for input of size": "A ``view`` or ``reshape`` to a shape the tensor does not have (torch's "
    "generic message): check the shape against the tensor's size on this rank. Shown here under TP: head "
    "counts that do not divide by the TP degree (:ref:`tip-tp-gqa-heads`); and with 4-bit weights stored as "
    "bfloat16 under a ``MixedPrecisionPolicy`` that casts them (store them as uint8: :ref:`tip-qlora-uint8-storage`).",
    "an autograd kernel was not registered": "An op with no backward ran where gradients were needed, and nothing "
    "before it gets one. Shown here: bitsandbytes' CPU kernel for 4-bit weights an evaluation converted; set "
    "``support_avx512bf16_for_cpu = False`` on every ``Linear4bit`` (:ref:`tip-qlora-cpu-repack`).",
    "Use `set_gradient_divide_factor` instead": "Rename the call to ``set_gradient_divide_factor``: "
    ":ref:`the old name and the new, executed <fsdp2-fsdpmodule-set-reduce-scatter-divide-factor>`.",
    "`NO_SHARD` sharding strategy is deprecated": "Use DDP, or FSDP2 on a (world size, 1) mesh of replicate and "
    "shard dims, which is what ``fsdp_guide.shard`` does for NO_SHARD: :ref:`tip-fsdp-config`.",
    "Full backward hook is firing": "Here from ``CommDebugMode``'s backward hooks on a model whose input needs no "
    "gradient, harmless (:ref:`pitfalls-checkpoint-inside-unit` explains).",
    "_get_pg_default_device": "FSDP1's sharded state dicts: move to DCP's ``get_state_dict`` / ``set_state_dict`` "
    "(:ref:`tip-migrate-fsdp1-fsdp2`).",
    "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated": "Use DCP's ``get_state_dict`` / "
    "``set_state_dict``: :ref:`tip-migrate-fsdp1-fsdp2`.",
    "Multiple backends are registered with this ProcessGroup": "From FSDP1's sharded state dicts: move to DCP's "
    "``get_state_dict`` (:ref:`tip-migrate-fsdp1-fsdp2`).",
    "deprecating ShardedTensor": "FSDP2's parameters are DTensors already: :ref:`tip-migrate-fsdp1-fsdp2`.",
    "must have the same mesh": "Clip across meshes in one call per mesh, then combine the norms: "
    ":ref:`tip-clip-across-meshes`.",
    "inputs with different meshes": "Clip across meshes in one call per mesh, then combine the norms: "
    ":ref:`tip-clip-across-meshes`.",
    "failed to pass monitoredBarrier": "A rank never reached the collective: find the branch that differs "
    "between ranks, :ref:`tip-hangs-same-collectives`.",
    "Detected mismatch between collectives": "The ranks called different collectives: make every rank run the "
    "same ones in the same order, :ref:`tip-hangs-same-collectives`.",
    "did not finish within timeout": "A hang: dump the ranks' stacks and compare their collectives, "
    ":ref:`tip-hangs-tools`.",
    "DTensor random operators may not have complete support on cpu": "On a CPU mesh, initialise the full "
    "weights and shard them, not the shards in place: :ref:`tip-meta-init-cpu`.",
    "CPU parameters or buffers when `sync_module_states=True`": "``sync_module_states`` needs GPUs; on CPU, "
    "initialise every rank from one seed before sharding: :ref:`tutorial-deterministic-init`.",
    "Received data size doesn't match": "Experts that get no tokens on a rank: "
    ":ref:`set_reduce_scatter_unused_params(True) <fsdp2-fsdpmodule-set-reduce-scatter-unused-params>`.",
    # fsdp_guide's own checks of an fsdp_config, each message naming the value that would be right
    "unknown fsdp_config key": "The key the message suggests; every key: :ref:`fsdp-config-reference`.",
    "expected one of": "One of the values the message lists: :ref:`fsdp-config-reference`.",
    "expected a number of parameters": "A number, not a string: :ref:`fsdp-config-reference`.",
    "needs a world size divisible by it": "A ``data_parallel_shard_degree`` that divides the world size: "
    ":ref:`fsdp-config-reference`.",
    "cannot be honoured by FSDP2": "What the message suggests (FSDP2 always prefetches one unit ahead): "
    ":ref:`fsdp-config-reference`.",
    "needs the ranks on an accelerator": "``api='fsdp2'``, whose ``CPUOffloadPolicy(pin_memory=False)`` runs on "
    "CPU ranks: :ref:`CPUOffloadPolicy <fsdp2-offloadpolicy>`.",
    "was killed by SIGKILL": "A rank died mid-save: the last complete checkpoint stays, resume from it "
    "(:ref:`tip-exact-resume`).",
    "Ignoring pin_memory flag for checkpoint staging": "DCP's ``DefaultStager`` on a CPU: pass "
    "``StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)``, :ref:`tip-export-every-rank-writes`.",
    "Non-blocking copy requires that the current accelerator": "DCP's ``DefaultStager`` on a CPU: pass "
    "``StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)``, :ref:`tip-export-every-rank-writes`.",
}


class errors_index(nodes.General, nodes.Element):
    """Where the table goes, once every page has been read."""


def fix_key(message: str) -> str | None:
    """The key of ``FIXES`` that a message contains, or None if it has no fix yet."""
    return next((key for key in FIXES if key in message), None)


def torch_version() -> str:
    return version("torch").split("+")[0]


def setup(app):
    from sphinx.util.docutils import SphinxDirective

    class ErrorsIndex(SphinxDirective):
        def run(self):
            # The fixes are parsed here, with the page, so that their references are resolved
            # as the page's are; the list of messages, which needs every page, replaces the
            # node (and takes its fixes) once the references are resolved.
            self.env.note_dependency(__file__)
            node = errors_index()
            for key, line in FIXES.items():
                paragraph = nodes.paragraph("", "fix: ", classes=["errors-fix"], fix_key=key)
                paragraph += self.parse_inline(line)[0]
                node += paragraph
            return [node]

    def outputs_text(cell) -> str:
        return "\n".join(
            tables_as_lines(node.astext())  # a displayed Table is raw HTML: its cells, a line each
            for node in cell.findall(nodes.Element)
            if node.get("nb_element") == "cell_code_output"
        )

    def collect(app, doctree):
        env = app.env
        if not hasattr(env, "fsdp_errors"):
            env.fsdp_errors = {}
        env.fsdp_errors.pop(env.docname, None)
        found = []
        for cell in doctree.findall(nodes.container):
            if cell.get("nb_element") != "cell_code":
                continue
            pairs = messages(outputs_text(cell))
            if not pairs:
                continue
            cell_id = f"error-{cell['cell_index']}"
            cell["ids"].append(cell_id)
            doctree.ids[cell_id] = cell
            found += [Found(kind, message, env.docname, cell_id) for kind, message in pairs]
        if found:
            env.fsdp_errors[env.docname] = found

    def purge(app, env, docname):
        getattr(env, "fsdp_errors", {}).pop(docname, None)

    def merge(app, env, docnames, other):
        env.fsdp_errors = {**getattr(env, "fsdp_errors", {}), **getattr(other, "fsdp_errors", {})}

    def index_is_outdated(app, env, added, changed, removed):
        # The index shows every page's errors: read it again whenever another page is.
        return [INDEX_PAGE] if (added | changed | removed) - {INDEX_PAGE} and INDEX_PAGE in env.found_docs else []

    def entries(app, fromdocname, fixes) -> nodes.bullet_list:
        """A list item per message (the class and message as printed), with every cell that shows it."""
        shown = {}
        for page in sorted(app.env.fsdp_errors):
            for entry in app.env.fsdp_errors[page]:
                shown.setdefault((entry.kind, entry.message), []).append(entry)
        items = nodes.bullet_list(classes=["errors-index"])
        for (kind, message), where in sorted(shown.items(), key=lambda item: (item[0][1].lower(), item[0][0])):
            links = nodes.paragraph("", "shown in ", classes=["errors-where"])
            for n, entry in enumerate(where):
                uri = app.builder.get_relative_uri(fromdocname, entry.page) + "#" + entry.cell
                links += [nodes.Text(", ")] if n else []
                links += nodes.reference("", app.env.titles[entry.page].astext(), internal=True, refuri=uri)
            links += nodes.Text(f" · torch {torch_version()}")
            item = nodes.list_item()
            item += nodes.paragraph("", "", nodes.literal(text=f"{kind}: {message}"))
            item += links
            key = fix_key(message)
            item += (
                fixes[key].deepcopy() if key else nodes.paragraph("", "fix: none written yet", classes=["errors-fix"])
            )
            items += item
        return items

    def resolve(app, doctree, fromdocname):
        for node in list(doctree.findall(errors_index)):
            fixes = {paragraph["fix_key"]: paragraph for paragraph in node.children}
            node.replace_self(entries(app, fromdocname, fixes))

    app.add_node(errors_index)
    app.add_directive("errors-index", ErrorsIndex)
    app.connect("doctree-read", collect)
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    app.connect("doctree-resolved", resolve)
    app.connect("env-get-outdated", index_is_outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
