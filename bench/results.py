"""The benchmarks' recorded outputs (``bench/results/``), and the run times the pages state from them.

A benchmark's printout is kept in ``bench/results/<name>.txt`` under a header naming the
machine it ran on, so that a number the README or a page quotes can be traced to a run.
``bench_site.py`` also keeps each notebook's execution time in ``page_times.json`` and
writes it into the opening of each tutorial ("about N seconds on C CPU cores"), so the
stated time is derived from a measurement, never typed; ``tests/test_tutorials.py``
checks that every tutorial states the recorded time.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import re
import sys
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAGE_TIMES = RESULTS / "page_times.json"
# every page that executes
PAGES = [
    *sorted((Path(__file__).resolve().parent.parent / "tutorials").glob("*.py")),
    Path(__file__).resolve().parent.parent / "docs" / "cluster.py",
]

# "about 55 seconds on 2 CPU cores", possibly wrapped over comment lines of a py:percent
# page, with the link to the recorded measurement this module adds after it.
_GAP = r"\s+(?:#\s*)?"
STATED = re.compile(
    rf"about{_GAP}(?:\d+{_GAP}seconds|a{_GAP}minute){_GAP}on{_GAP}\d+{_GAP}CPU{_GAP}cores"
    rf"(?:{_GAP}\(\{{ref\}}`measured <measured-times>`\))?"  # the link, on the same line or the next
)


def machine() -> dict[str, object]:
    """What the numbers were measured on: CPU, cores, memory, Python, torch, and the date."""
    import torch

    def first(path: str, key: str) -> str:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        return "unknown"

    memory = first("/proc/meminfo", "MemTotal")
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory_gib": round(int(memory.split()[0]) / 2**20) if memory != "unknown" else None,
        "system": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def describe(m: dict[str, object]) -> str:
    return (
        f"{m['date']}: {m['cores']} CPU cores ({m['cpu']}), {m['memory_gib']} GiB, {m['system']}, "
        f"Python {m['python']}, torch {m['torch']}"
    )


@contextlib.contextmanager
def recorded(name: str, command: str) -> Iterator[None]:
    """Print as usual, and keep what was printed in ``bench/results/<name>.txt`` with the machine."""
    buffer = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            sys.__stdout__.write(text)
            return buffer.write(text)

    with contextlib.redirect_stdout(Tee()):
        yield
    RESULTS.mkdir(exist_ok=True)
    header = f"$ {command}\n# measured {describe(machine())}\n"
    (RESULTS / f"{name}.txt").write_text(header + buffer.getvalue())


def stated(seconds: float, cores: int) -> str:
    """The opening's phrase for a page that executed in ``seconds`` on ``cores`` cores, rounded to 5 s.

    >>> stated(53.2, 2)
    'about 55 seconds on 2 CPU cores ({ref}`measured <measured-times>`)'
    """
    return f"about {max(5, 5 * round(seconds / 5))} seconds on {cores} CPU cores ({{ref}}`measured <measured-times>`)"


def record_page_times(seconds: dict[str, float], conditions: str) -> list[str]:
    """Keep each page's time in ``page_times.json`` and write it into each tutorial's opening.

    Returns the tutorials whose stated time changed.
    """
    seconds = {page: round(value, 1) for page, value in seconds.items()}  # stated from what is kept: 7.46 is 7.5
    m = machine()
    RESULTS.mkdir(exist_ok=True)
    PAGE_TIMES.write_text(
        json.dumps(
            {"machine": m, "conditions": conditions, "seconds": {k: round(v, 1) for k, v in sorted(seconds.items())}},
            indent=1,
        )
        + "\n"
    )
    return _state(seconds, m["cores"])


def record_page_time(page: str, seconds: float, conditions: str) -> bool:
    """Add one page's time, measured on its own, to ``page_times.json`` and write it into its opening.

    The page's entry under ``separately`` names when and how it was measured, since that
    was not in the build the other times come from. Returns whether its stated time changed.
    """
    record, m = json.loads(PAGE_TIMES.read_text()), machine()
    record["seconds"] = dict(sorted({**record["seconds"], page: round(seconds, 1)}.items()))
    record.setdefault("separately", {})[page] = {"machine": m, "conditions": conditions}
    PAGE_TIMES.write_text(json.dumps(record, indent=1) + "\n")
    return bool(_state({page: round(seconds, 1)}, m["cores"]))


def _state(seconds: dict[str, float], cores: int) -> list[str]:
    """Write each page's time into its opening; the pages whose stated time changed."""
    changed = []
    for page in PAGES:
        if page.stem not in seconds:
            continue
        text = page.read_text()
        new = STATED.sub(stated(seconds[page.stem], cores), text, count=1)
        if new != text:
            page.write_text(new)
            changed.append(page.stem)
    return changed
