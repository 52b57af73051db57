"""The pages' MyST references as Markdown that JupyterLab renders and follows (``nox -s lab``).

Sphinx resolves ``{ref}``, ``{doc}``, ``{func}`` and ``{term}`` across the whole site;
JupyterLab (with jupyterlab-myst) sees one notebook: it resolves a reference to a target in
the same page, and shows the rest as plain text leading nowhere. ``ContentsManager`` is
jupytext's contents manager with two steps added, so the ``.py`` pages stay as Sphinx reads
them:

- when a page is opened, each markdown cell is rewritten by :func:`to_jupyter`: a
  reference to another page becomes a link to that page's file (a tutorial opens as a
  notebook at the cell of the section, ``docs/*.rst`` opens in the editor at the line),
  an API role becomes the name as code, a glossary term its text. References within the
  page, and the ``(label)=`` targets, stay as they are: jupyterlab-myst renders those.
- when it is saved, every markdown cell that still reads as it was opened gets its
  original text back, so saving leaves the ``.py`` as it is in git.

Written by hand: neither jupytext nor jupyterlab-myst resolves references across files,
and Sphinx's own resolution needs a build of the whole site.
"""

from __future__ import annotations

import functools
import posixpath
import re
from pathlib import Path
from typing import NamedTuple

__all__ = ["Target", "find_targets", "to_jupyter", "ContentsManager"]

# The pages, relative to the repository's root: where labels are defined.
PAGES = ("*.rst", "docs/*.rst", "docs/*.py", "tutorials/*.py")

ROLE = re.compile(r"\{(?P<role>ref|doc|term|func|class|meth|exc|attr|mod)\}`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)
PY_TARGET = re.compile(r"^# \((?P<label>[\w-]+)\)=$")
PY_HEADING = re.compile(r"^# #+ (?P<title>.+)$")
RST_TARGET = re.compile(r"^\.\. _(?P<label>[\w-]+):$")
RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1+$")


class Target(NamedTuple):
    """Where a label (or a document) is defined, as a link from a notebook needs it."""

    path: str  # relative to the repository's root, with "/"
    title: str  # what Sphinx shows for a reference without its own text
    anchor: str  # the URL fragment JupyterLab follows: "cell-id=<label>" in a notebook, "line=<n>" in a text file


def _plain(title: str) -> str:
    """A title as Sphinx shows it in a reference: the text, without inline-code markup."""
    return title.replace("``", "").replace("`", "").strip()


def _py_targets(path: str, lines: list[str]) -> dict[str, Target]:
    """The labels of a notebook page; each points at its cell (whose id is the cell's first label)."""
    targets, cell_label = {}, None
    for i, line in enumerate(lines):
        if line.startswith("# %%"):
            cell_label = None  # a new cell
        if match := PY_TARGET.match(line):
            cell_label = cell_label or match["label"]
            heading = next((h for rest in lines[i + 1:i + 3] if (h := PY_HEADING.match(rest))), None)
            title = _plain(heading["title"]) if heading else match["label"]
            on_top = heading is not None and heading[0].startswith("# # ")  # the page's title: open it at the top
            targets[match["label"]] = Target(path, title, "" if on_top else f"cell-id={cell_label}")
    first = next((h for line in lines if (h := PY_HEADING.match(line))), None)
    stem = path.rsplit(".", 1)[0]
    targets[f"/{stem}"] = Target(path, _plain(first["title"]) if first else stem, "")  # the page, for {doc}
    return targets


def _rst_targets(path: str, lines: list[str]) -> dict[str, Target]:
    """The labels of a reStructuredText page; each points at the line of the title after it."""
    def title_after(i: int) -> tuple[int, str] | None:
        for j in range(i + 1, min(i + 4, len(lines) - 1)):
            if lines[j].strip() and RST_UNDERLINE.match(lines[j + 1].strip()):
                return j, lines[j]
        return None

    targets = {}
    for i, line in enumerate(lines):
        if (match := RST_TARGET.match(line)) and (found := title_after(i)):
            targets[match["label"]] = Target(path, _plain(found[1]), f"line={found[0]}")  # JupyterLab counts lines from 0
    top = next(((i, lines[i]) for i in range(len(lines) - 1)
                if lines[i].strip() and RST_UNDERLINE.match(lines[i + 1].strip())), None)  # the page's title
    stem = path.rsplit(".", 1)[0]
    targets[f"/{stem}"] = Target(path, _plain(top[1]) if top else stem, "")
    return targets


def find_targets(root: Path) -> dict[str, Target]:
    """Every label of the site's pages under ``root``, and every page as ``/<path without suffix>``.

    >>> from pathlib import Path
    >>> targets = find_targets(Path(__file__).parents[2])  # the repository, in a checkout
    >>> targets["tip-describe-sharding"].path
    'docs/fsdp_tips.rst'
    >>> targets["tutorial-quickstart"].path, targets["quickstart-tips"].anchor
    ('tutorials/quickstart.py', 'cell-id=quickstart-tips')
    """
    targets: dict[str, Target] = {}
    for pattern in PAGES:
        for file in sorted(root.glob(pattern)):
            path, lines = file.relative_to(root).as_posix(), file.read_text().splitlines()
            targets.update(_py_targets(path, lines) if file.suffix == ".py" else _rst_targets(path, lines))
    return targets


def _link(page: str, target: Target) -> str:
    """The URL of a target, relative to the page that links to it."""
    url = posixpath.relpath(target.path, posixpath.dirname(page) or ".")
    return f"{url}#{target.anchor}" if target.anchor else url


def _role(match: re.Match, page: str, targets: dict[str, Target]) -> str:
    role, body = match["role"], match["body"]
    titled = TITLED.match(body)
    title, name = (titled["title"], titled["target"]) if titled else (None, body)
    if role == "term":
        return title or name
    if role in ("ref", "doc"):
        # {doc} names a page relative to this one, or to the root with a leading "/"
        key = name if role == "ref" else "/" + posixpath.normpath(posixpath.join(posixpath.dirname(page), name)).lstrip("/")
        target = targets.get(key)
        if target is None or target.path == page:
            return match[0]  # within the page (jupyterlab-myst links it), or unknown: left as written
        return f"[{title or target.title}]({_link(page, target)})"
    # An API role: the name as Sphinx shows it, as code (its reference is on the site, or help() in the kernel).
    shown = name.lstrip("~").rsplit(".", 1)[-1] if name.startswith("~") else name
    call = "()" if role in ("func", "meth") and not title else ""
    return f"`{title or shown + call}`"


def to_jupyter(markdown: str, page: str, targets: dict[str, Target]) -> str:
    """A markdown cell of ``page`` with its MyST roles made into what JupyterLab renders and follows.

    >>> targets = {"tip-x": Target("docs/fsdp_tips.rst", "A tip", "line=10"),
    ...            "other": Target("tutorials/b.py", "Section", "cell-id=other"),
    ...            "here": Target("tutorials/a.py", "Here", "cell-id=here")}
    >>> to_jupyter("See {ref}`tip-x`, {ref}`that <other>` and {ref}`here`.", "tutorials/a.py", targets)
    'See [A tip](../docs/fsdp_tips.rst#line=10), [that](b.py#cell-id=other) and {ref}`here`.'
    >>> to_jupyter("{func}`fsdp_guide.launch`, {class}`~fsdp_guide.gpt.GPT`, {term}`shards <shard>`", "tutorials/a.py", {})
    '`fsdp_guide.launch()`, `GPT`, shards'
    """
    return ROLE.sub(lambda match: _role(match, page, targets), markdown)


def cell_id(markdown: str) -> str | None:
    """The id a markdown cell gets: its first ``(label)=`` target, which links from other pages open at."""
    match = re.search(r"^\((?P<label>[\w-]+)\)=$", markdown, re.M)
    return match["label"] if match else None


def __getattr__(name: str):
    # Built on first use: jupytext and jupyter_server are in the `jupyter` extra, and the
    # rest of this module (and its doctests) must not need them.
    if name == "ContentsManager":
        return _contents_manager_class()  # cached: one class, however often it is asked for
    raise AttributeError(name)


@functools.cache
def _contents_manager_class():
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from jupytext.async_contentsmanager import build_async_jupytext_contents_manager_class

    base = build_async_jupytext_contents_manager_class(AsyncLargeFileManager)

    class ContentsManager(base):
        """jupytext's contents manager; notebooks open with :func:`to_jupyter` applied and save with it undone."""

        def _page(self, path: str) -> str | None:
            """The page a notebook path is: the .py itself, or the .py an .ipynb is paired with."""
            page = path.strip("/")
            page = page if page.endswith(".py") else page.rsplit(".", 1)[0] + ".py"
            return page if (Path(self.root_dir) / page).is_file() else None

        async def get(self, path, content=True, type=None, format=None, **kwargs):
            model = await super().get(path, content=content, type=type, format=format, **kwargs)
            page = self._page(path)
            if model["type"] == "notebook" and content and page:
                targets = find_targets(Path(self.root_dir))
                for cell in model["content"]["cells"]:
                    if cell["cell_type"] == "markdown":
                        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                        cell["source"] = to_jupyter(source, page, targets)
                        cell["id"] = cell_id(source) or cell.get("id")
            return model

        async def save(self, model, path=""):
            page = self._page(path)
            if model["type"] == "notebook" and page:
                self._restore(model["content"], page)
            return await super().save(model, path)

        def _restore(self, notebook: dict, page: str) -> None:
            """Give each markdown cell the reader did not edit its text as the page has it."""
            import jupytext

            targets = find_targets(Path(self.root_dir))
            saved = jupytext.read(Path(self.root_dir) / page)
            original = {to_jupyter(cell.source, page, targets): cell.source
                        for cell in saved.cells if cell.cell_type == "markdown"}
            for cell in notebook["cells"]:
                if cell["cell_type"] == "markdown":
                    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                    cell["source"] = original.get(source, source)

    return ContentsManager
