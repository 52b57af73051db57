"""How fast the site builds, how long each notebook takes, and how heavy the landing page is.

Prints, from one run:
- the site build: cold (empty cache, every notebook executed), a rebuild with nothing
  changed, and a fresh build (no doctrees) that takes the executed notebooks from the cache;
  and the cold build again with every launch cold (``FSDP_GUIDE_WARM=0``), against warm launches;
- each notebook's execution time in the cold build, slowest first (from the cache's records);
- the landing page's weight: its HTML plus the JavaScript and CSS files it links.

Goals (issue 6): cold build under 8 minutes on the 2-core CI machine, no notebook over 90 s,
an unchanged rebuild under 30 s. Run it in the pinned environment: `nox -s bench`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"cold": 8 * 60, "notebook": 90, "unchanged": 30}


def seconds(argv: list[str], **env: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **env})
    return time.perf_counter() - start


def notebook_seconds(cache_path: Path) -> dict[str, float]:
    """Each notebook's execution time, as myst-nb recorded it in the jupyter-cache."""
    from jupyter_cache import get_cache

    return {Path(record.uri).relative_to(ROOT).as_posix(): record.data.get("execution_seconds", float("nan"))
            for record in get_cache(str(cache_path)).list_cache_records()}


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


def sphinx(out: Path, cache: str = "cache", doctrees: str = "doctrees") -> list[str]:
    return [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
            "-D", "nb_execution_mode=cache", "-D", f"nb_execution_cache_path={out / cache}",
            "-d", str(out / doctrees), str(ROOT)]


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="fsdp_guide-site-"))
    build = sphinx(out)
    try:
        # The same cold build with every launch starting cold (issue 14's "before").
        all_cold = seconds(sphinx(out, "cache-cold", "doctrees-cold") + [str(out / "html-cold")], FSDP_GUIDE_WARM="0")
        all_cold_notebooks = sum(notebook_seconds(out / "cache-cold").values())
        cold = seconds(build + [str(out / "html")])
        unchanged = seconds(build + [str(out / "html")])
        shutil.rmtree(out / "doctrees")
        from_cache = seconds(build + [str(out / "html2")])
        notebooks = notebook_seconds(out / "cache")
        weight = page_weight(out / "html")
    finally:
        shutil.rmtree(out)

    def verdict(value, goal):
        return "meets the goal" if value <= goal else "OVER the goal"

    print("site build:")
    print(f"  {'cold (every notebook executed)':40} {cold:7.1f} s   goal < {GOALS['cold']} s: {verdict(cold, GOALS['cold'])}")
    print(f"  {'rebuild, nothing changed':40} {unchanged:7.1f} s   goal < {GOALS['unchanged']} s: "
          f"{verdict(unchanged, GOALS['unchanged'])}")
    print(f"  {'fresh build, notebooks from the cache':40} {from_cache:7.1f} s")
    print(f"  {'cold, every launch cold (FSDP_GUIDE_WARM=0)':40} {all_cold:7.1f} s   warm launches save "
          f"{all_cold - cold:.1f} s ({cold / all_cold:.2f}x); notebooks {all_cold_notebooks:.1f} s -> "
          f"{sum(notebooks.values()):.1f} s")
    print("\nnotebook execution in the cold build, slowest first:")
    for name, secs in sorted(notebooks.items(), key=lambda item: -item[1]):
        print(f"  {name:40} {secs:7.1f} s   {verdict(secs, GOALS['notebook'])}")
    print(f"  {'all notebooks':40} {sum(notebooks.values()):7.1f} s")
    print("\nlanding page weight (first visit):")
    for kind, nbytes in weight.items():
        print(f"  {kind:6} {nbytes:10,} bytes")
    print(f"  {'total':6} {sum(weight.values()):10,} bytes")


if __name__ == "__main__":
    main()
