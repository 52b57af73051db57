"""The site builds from scratch with every tutorial executed and no warning; its pages link up; its doctests pass."""

from __future__ import annotations

import html as htmllib
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import NOTEBOOKS, ROOT, TUTORIALS, site_options, sphinx

# A cell's opening tag: myst-nb adds a class for each of the cell's tags (tag_alone, tag_remove-input).
CELL = re.compile(r'<div class="cell(?: tag_[\w-]+)* docutils container"')


def _cell_start(html: str, at: int) -> int:
    """Where the last cell opening before ``at`` starts, or -1."""
    return max((m.start() for m in CELL.finditer(html, 0, at)), default=-1)


def _cell_end(html: str, after: int) -> int | None:
    """Where the next cell opening after ``after`` starts, or None (the page's end)."""
    found = CELL.search(html, after)
    return found.start() if found else None


def test_the_site_shows_the_tested_executions_instead_of_running_the_tutorials_again(site, execution_cache):
    from jupyter_cache import get_cache

    cache = get_cache(str(execution_cache))
    assert len(cache.list_cache_records()) == len(NOTEBOOKS)
    assert cache.list_project_records() == []  # myst-nb adds a notebook here only when it executes it


def _landing():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import landing

    return landing


def test_landing_page_maps_the_site(site):
    index = (site / "index.html").read_text()
    for target in (
        "tutorials/quickstart.html",
        "docs/fsdp_tips.html",
        "docs/fsdp.html",
        "docs/tips_by_goal.html",
        "docs/errors.html",
        "docs/fsdp2_map.html",
    ):
        assert f'href="{target}' in index
    assert '<img alt="Two ranks and three units' in index  # the sharding diagram, before the map


def test_the_landing_page_has_every_page_that_executes_one_click_away_by_goal_with_its_time_and_needs(site):
    landing = _landing()
    index = (site / "index.html").read_text()
    cards = re.findall(r'<div class="sd-card[^"]*goal-card.*?</ul>', index, re.S)
    assert len(cards) == len(landing.GROUPS)
    grouped = {}
    for card, group in zip(cards, landing.GROUPS.values()):
        assert re.search(rf">\s*{re.escape(group.title)}\s*<", card)
        for item in re.findall(r"<li>(.*?)</li>", card, re.S):
            link = re.search(r'href="(tutorials|docs)/(\w+)\.html#[\w-]+"', item)
            if link and link.group(2) in {p.stem for p in NOTEBOOKS}:
                grouped[link.group(2)] = htmllib.unescape(re.sub(r"<[^>]+>", "", item))
    assert sorted(grouped) == sorted(p.stem for p in NOTEBOOKS)  # every executed page, once
    for page in NOTEBOOKS:
        stated = re.search(r"about (\d+) seconds on \d+ CPU cores", " ".join(page.read_text().split()))
        line = grouped[page.stem]
        assert f"about {stated.group(1)} s" in line, (page.stem, line)  # the time the page itself states
        assert re.search(r"\d ranks", line)


def test_the_tutorials_are_in_the_navigation_in_the_order_of_the_landing_pages_map(site):
    landing = _landing()
    index = (site / "index.html").read_text()
    for tutorial in TUTORIALS:
        assert f'href="tutorials/{tutorial.stem}.html"' in index
    order = re.findall(r"^\s+tutorials/(\w+)$", (ROOT / "index.rst").read_text(), flags=re.M)
    assert order == [stem for group in landing.GROUPS.values() for stem in group.pages if stem != "cluster"]


def test_every_tip_is_listed_once_by_goal_with_the_tutorial_that_proves_it(site):
    landing = _landing()
    tips = set(re.findall(r'id="(tip-[\w-]+)"', (site / "docs" / "fsdp_tips.html").read_text()))
    by_goal = (site / "docs" / "tips_by_goal.html").read_text()
    linked = re.findall(r'href="fsdp_tips\.html#(tip-[\w-]+)"', by_goal)
    assert len(tips) >= 60 and sorted(linked) == sorted(tips)
    text = htmllib.unescape(re.sub(r"<[^>]+>", "", by_goal)).replace("\u2019", "'")  # docutils' smart quotes
    for name, _, stem in landing.tips():
        assert f"({landing.GROUPS[landing.group_of(stem)].pages[stem][0]})" in text, name


def test_every_symptom_links_to_sections_of_executed_cells(site):
    page = (site / "docs" / "symptoms.html").read_text()
    symptoms = page.split('<section id="')[2:]  # the page's own section first
    assert len(symptoms) >= 8
    for symptom in symptoms:
        name = symptom[: symptom.index('"')]
        executed = 0
        for href in re.findall(r'href="(\.\./tutorials/\w+\.html|cluster\.html)#([\w-]+)"', symptom):
            target = (site / "docs" / href[0]).resolve().read_text()
            at = target.index(f'id="{href[1]}"')
            end = target.find("<section id=", at + 1)
            assert 'class="cell_output' in target[at : end if end > 0 else None], (name, href)  # output, not prose
            executed += 1
        assert executed, f"{name}: no link to an executed cell"


def test_errors_are_found_in_output_lines_as_class_and_message():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from errors import messages

    assert messages("step 1\nRuntimeError: FSDP does not support deepcopy.\n") == [
        ("RuntimeError", "FSDP does not support deepcopy.")
    ]
    assert messages("rank 1 raised torch.distributed.DistBackendError: Connection closed by peer") == [
        ("torch.distributed.DistBackendError", "Connection closed by peer")
    ]
    assert messages("{'FutureWarning: NO_SHARD is deprecated. (on ranks 0, 1)'}") == [
        ("FutureWarning", "NO_SHARD is deprecated.")
    ]
    assert messages("loss 0.25, gradient error vs one process: 1e-7") == []
    # dynamo's class named exactly Unsupported, printed without its module
    assert messages("fullgraph=True -> Unsupported: Attempted to call function marked as skipped") == [
        ("Unsupported", "Attempted to call function marked as skipped")
    ]
    # each message whole: its own closing brackets and quotes kept, a repr's around it cut
    assert messages("AssertionError: got {torch.bfloat16, torch.float32}") == [
        ("AssertionError", "got {torch.bfloat16, torch.float32}")
    ]
    assert messages("['ValueError: size: torch.Size([96])', 'x']") == [("ValueError", "size: torch.Size([96])")]
    assert messages("RuntimeError: got DeviceMesh((dp=2), 'cpu', stride=(2,))") == [
        ("RuntimeError", "got DeviceMesh((dp=2), 'cpu', stride=(2,))")
    ]
    # in a repr after other text, with an escaped quote, or two in one repr; an apostrophe before is no quote
    assert messages("['rank 1: ValueError: bad thing']") == [("ValueError", "bad thing")]
    assert messages("['ValueError: it\\'s bad']") == [("ValueError", "it's bad")]
    assert messages("{'UserWarning: a', 'FutureWarning: b'}") == [("UserWarning", "a"), ("FutureWarning", "b")]
    assert messages("rank 1's error: RuntimeError: got 'x'") == [("RuntimeError", "got 'x'")]
    # torchrun's summary: the message is the first line of its box
    assert messages(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\nrun.py FAILED\n---"
    ) == [("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "run.py FAILED")]
    # a message ending with a colon is whole with its indented lines, as load_state_dict prints them
    assert messages(
        "RuntimeError: Error(s) in loading state_dict for FSDPLinear:\n\tsize mismatch for weight: a.\n"
        "\tsize mismatch for bias: b.\nloaded 0 of 2"
    ) == [
        (
            "RuntimeError",
            "Error(s) in loading state_dict for FSDPLinear: size mismatch for weight: a. size mismatch for bias: b.",
        )
    ]
    assert messages("ValueError: expected one of:\nnext line") == [("ValueError", "expected one of:")]


def test_every_entry_of_the_errors_index_links_to_a_cell_whose_output_shows_its_message(site):
    index = (site / "docs" / "errors.html").read_text()
    listed = index[index.index('<ul class="errors-index') :]
    items = re.findall(r"<li>(.*?)</li>", listed[: listed.index("</ul>")], re.S)
    assert len(items) >= 20
    messages = []
    for item in items:
        printed = htmllib.unescape(re.search(r'<span class="pre">(.*?)</code>', item, re.S).group(0))
        printed = " ".join(htmllib.unescape(re.sub(r"<[^>]+>", "", printed)).split())
        where = re.search(r'<p class="errors-where">(.*?)</p>', item, re.S).group(1)
        fix = re.search(r'<p class="errors-fix">(.*?)</p>', item, re.S).group(1)
        fix_links = re.findall(r'href="([^"#]*)#([\w-]+)"', fix)
        assert fix_links, (printed, "no fix, or a fix that links nowhere: add it to FIXES in docs/_ext/errors.py")
        for path, anchor in fix_links:
            assert f'id="{anchor}"' in ((site / "docs" / path).resolve().read_text() if path else index), (
                printed,
                anchor,
            )
        hrefs = re.findall(r'href="([^"]+)"', where)
        assert hrefs, printed
        for href in hrefs:
            path, _, anchor = href.partition("#")
            page = (site / "docs" / path).resolve().read_text()
            at = page.index(f'id="{anchor}"')
            cell = page.rfind("<div", 0, at + 1)
            assert CELL.search(page[cell : at + 200]), (href, "not a cell")
            end = _cell_end(page, at)
            shown = htmllib.unescape(re.sub(r"<[^>]+>", "", page[cell:end]))
            shown = " ".join(re.sub(r"={5,}", " ", shown).split())  # a summary box's rule (torchrun's) is no word
            assert printed in shown, (href, printed)
        messages.append(printed)
    for reproduced in (
        "FSDP does not support deepcopy",
        "Cannot use ReduceOp.PREMUL_SUM with Gloo",
        "already managed by another FSDP group",
        "does not have a sharding strategy registered",
        *REPORTED,
    ):
        assert any(reproduced in m for m in messages), reproduced


# Messages users of FSDP report most in the trackers (pytorch, torchtitan, accelerate,
# transformers, trl, peft, verl), each reproduced on the page it belongs to.
REPORTED = (
    "ChildFailedError: train_killed_on_rank_1.py FAILED",
    "environment variable RANK expected, but not set",
    "Default process group has not been initialized",
    "EADDRINUSE",
    "waiting for clients. 1/2 clients joined",
    "The client socket has timed out",
    "Distributed package doesn't have NCCL built in",
    "No backend type associated with device type cpu",
    "Mesh should not be bigger than default world size",
    "FSDP parameters should be materialized from meta device",
    "Cannot copy out of meta tensor",
    "Must flatten tensors with uniform dtype",
    "Must flatten tensors with uniform `requires_grad`",
    "Cannot flatten integer dtype tensors",
    "should only be called on the root FSDP instance",
    "FSDP needs a non-CPU accelerator device",
    "FSDP is switching to use `NO_SHARD`",
    "'weight' must be 2-D",
    "are out of bounds for storage of size 0",
    "element 0 of tensors does not require grad",
    "None of the inputs have requires_grad=True",
    "aten.copy_.default got mixed torch.Tensor and DTensor",
    "size mismatch for 0.weight: copying a param with shape",
    "Missing key in checkpoint state_dict",
    "Size mismatch between saved",
    "Unexpected key(s) in state_dict",
)


def test_quickstart_page_shows_executed_rank_output_and_the_check(site):
    page = (site / "tutorials" / "quickstart.html").read_text()
    assert "[rank0] step  0  loss" in page
    assert "FSDP2 on 2 ranks vs 1 process, 40 steps: max |loss difference| =" in page
    assert "FSDP1 on 2 ranks vs 1 process, 40 steps: max |loss difference| =" in page
    assert re.search(r"torch 2\.\d+\.\d+", page)
    assert re.search(r'<img alt="Loss per step[^"]+" src="\.\./_images/\w+\.png"', page)  # the loss curves


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_each_tutorial_downloads_as_executed_ipynb_and_py(site, tutorial):
    page = (site / "tutorials" / f"{tutorial.stem}.html").read_text()
    for suffix in (".ipynb", ".py"):
        assert f'href="../_sources/tutorials/{tutorial.stem}{suffix}"' in page
    notebook = nbformat.read(site / "_sources" / "tutorials" / f"{tutorial.stem}.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert sum(len(c.get("outputs", [])) for c in notebook.cells if c.cell_type == "code") > 0


@pytest.mark.parametrize("page", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_executed_page_says_where_it_ran(site, page):
    """The box comes from the build's own launches; GPU lines only from the committed record."""
    html = (site / page.parent.name / f"{page.stem}.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    executed = re.search(r"Executed on: (.*?)torch 2\.\d+", text, re.S)
    assert executed, f"{page.stem}: no 'Executed on' box"
    assert re.search(r"CPU, gloo, [234] ranks", executed.group(1))  # the launches this build ran
    assert "On GPUs:" in text
    assert f'executed_on("{page.stem}")' not in html  # the cell's input is hidden: the reader sees the box


def _shown_blocks(html: str) -> list[str]:
    """The text of every <pre> block of a page, as a reader sees it."""
    return [htmllib.unescape(re.sub(r"<[^>]+>", "", block)) for block in re.findall(r"<pre>(.*?)</pre>", html, re.S)]


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_each_download_shows_the_outputs_the_page_shows_once(site, tutorial):
    notebook = nbformat.read(site / "_sources" / "tutorials" / f"{tutorial.stem}.ipynb", as_version=4)
    shown = _shown_blocks((site / "tutorials" / f"{tutorial.stem}.html").read_text())
    streams = 0
    for cell in notebook.cells:
        names = [out["name"] for out in cell.get("outputs", []) if out["output_type"] == "stream"]
        assert len(names) == len(set(names)), f"a stream printed twice in: {cell.source[:80]}"
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                streams += 1
                text = re.sub(r"\x1b\[[0-9;]*m", "", out["text"]).strip()  # the page renders ANSI colours
                assert any(text in block for block in shown), text[:200]
    assert streams > 0


def test_a_result_table_is_an_html_table_on_the_page_and_aligned_text_in_the_notebook(site, executed):
    html = (site / "docs" / "cluster.html").read_text()
    table = re.search(r'<table class="fsdp-guide-table">.*?</table>', html, re.S)
    assert table and table[0].count("<tr>") == 5  # the header and the 4 ranks
    assert '<th class="numeric">rank</th><th>shard group</th>' in table[0]
    assert "<pre" not in table[0]
    text = next(
        out["data"]["text/plain"] for cell in executed["cluster"].cells for out in cell.get("outputs", [])
        if "text/html" in out.get("data", {}) and "fsdp-guide-table" in out["data"]["text/html"]
    )  # fmt: skip
    assert text.splitlines()[0].split() == [
        "rank",
        "shard",
        "group",
        "replicate",
        "group",
        "model[0].weight",
        "local",
        "shape",
    ]


def _build_paths() -> list[str]:
    """Where this checkout, its Python and its temporary files are: what a page must not show."""
    import tempfile

    return [str(ROOT), sys.prefix, sys.base_prefix, "site-packages", f"{Path.home()}/", f"{tempfile.gettempdir()}/"]


def _outputs_shown(html: str) -> list[str]:
    """The text of every cell output of a page (not its code), as a reader sees it."""
    outputs = re.findall(r'<div class="cell_output docutils container">(.*?)\n</div>\n</div>', html, re.S)
    return [htmllib.unescape(re.sub(r"<[^>]+>", "", output)) for output in outputs]


@pytest.mark.parametrize("page", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_page_shows_a_path_of_the_machine_that_built_it(site, page):
    shown = _outputs_shown((site / page.parent.name / f"{page.stem}.html").read_text())
    assert shown, f"{page.stem}: no cell output found on the page"
    found = [(path, line) for block in shown for line in block.splitlines() for path in _build_paths() if path in line]
    assert not found, "\n".join(f"{path!r} in: {line[:200]}" for path, line in found)


def _anchors(page) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text()))


def _links(page, target: str) -> list[str]:
    return re.findall(rf'href="{re.escape(target)}#([^"]+)"', page.read_text())


def test_fsdp_and_tips_pages_link_each_other_to_existing_anchors(site):
    fsdp, tips = site / "docs" / "fsdp.html", site / "docs" / "fsdp_tips.html"
    to_fsdp, to_tips = _links(tips, "fsdp.html"), _links(fsdp, "fsdp_tips.html")
    assert len(set(to_fsdp)) >= 2 and len(set(to_tips)) >= 4  # section-level links, both ways
    assert set(to_fsdp) <= _anchors(fsdp) and set(to_tips) <= _anchors(tips)
    assert 'href="fsdp_tips.html"' in fsdp.read_text() and 'href="fsdp.html"' in tips.read_text()  # near the top


def test_every_tip_links_to_its_tutorial_and_back(site):
    tips_page = site / "docs" / "fsdp_tips.html"
    parts = re.split(r'id="(tip-[^"]+)"', tips_page.read_text())[1:]  # each tip's label, then its text
    tips = dict(zip(parts[::2], parts[1::2]))
    assert len(tips) >= 5
    for tip, body in tips.items():
        tutorial_links = re.findall(r'href="\.\./tutorials/(\w+)\.html#?([^"]*)"', body)
        assert tutorial_links, f"tip {tip} links to no tutorial"
        for name, anchor in tutorial_links:
            tutorial = site / "tutorials" / f"{name}.html"
            assert tutorial.exists() and (not anchor or anchor in _anchors(tutorial))
    linked_from_tips = set()
    for body in tips.values():
        linked_from_tips |= set(re.findall(r'href="\.\./tutorials/(\w+)\.html', body))
    for tutorial in TUTORIALS:
        assert tutorial.stem in linked_from_tips, f"no tip links to {tutorial.stem}"
        back = set(_links(site / "tutorials" / f"{tutorial.stem}.html", "../docs/fsdp_tips.html"))
        assert back and back <= set(tips), (tutorial.stem, back)


def test_doctests_on_the_pages_pass_without_executing_the_notebooks_again(tmp_path, execution_cache, site):
    # The outputs from the pages' one execution: the prose's glued figures are read from them (with no
    # outputs, every {glue} role would warn, and -W fails the build). From a copy of the site's
    # doctrees (the site's own stay as built): Sphinx reads no page again (about 12 s of CI's
    # critical path), as the options are the site build's (SITE_OPTIONS).
    doctrees = tmp_path / "doctrees"
    shutil.copytree(site.parent / "doctrees", doctrees)
    written = {path: path.stat().st_mtime_ns for path in doctrees.rglob("*.doctree")}
    run = sphinx("doctest", tmp_path, *site_options(execution_cache), doctrees=doctrees)
    assert run.returncode == 0, run.stdout + run.stderr
    report = (tmp_path / "doctest" / "output.txt").read_text()
    assert re.search(r"\b[1-9]\d* tests\s+0 failures in tests", report), report
    # No notebook read again (a page read is written again), so none executed; the generated
    # pages (the map, the indexes) may be: they depend on files beside the pages.
    notebooks = {f"{page.stem}.doctree" for page in NOTEBOOKS}
    again = [path.name for path, mtime in written.items() if path.stat().st_mtime_ns != mtime]
    assert len(notebooks) > 60 and notebooks <= {path.name for path in written}, notebooks
    assert notebooks.isdisjoint(again), f"the doctest build read these notebooks again: {again}"
    for page in (tmp_path / "jupyter_execute").rglob("*.ipynb"):  # any it wrote, it wrote unexecuted
        notebook = nbformat.read(page, as_version=4)
        assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), page


def test_read_the_docs_builds_like_nox_docs_with_the_pinned_environment():
    import yaml
    from conftest import ROOT

    config = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
    install, build = config["build"]["commands"]
    assert "-c constraints.txt" in install and ".[docs]" in install
    assert "download.pytorch.org/whl/cpu" in install  # the CPU build of the pinned torch
    assert config["build"]["tools"]["python"] == "3.11"  # the Python the pins were made with
    for option in ("-W", "--keep-going", "-n", "-b html"):
        assert option in build  # as nox -s docs builds: warnings fail
    # conf.py's cache mode, and a checkout without the cache (git ignores _build/): every page executed
    assert "nb_execution" not in build and "_build/" in (ROOT / ".gitignore").read_text().split()


def test_every_glossary_term_is_defined_and_linked_from_a_page(site):
    glossary = (site / "docs" / "glossary.html").read_text()
    terms = set(re.findall(r'<dt id="(term-[^"]+)"', glossary))
    assert len(terms) >= 15
    linked = set()
    for page in site.rglob("*.html"):
        if page.name not in ("glossary.html", "genindex.html"):
            linked |= set(re.findall(r'glossary\.html#(term-[^"]+)"', page.read_text()))
    assert linked <= terms  # every link lands on a definition
    assert terms - linked == set()  # every word is linked from where it is used


def test_the_reference_shows_the_sharding_diagram(site):
    page = (site / "docs" / "fsdp.html").read_text()
    images = re.findall(r'<img alt="Two ranks and three units[^"]*" [^>]*src="([^"]+\.png)"', page)
    assert len(images) == 1
    assert (site / "docs" / images[0]).resolve().stat().st_size > 10_000  # drawn at build time


def test_the_readmes_launch_times_are_the_recorded_ones():
    """The README quotes bench/results/launch.txt; rerunning the benchmark without updating it fails here."""
    from conftest import ROOT

    recorded = (ROOT / "bench" / "results" / "launch.txt").read_text()
    warm_first, warm_next = re.search(r"^warm \(the default\)\s+([\d.]+)\s+([\d.]+)$", recorded, re.M).groups()
    cold_first, cold_next = re.search(r"^cold \(FSDP_GUIDE_WARM=0\)\s+([\d.]+)\s+([\d.]+)$", recorded, re.M).groups()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.search(
        rf"returned in {warm_first} s the first time \([^)]*\) and {warm_next} s each time after it, "
        rf"against {cold_first} s and then {cold_next} s",
        readme,
    )


def test_every_link_of_the_fsdp2_map_lands_on_an_executed_cell_whose_code_uses_the_name(site):
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from fsdp2_map import MAP, label, pattern

    the_map = (site / "docs" / "fsdp2_map.html").read_text()
    linked = {name: entry.page for name, entry in MAP.items() if entry.page}
    assert linked  # the map links to pages
    for name, page in linked.items():
        folder = "docs" if page == "cluster" else "tutorials"
        assert f'href="../{folder}/{page}.html#{label(name)}"' in the_map, name
        html = (site / folder / f"{page}.html").read_text()
        # The label is the cell's id, or an empty span at the cell's start when it has several.
        at = html.index(f'id="{label(name)}"')
        cell = _cell_start(html, at)
        assert re.fullmatch(CELL.pattern + r' |<div [^>]*>\s*(<span id="[^"]+"></span>\s*)*<span ', html[cell:at]), (
            name,
            "the label is not on a cell",
        )
        end = _cell_end(html, cell + 1)
        code = htmllib.unescape(re.sub(r"<[^>]+>", "", html[cell:end]))
        assert pattern(name) in code, (name, page)
        assert 'class="cell_output' in html[cell:end], (name, page, "the cell shows no output")
