"""How fast the site builds, how long each notebook takes, and how heavy the landing page is.

Prints, from one run:
- the site build: cold (empty cache, every notebook executed two at a time, as ``nox -s
  docs`` builds it), a rebuild with nothing changed, and a fresh build (no doctrees) that
  takes the executed notebooks from the cache; and the cold build again executing one
  notebook at a time (``-D execution_workers=1``, docs/_ext/execution.py);
- each notebook's execution time in the one-at-a-time build, slowest first (from the
  cache's records): the time a reader's kernel takes with nothing else running;
- the landing page's weight: its HTML plus the JavaScript and CSS files it links.

Goals (issue 6): cold build under 8 minutes on the 2-core CI machine, no notebook over 90 s,
an unchanged rebuild under 30 s. Run it in the pinned environment: `nox -s bench`.
A cold build compiles cold too: inductor's cache is a fresh directory for each build.

The printout is kept in bench/results/site.txt. `--record` runs the two cold builds alone,
keeps them in bench/results/page_times.txt, keeps each notebook's time (one at a time) in
page_times.json and writes it into each tutorial's opening (bench/results.py): run it on
an otherwise idle machine after changing a page's cells, and commit what it wrote. `--record --page STEM`
executes one new or changed page alone, as the cold build would, and adds its time to the
record (marked as measured separately, with its own date and machine).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from results import RESULTS, describe, machine, record_page_time, record_page_times, recorded  # noqa: E402

GOALS = {"cold": 8 * 60, "notebook": 90, "unchanged": 30}


def seconds(argv: list[str], **env: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **env})
    return time.perf_counter() - start


def notebook_seconds(cache_path: Path) -> dict[str, float]:
    """Each notebook's execution time, as myst-nb recorded it in the jupyter-cache."""
    from jupyter_cache import get_cache

    return {
        Path(record.uri).relative_to(ROOT).as_posix(): record.data.get("execution_seconds", float("nan"))
        for record in get_cache(str(cache_path)).list_cache_records()
    }


def page_weight(html_dir: Path, page: str = "index.html") -> dict[str, int]:
    """Bytes of the page and of the local scripts and stylesheets it links (what a first visit downloads)."""
    html = (html_dir / page).read_text()
    linked = re.findall(r'<script[^>]+src="([^"?#]+)', html) + re.findall(r'<link[^>]+href="([^"?#]+\.css)', html)
    weight = {"html": len(html.encode()), "js": 0, "css": 0}
    for ref in dict.fromkeys(linked):
        path = html_dir / ref
        if path.is_file():
            weight["js" if ref.endswith(".js") else "css"] += path.stat().st_size
    return weight


def cold_build(out: Path, name: str, workers: int = 2) -> tuple[float, dict[str, float]]:
    """A build with an empty execution cache and an empty inductor cache: every notebook
    executed, ``workers`` at a time, compiled afresh."""
    build = sphinx(out, f"cache-{name}", f"doctrees-{name}") + ["-D", f"execution_workers={workers}"]
    took = seconds(build + [str(out / f"html-{name}")], TORCHINDUCTOR_CACHE_DIR=str(out / f"inductor-{name}"))
    return took, notebook_seconds(out / f"cache-{name}")


def sphinx(out: Path, cache: str = "cache", doctrees: str = "doctrees") -> list[str]:
    # No -W: a warning (a missing record on the first --record run) does not make a timing wrong.
    # -j auto: Sphinx reads and writes on every core, as `nox -s docs` runs it (noxfile.SPHINX).
    return [
        sys.executable,
        "-m",
        "sphinx",
        "--keep-going",
        "-n",
        "-q",
        "-j",
        "auto",
        "-b",
        "html",
        "-D",
        "nb_execution_mode=cache",
        "-D",
        f"nb_execution_cache_path={out / cache}",
        "-d",
        str(out / doctrees),
        str(ROOT),
    ]


def verdict(value, goal):
    return "meets the goal" if value <= goal else "OVER the goal"


def print_notebooks(notebooks: dict[str, float]) -> None:
    print("\nnotebook execution in the one-at-a-time cold build, slowest first:")
    for name, secs in sorted(notebooks.items(), key=lambda item: -item[1]):
        print(f"  {name:40} {secs:7.1f} s   {verdict(secs, GOALS['notebook'])}")
    print(f"  {'all notebooks':40} {sum(notebooks.values()):7.1f} s")


def cold_builds(out: Path) -> dict[str, float]:
    """The cold build as `nox -s docs` runs it, and one notebook at a time; each notebook's time from the latter."""
    cold, _ = cold_build(out, "cold")
    serial, notebooks = cold_build(out, "serial", workers=1)
    print(
        f"site build, cold (every notebook executed, two at a time): {cold:.1f} s   goal < {GOALS['cold']} s: "
        f"{verdict(cold, GOALS['cold'])}"
    )
    print(f"site build, cold, one notebook at a time: {serial:.1f} s   (two at a time: {cold / serial:.2f}x)")
    print_notebooks(notebooks)
    return notebooks


def record(out: Path) -> None:
    """The cold builds alone; each notebook's time kept and written into the tutorials' openings."""
    notebooks = cold_builds(out)
    changed = record_page_times(
        {Path(uri).stem: secs for uri, secs in notebooks.items()},
        "each notebook in a fresh kernel, in a cold site build executing one notebook at a "
        "time (sphinx-build -D execution_workers=1, empty execution and inductor caches, "
        "warm launches from the build's one server), nothing else running",
    )
    print(f"\nstated times rewritten in: {', '.join(changed) or 'none (all as recorded)'}")


def record_one(out: Path, page: str) -> None:
    """One notebook executed as the cold build executes each (nbclient, a fresh kernel, the
    notebook's folder as working directory, an empty inductor cache), its time kept beside
    the others and written into its opening: for a new or changed page, without a whole build."""
    import jupytext
    from nbclient import NotebookClient

    source = next(p for p in (ROOT / "tutorials" / f"{page}.py", ROOT / "docs" / f"{page}.py") if p.exists())
    notebook = jupytext.read(source)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor")  # the kernel inherits it
    start = time.perf_counter()
    NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(source.parent)}}
    ).execute()
    took = time.perf_counter() - start
    changed = record_page_time(
        page,
        took,
        "the notebook alone in a fresh kernel (nbclient, as myst-nb runs it), "
        "empty inductor cache, warm launches, nothing else running",
    )
    line = (
        f"\nrecorded separately, {describe(machine())}:\n"
        f"$ python bench/bench_site.py --record --page {page}\n"
        f"  {source.relative_to(ROOT).as_posix():40} {took:7.1f} s   {verdict(took, GOALS['notebook'])}\n"
    )
    print(line + f"stated time {'rewritten' if changed else 'unchanged'} in {page}")
    printout = RESULTS / "page_times.txt"  # after the whole build's printout, in place of the page's last one
    earlier = re.compile(
        rf"\nrecorded separately, [^\n]*\n\$ python bench/bench_site.py --record --page {page}\n[^\n]*\n"
    )
    printout.write_text(earlier.sub("", printout.read_text()) + line)


def measure_all(out: Path) -> None:
    cold_builds(out)
    build = sphinx(out, "cache-cold", "doctrees-cold") + [str(out / "html-cold")]
    unchanged = seconds(build)
    shutil.rmtree(out / "doctrees-cold")
    from_cache = seconds(build[:-1] + [str(out / "html2")])
    weight = page_weight(out / "html-cold")
    print(
        f"\n{'rebuild, nothing changed':40} {unchanged:7.1f} s   goal < {GOALS['unchanged']} s: "
        f"{verdict(unchanged, GOALS['unchanged'])}"
    )
    print(f"{'fresh build, notebooks from the cache':40} {from_cache:7.1f} s")
    print("\nlanding page weight (first visit):")
    for kind, nbytes in weight.items():
        print(f"  {kind:6} {nbytes:10,} bytes")
    print(f"  {'total':6} {sum(weight.values()):10,} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--record",
        action="store_true",
        help="the cold build alone: keep each notebook's time and state it in the tutorials",
    )
    parser.add_argument("--page", help="with --record: execute and record this page (its file's stem) alone")
    args = parser.parse_args()
    if args.page and not args.record:
        parser.error("--page records one page's time: use it with --record")
    out = Path(tempfile.mkdtemp(prefix="fsdp_guide-site-"))
    name = "page_times" if args.record else "site"
    try:
        if args.page:
            record_one(out, args.page)
            return
        with recorded(name, f"python bench/bench_site.py{' --record' if args.record else ''}"):
            (record if args.record else measure_all)(out)
    finally:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
