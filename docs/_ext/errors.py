"""The errors index: every error and warning message a page's executed output shows, found at build time.

While Sphinx reads an executed page, each code cell whose output has a line like
``RuntimeError: FSDP does not support deepcopy`` gets an id (``error-<cell>``) and each such
message is kept (``found``); ``.. errors-index::`` becomes a table of them, linked to their
cells, once every page is read. Nothing is typed but the fix: ``FIXES`` maps a distinctive
part of each message to the one-line fix and the label of the cell that executes it, and
``tests/test_site.py`` fails for a message without one, so a new page's errors appear in
the index and ask for their fix.

Sphinx is imported only by ``setup``; docutils, which it builds on, at the top (Sphinx
pickles the page with the placeholder node, whose class must then be importable).
"""

from __future__ import annotations

import re
from importlib.metadata import version
from typing import NamedTuple

from docutils import nodes

# An exception or warning class (possibly dotted: torch._dynamo.exc.Unsupported), an
# optional "(details)" and the message. Not inside a longer word or a dotted name.
MESSAGE = re.compile(r"(?<![\w.])((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Warning|Expired|Unsupported|Failed))"
                     r"(?: \([^)]*\))?: (\S.*)")


class Found(NamedTuple):
    kind: str  # the exception or warning class, as printed
    message: str  # its first line, as printed
    page: str  # the docname
    cell: str  # the id given to the cell that shows it


def messages(text: str) -> list[tuple[str, str]]:
    """The (class, message) pairs of an output's text, in order, without repeats.

    >>> messages("step 1\\nRuntimeError: FSDP does not support deepcopy. Please use state dict\\n")
    [('RuntimeError', 'FSDP does not support deepcopy. Please use state dict')]
    >>> messages("rank 1 raised torch.distributed.DistBackendError: Connection closed by peer")
    [('torch.distributed.DistBackendError', 'Connection closed by peer')]
    """
    found = []
    for match in MESSAGE.finditer(text):
        message = match.group(2).strip().rstrip("'\"},")  # printed inside a set's or a dict's repr
        message = re.sub(r"\s*\(on ranks? [\d, ]+\)?$", "", message)  # the launcher's summary of warnings
        pair = (match.group(1), message.rstrip("'\"}),"))
        if pair not in found:
            found.append(pair)
    return found


INDEX_PAGE = "docs/errors"


class errors_index(nodes.General, nodes.Element):
    """Where the table goes, once every page has been read."""


def torch_version() -> str:
    return version("torch").split("+")[0]


def setup(app):
    from sphinx.util.docutils import SphinxDirective

    class ErrorsIndex(SphinxDirective):
        def run(self):
            return [errors_index()]

    def outputs_text(cell) -> str:
        return "\n".join(node.astext() for node in cell.findall(nodes.Element)
                         if node.get("nb_element") == "cell_code_output")

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

    def entries(app, fromdocname) -> nodes.bullet_list:
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
            items += item
        return items

    def resolve(app, doctree, fromdocname):
        for node in list(doctree.findall(errors_index)):
            node.replace_self(entries(app, fromdocname))

    app.add_node(errors_index)
    app.add_directive("errors-index", ErrorsIndex)
    app.connect("doctree-read", collect)
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    app.connect("doctree-resolved", resolve)
    app.connect("env-get-outdated", index_is_outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
