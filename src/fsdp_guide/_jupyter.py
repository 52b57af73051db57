"""The pages' MyST references as Markdown links that JupyterLab renders and follows (``nox -s lab``).

Sphinx resolves ``{ref}``, ``{doc}``, ``{func}`` and ``{term}`` across the whole site;
JupyterLab (with jupyterlab-myst) sees one notebook: it links a reference to a target in
the same page, and shows the rest as plain text leading nowhere. ``ContentsManager`` is
jupytext's contents manager with two steps added, so that the ``.py`` pages stay as
Sphinx reads them:

- when a page is opened, :func:`to_jupyter` makes each reference to another page a link
  to that page's file: a tutorial opens as a notebook at the cell of the section, a
  ``docs/*.rst`` page opens in the editor on the line of the section's title, an API name
  on its ``auto...`` entry in the API reference, a glossary term on the term. The link's
  title keeps the reference as written. References within the page, and the
  ``(label)=`` targets, stay as they are: jupyterlab-myst links those itself.
- when it is saved, :func:`from_jupyter` turns every such link back into the reference
  its title holds, in edited cells too, so a save leaves the ``.py`` as it was. A link
  whose text the reader changed becomes the reference with that text as its own. Only
  the links the server made are turned back: each carries what it takes in its title, the
  reference as written and a digest of the text it was made with (``fsdp:<digest>``), so
  it turns back whatever happened since it was served (the server restarted, the files it
  links to changed and their lines moved, the cell was copied into another page). Its
  url is not looked at, for that reason: a made link whose url the reader changed turns
  back too. A reader's own link, without the digest, stays as written, whatever its
  title looks like.

Written by hand: neither jupytext nor jupyterlab-myst resolves references across files,
and Sphinx's own resolution needs a build of the whole site.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import posixpath
import re
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

__all__ = ["Target", "find_targets", "to_jupyter", "from_jupyter"]  # and ContentsManager, built on first use

# The pages, relative to the site's root (the folder with conf.py): where targets are defined.
PAGES = ("*.rst", "docs/*.rst", "docs/*.py", "tutorials/*.py")

LABEL = r"(?P<label>[A-Za-z0-9_-]{1,64})"  # a label that is also a valid notebook cell id
ROLE = re.compile(r"\{(?P<role>ref|doc|term|download|func|class|meth|exc|attr|mod)\}`(?P<body>[^`]+)`")
PLAIN = ("ref", "doc", "term", "download")  # roles Sphinx shows as text; the others show an API name, as code
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)
TARGET_LINE = re.compile(rf"^\({LABEL}\)=$", re.M)  # a MyST target, in a markdown cell
PY_TARGET = re.compile(rf"^# \({LABEL}\)=$")  # the same, in the py:percent file
PY_HEADING = re.compile(r"^# #+ (?P<title>.+)$")
RST_TARGET = re.compile(rf"^\.\. _{LABEL}:$")
RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1+$")
RST_AUTODOC = re.compile(r"^\.\. auto(?:function|class|exception|method|data|attribute)::\s+(?P<name>\S+)")
RST_MEMBERS = re.compile(r"^\s+:members:\s+(?P<names>.+)$")
# A link as to_jupyter writes it, and as from_jupyter finds it after a reader's edit: its
# text may hold backslash escapes and [balanced] brackets but no lone one, so a "[" earlier
# in the cell (an interval "[0, N)") cannot start a match; its url is percent-encoded (no
# space or parenthesis to end it); its title is in double quotes, \" and \\ escaped.
LINK = re.compile(
    r"\[(?P<text>(?:\\.|\[(?:\\.|[^][\\])*\]|[^][\\])*)\]"
    r'\((?P<url>[^\s()<>"\\]+) "(?P<title>(?:\\.|[^"\\])*)"\)',
    re.S,
)
# A made link's title, unescaped: the reference as written, and the digest of the link's text as made.
MADE = re.compile(r"(?P<written>.+) fsdp:(?P<digest>[0-9a-f]{8})", re.S)


def _digest(written: str, text: str) -> str:
    """What a made link's title records of its text (on one line), to tell an edited text from the one made."""
    return hashlib.sha256(f"{written}\0{' '.join(text.split())}".encode()).hexdigest()[:8]


log = logging.getLogger(__name__)


class Target(NamedTuple):
    """Where a label, a page, an API name or a glossary term is defined, as a link from a notebook needs it."""

    path: str  # relative to the site's root, with "/"
    title: str  # what Sphinx shows for a reference without its own text
    anchor: str  # the URL fragment JupyterLab follows: "cell-id=<id>" in a notebook, "line=<n>" (from 0) in a text file


def _plain(title: str) -> str:
    """A title as Sphinx shows it in a reference: the text, without inline-code markup."""
    return title.replace("``", "").replace("`", "").strip()


def _py_targets(path: str, lines: list[str]) -> dict[str, Target]:
    """The labels of a notebook page. Each opens its cell, whose id is the cell's first label.

    Two sections in one markdown cell open at the same cell (its top): a cell id is all a
    link into a notebook can name that JupyterLab finds before the cells are rendered.
    """
    targets, cell_label = {}, None
    for i, line in enumerate(lines):
        if line.startswith("# %%"):
            cell_label = None  # a new cell
        if match := PY_TARGET.match(line):
            cell_label = cell_label or match["label"]
            heading = next((h for rest in lines[i + 1 : i + 3] if (h := PY_HEADING.match(rest))), None)
            title = _plain(heading["title"]) if heading else match["label"]
            on_top = heading is not None and heading[0].startswith("# # ")  # the page's title: open it at the top
            targets[match["label"]] = Target(path, title, "" if on_top else f"cell-id={cell_label}")
    first = next((h for line in lines if (h := PY_HEADING.match(line))), None)
    targets["doc:" + path.rsplit(".", 1)[0]] = Target(path, _plain(first["title"]) if first else path, "")
    return targets


def _rst_targets(path: str, lines: list[str]) -> dict[str, Target]:
    """The labels, API entries and glossary terms of a reStructuredText page, each on its line."""

    def is_title(j: int) -> bool:
        return j + 1 < len(lines) and bool(lines[j].strip()) and bool(RST_UNDERLINE.match(lines[j + 1].strip()))

    targets, in_glossary, documented = {}, False, None  # documented: the last auto... entry, (name, line)
    for i, line in enumerate(lines):
        if (match := RST_TARGET.match(line)) and (j := next((j for j in range(i + 1, i + 4) if is_title(j)), None)):
            targets[match["label"]] = Target(path, _plain(lines[j]), f"line={j}")
        if match := RST_AUTODOC.match(line):
            documented = match["name"], i
            targets["py:" + match["name"]] = Target(path, match["name"], f"line={i}")
        elif (match := RST_MEMBERS.match(line)) and documented:  # members are documented under their class
            for member in match["names"].split(","):
                targets[f"py:{documented[0]}.{member.strip()}"] = Target(path, documented[0], f"line={documented[1]}")
        if line.startswith(".. glossary::"):
            in_glossary = True
        elif line and not line.startswith(" "):
            in_glossary = False
        # a term: indented once (not an option); its definition, twice
        elif in_glossary and re.match(r"^   [^\s:]", line):
            targets["term:" + line.strip().lower()] = Target(path, line.strip(), f"line={i}")
    top = next((j for j in range(len(lines)) if is_title(j)), None)
    targets["doc:" + path.rsplit(".", 1)[0]] = Target(path, _plain(lines[top]) if top is not None else path, "")
    return targets


def find_targets(root: Path) -> dict[str, Target]:
    """Every target of the site under ``root`` (the folder with ``conf.py``).

    Keys: a label; ``doc:<path without suffix>`` for a page; ``py:<name>`` for an API
    entry; ``term:<term, lower case>`` for a glossary term.

    >>> targets = find_targets(Path(__file__).parents[2])  # the repository, in a checkout
    >>> targets["tip-describe-sharding"].path, targets["quickstart-tips"].anchor
    ('docs/fsdp_tips.rst', 'cell-id=quickstart-tips')
    >>> targets["fsdp2-unshardhandle"].anchor  # a later label of the cell that opens with another
    'cell-id=fsdp2-fsdpmodule-set-modules-to-forward-prefetch'
    >>> targets["py:fsdp_guide.launch"].path, targets["term:shard"].path
    ('docs/fsdp.rst', 'docs/glossary.rst')
    """
    targets: dict[str, Target] = {}
    for pattern in PAGES:
        for file in sorted(root.glob(pattern)):
            path, lines = file.relative_to(root).as_posix(), file.read_text(encoding="utf-8").splitlines()
            targets.update(_py_targets(path, lines) if file.suffix == ".py" else _rst_targets(path, lines))
    return targets


def _link(page: str, target: Target, written: str, text: str) -> tuple[str, str]:
    """The url and the title of a Markdown link from ``page`` to ``target`` with ``text``: the title, the reference
    as written and the digest of the text, escaped for Markdown's double quotes."""
    url = quote(posixpath.relpath(target.path, posixpath.dirname(page) or "."))  # JupyterLab decodes "%20" and the like
    title = f"{written} fsdp:{_digest(written, text)}"
    return url + ("#" + target.anchor if target.anchor else ""), re.sub(r'(["\\])', r"\\\1", title)


def _api_name(role: str, name: str) -> str:
    """An API name as Sphinx shows it: ``~`` keeps the last part, functions and methods get ``()``."""
    name = name.lstrip(".!").removesuffix("()")
    shown = name[1:].rsplit(".", 1)[-1] if name.startswith("~") else name
    return f"{shown}()" if role in ("func", "meth") else shown


def _reference(role: str, title: str | None, name: str, page: str) -> tuple[str, str | None]:
    """The key of what a reference points at, and the text Sphinx would show (None: the target's title)."""
    if role == "ref":
        return name, title
    if role == "doc":  # relative to the page, or to the root with a leading "/"
        return "doc:" + posixpath.normpath(posixpath.join(posixpath.dirname(page), name)).lstrip("/"), title
    if role == "term":
        return "term:" + name.lower(), title or name
    if role == "download":  # a file, relative to the page or the root (a page's script): shown as written
        if "://" in name:
            return "url:" + name, title  # a remote file: no target, left as written
        return "file:" + posixpath.normpath(posixpath.join(posixpath.dirname(page), name)).lstrip("/"), title or name
    return "py:" + name.lstrip(".!~").removesuffix("()"), f"`{title}`" if title else f"`{_api_name(role, name)}`"


def to_jupyter(markdown: str, page: str, targets: dict[str, Target]) -> str:
    """A markdown cell of ``page`` with its references to other pages made into links.

    >>> targets = {"tip-x": Target("docs/fsdp_tips.rst", "A [1] tip", "line=10"),
    ...            "here": Target("tutorials/a.py", "Here", "cell-id=here"),
    ...            "py:fsdp_guide.launch": Target("docs/my api.rst", "fsdp_guide.launch", "line=350")}
    >>> to_jupyter("See {ref}`tip-x` and {ref}`here`.", "tutorials/a.py", targets)
    'See [A \\\\[1\\\\] tip](../docs/fsdp_tips.rst#line=10 "{ref}`tip-x` fsdp:025e43f8") and {ref}`here`.'
    >>> to_jupyter("{func}`fsdp_guide.launch`", "tutorials/a.py", targets)
    '[`fsdp_guide.launch()`](../docs/my%20api.rst#line=350 "{func}`fsdp_guide.launch` fsdp:4225302a")'
    >>> to_jupyter("{download}`scripts/a.py`", "tutorials/a.py", {})  # a file beside the page
    '[scripts/a.py](scripts/a.py "{download}`scripts/a.py` fsdp:473a3e05")'
    >>> to_jupyter("{download}`/docs/x.py`", "tutorials/a.py", {})  # from the root
    '[/docs/x.py](../docs/x.py "{download}`/docs/x.py` fsdp:e82f5082")'
    """

    def rewrite(match: re.Match) -> str:
        titled = TITLED.match(match["body"])
        title, name = (titled["title"], titled["target"]) if titled else (None, match["body"])
        key, text = _reference(match["role"], title, name, page)
        target = Target(key.removeprefix("file:"), text, "") if key.startswith("file:") else targets.get(key)
        if target is None or target.path == page:
            return match[0]  # within the page (jupyterlab-myst links it), or not found: as written
        if match["role"] in PLAIN:  # text, where a bracket would end the link's: escaped
            text = re.sub(r"([][\\])", r"\\\1", text or target.title)
        url, title = _link(page, target, match[0], text)
        link = f'[{text}]({url} "{title}")'
        if not LINK.fullmatch(link):
            return match[0]  # one from_jupyter would not find (a lone bracket in an API name's code): as written
        return link

    return ROLE.sub(rewrite, markdown)


def _with_text(written: str, text: str) -> str | None:
    """The reference ``written`` with a link text the reader typed as its own text; None if no reference can show it."""
    role, body = ROLE.fullmatch(written).group("role", "body")
    name = titled["target"] if (titled := TITLED.match(body)) else body
    if role not in PLAIN:
        name = name.lstrip("~")  # "~" shortens Sphinx's own text; before an explicit one, it would break the target
    if role not in PLAIN and (code := re.fullmatch(r"`([^`]+)`", text)):
        title = code[1]  # an API name, as code: Sphinx shows it as code too
    else:
        title = re.sub(r"\\([!-/:-@[-`{-~])", r"\1", text)  # without Markdown's escapes, as the reader sees it
    title = " ".join(title.split())  # a role is on one line
    if not title or re.search("[`<]", title):
        return None  # a role cannot hold a backtick, and Sphinx would take a "<" for the start of the target
    return f"{{{role}}}`{title} <{name}>`"


def from_jupyter(markdown: str) -> str:
    """A markdown cell with each link :func:`to_jupyter` made turned back into its reference.

    The reference is as written, or, where the reader changed the link's text and a
    reference can show it, with that text as its own. Any other link stays as it is.

    >>> cell = to_jupyter("See {ref}`tip-x` or {ref}`tip-x`.", "tutorials/a.py",
    ...                   {"tip-x": Target("docs/fsdp_tips.rst", "A tip", "line=10")})
    >>> from_jupyter("In [0, 2) " + cell.replace("[A tip]", "[this tip]", 1))
    'In [0, 2) See {ref}`this tip <tip-x>` or {ref}`tip-x`.'
    >>> from_jupyter('[a site](https://a.b "{ref}`tip-x`")')
    '[a site](https://a.b "{ref}`tip-x`")'
    """

    def rewrite(match: re.Match) -> str:
        made = MADE.fullmatch(re.sub(r'\\(["\\])', r"\1", match["title"]))
        if made is None or not ROLE.fullmatch(made["written"]):
            return match[0]  # a link of the reader's own, whatever its title looks like
        if _digest(made["written"], match["text"]) == made["digest"]:  # unchanged, or only spread over other lines
            return made["written"]
        return _with_text(made["written"], match["text"]) or match[0]

    return LINK.sub(rewrite, markdown)


def _site_root(file: Path) -> Path | None:
    """The folder with conf.py above a page: where its targets are, wherever JupyterLab was started."""
    return next((parent for parent in file.parents if (parent / "conf.py").is_file()), None)


def _text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


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

    class ContentsManager(build_async_jupytext_contents_manager_class(AsyncLargeFileManager)):
        """jupytext's contents manager; notebooks open through :func:`to_jupyter`, save through :func:`from_jupyter`."""

        async def get(self, path, content=True, type=None, format=None, **kwargs):
            model = await super().get(path, content=content, type=type, format=format, **kwargs)
            if model["type"] == "notebook" and content:
                try:
                    self._add_links(model["content"], path)
                except Exception:  # a page that opens without links beats one that does not open
                    log.exception("fsdp_guide: could not make the references of %s into links", path)
            return model

        def _add_links(self, notebook: dict, path: str) -> None:
            file = Path(self.root_dir, path.strip("/")).resolve()
            root = _site_root(file)
            if root is None:
                return  # not a page of a site
            page, targets = file.with_suffix(".py").relative_to(root).as_posix(), find_targets(root)
            for cell in notebook["cells"]:
                if cell["cell_type"] == "markdown":
                    source = _text(cell["source"])
                    cell["source"] = to_jupyter(source, page, targets)
                    if label := TARGET_LINE.search(source):
                        cell["id"] = label["label"]  # what links from other pages open (see _py_targets)

        async def save(self, model, path=""):
            file = Path(self.root_dir, path.strip("/")).resolve()
            if model["type"] == "notebook" and _site_root(file):
                for cell in model["content"]["cells"]:
                    if cell["cell_type"] == "markdown":
                        cell["source"] = from_jupyter(_text(cell["source"]))
            return await super().save(model, path)

    return ContentsManager
