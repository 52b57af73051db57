"""Sphinx configuration of the FSDP Guide (the site's sources are index.rst, docs/ and tutorials/)."""

import os
import sys

sys.path.insert(0, os.path.abspath("src"))  # autodoc reads the package from the checkout
sys.path.insert(0, os.path.abspath("docs/_ext"))  # the site's own extensions

project = "The FSDP Guide"
author = "The FSDP Guide authors"
copyright = "2026, The FSDP Guide authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx_copybutton",
    "matplotlib.sphinxext.plot_directive",  # figures drawn at build time (the sharding diagram)
    "fsdp2_map",  # docs/_ext: the FSDP2 map's tables, generated from the installed torch
    "sphinx_design",  # the landing page's cards
    "landing",  # docs/_ext: the landing page's map of the tutorials, and the tips by goal
    "errors",  # docs/_ext: the errors index, collected from the executed outputs
    "execution",  # docs/_ext: the pages executed two at a time into the cache myst-nb reads
]
plot_include_source = False
plot_basedir = os.path.abspath(".")  # `.. plot:: docs/figures/...` from any page
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]

root_doc = "index"
# Only these are pages: with a .py notebook format, Sphinx would otherwise read conf.py,
# noxfile.py, src/ and tests/ as notebooks.
include_patterns = ["index.rst", "docs/**", "tutorials/*.py"]
# The .ipynb files Jupyter pairs with the pages (jupytext.toml) are the reader's, not sources.
exclude_patterns = [
    "_build",
    "docs/_ext",
    "docs/figures",
    "**/.ipynb_checkpoints",
    "**/__pycache__",
    "tutorials/*.ipynb",
    "docs/*.ipynb",
]

# Tutorials are jupytext py:percent notebooks, executed at build time.
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "cache"  # docs/_ext/execution.py executes what the cache lacks; `nox -s docs` empties it first
nb_execution_cache_path = "_build/.jupyter_cache"
nb_execution_timeout = 180  # seconds per cell
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

nitpicky = True
nitpick_ignore_regex = [
    # No intersphinx (the build is offline): names from the standard library and torch stay plain text.
    (
        "py:class",
        r"(collections\.abc\.)?(Callable|Iterator|Iterable|Mapping|Sequence)|Any|typing\..*|torch\..*|os\.PathLike|(pathlib\.)?Path|(concurrent\.futures\.)?Future|DeviceMesh",
    ),
]

autodoc_member_order = "bysource"
maximum_signature_line_length = 60  # longer signatures get one parameter per line (and fit a phone)
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Only the explicit doctest/testcode blocks of the pages run under the doctest builder;
# the package's docstring examples run under pytest --doctest-modules.
doctest_test_doctest_blocks = ""

html_theme = "sphinx_book_theme"
html_title = "The FSDP Guide"
html_theme_options = {
    "use_download_button": True,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "navigation_with_keys": True,
    "secondary_sidebar_items": {"index": []},  # the landing page's map takes the width
}
html_static_path = ["docs/_static"]
html_css_files = ["custom.css"]  # phone widths: wrap inline code, scroll wide tables in their box
html_favicon = "docs/_static/favicon.svg"
# No Python module index: the API reference documents one module whole, and the index's
# collapse toggles are images without a description (alt="-").
html_domain_indices = False
html_context = {"default_mode": "auto"}  # else the theme logs "Got invalid theme mode" on a first visit
copybutton_exclude = ".linenos, .gp, .go"


def _offer_executed_notebook(app, pagename, templatename, context, doctree):
    """Serve each tutorial's executed notebook next to its .py source, for the download button.

    myst-nb writes the notebook to ``jupyter_execute/``; sphinx-book-theme only offers it
    for Markdown notebooks with launch buttons, so write it there and point the theme at it.
    """
    from pathlib import Path

    import nbformat

    written = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if not pagename.startswith("tutorials/") or not written.exists():
        return
    notebook = nbformat.read(written, as_version=4)
    if app.config.nb_execution_mode == "cache":
        # On a cache hit myst-nb renders the cached outputs but writes the notebook without
        # them (the merged copy stays inside its client; cf. MyST-NB#617): take them from
        # the same cache.
        from jupyter_cache import get_cache

        _, notebook = get_cache(app.config.nb_execution_cache_path).merge_match_into_notebook(notebook)
    if app.config.nb_merge_streams:  # the download shows the outputs as the page does
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.outputs = _merged_streams(cell.outputs)
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def _merged_streams(outputs):
    """myst-nb's stream merging, applied to copies.

    ``myst_nb.core.utils.coalesce_streams`` appends each later stream's text to the first
    stream output *in place* and returns a new list without the later ones; the notebook
    myst-nb writes (the download) keeps the list with all of them, so every line after the
    first stream showed twice there. Merging copies leaves the notebook's outputs as they
    were executed; the page and the download both get the merged copies.
    """
    import copy

    from myst_nb.core.utils import coalesce_streams

    return coalesce_streams(copy.deepcopy(outputs))


def _signature_parameters_without_dl(app, pagename, templatename, context, doctree):
    """Multi-line signatures as <div>s: Sphinx writes their parameters as <dd>s of a <dl>
    without <dt>s (``maximum_signature_line_length``), which is invalid in a definition list
    and the one serious accessibility violation axe-core finds on the site."""
    import re

    def fix(signature):
        markup = signature.group(0)
        for old, new in (
            ("<dl>", '<div class="sig-params">'),
            ("</dl>", "</div>"),
            ("<dd>", '<div class="sig-param">'),
            ("</dd>", "</div>"),
        ):
            markup = markup.replace(old, new)
        return markup

    if "body" in context:
        context["body"] = re.sub(r'<dt class="sig .*?</dt>', fix, context["body"], flags=re.S)


def setup(app):
    import myst_nb.core.render

    myst_nb.core.render.coalesce_streams = _merged_streams  # the page's merge no longer edits the notebook
    app.connect("html-page-context", _offer_executed_notebook, priority=400)  # before the theme's buttons
    app.connect("html-page-context", _signature_parameters_without_dl)
