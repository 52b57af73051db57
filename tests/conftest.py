"""Paths shared by the tests, and the one execution of every tutorial that both the notebook tests and the site build use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Nothing is downloaded: Hugging Face libraries read this when imported, and the ranks inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))
NOTEBOOKS = TUTORIALS + sorted((ROOT / "docs").glob("*.py"))  # pages that execute code: the tutorials and the cluster page


def _execute(tutorial: Path, tmp_dir: Path):
    """The tutorial converted to .ipynb by jupytext and executed by pytest-notebook."""
    # Imported here: the package's tests (`nox -s torch`) run without the notebook tools.
    import jupytext
    from nbclient.exceptions import DeadKernelError
    from pytest_notebook.nb_regression import NBRegressionFixture

    # The tutorials are .py files without stored outputs: there is nothing to diff against,
    # so the check is that every cell runs (a cell error fails the test) and the assertions
    # the tutorials make in their own cells hold.
    execute = NBRegressionFixture(
        exec_timeout=180,
        exec_cwd=str(ROOT / "tutorials"),
        diff_ignore=("/cells/*/outputs", "/cells/*/execution_count", "/metadata"),
    )
    notebook = tmp_dir / f"{tutorial.stem}.ipynb"
    jupytext.write(jupytext.read(tutorial), notebook)
    try:
        return execute.check(str(notebook)).nb_final
    except DeadKernelError:  # the intermittent kernel crash described at KERNEL_CRASH below: once more
        return execute.check(str(notebook)).nb_final


class Executed(dict):
    """Tutorial stem -> executed notebook, executed the first time a test asks for it.

    Lazy, so that ``pytest -k lora`` executes the LoRA page alone; the site build asks for
    every page (``execution_cache``). A page that failed raises its error wherever it is used.
    """

    def __init__(self, tmp_dir: Path):
        super().__init__()
        self.tmp_dir, self.errors, self.seconds = tmp_dir, {}, {}

    def __missing__(self, stem):
        if stem not in self.errors:
            page = next(p for p in NOTEBOOKS if p.stem == stem)
            try:
                start = time.perf_counter()
                self[stem] = _execute(page, self.tmp_dir)
                self.seconds[stem] = time.perf_counter() - start
                return self[stem]
            except Exception as error:  # noqa: BLE001  (fails that page's tests, not every test)
                self.errors[stem] = error
        raise self.errors[stem]


@pytest.fixture(scope="session")
def executed(tmp_path_factory) -> Executed:
    """Every notebook page, executed at most once per test run by pytest-notebook."""
    return Executed(tmp_path_factory.mktemp("notebooks"))


@pytest.fixture(scope="session")
def execution_cache(executed, tmp_path_factory) -> Path:
    """A jupyter-cache holding the executed tutorials, for the site build to read.

    myst-nb's ``nb_execution_mode=cache`` takes a notebook's outputs from the cache when
    its code cells match, and the cells are the same whether jupytext or myst-nb reads the
    .py file: the site then shows the outputs the notebook tests checked, instead of
    executing every tutorial a second time. A tutorial missing here is executed by the build.
    """
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    path = tmp_path_factory.mktemp("jupyter_cache")
    cache = get_cache(str(path))
    for tutorial in NOTEBOOKS:
        try:
            executed[tutorial.stem]
        except Exception:  # noqa: BLE001  (its own tests report it; the build executes it again)
            continue
        else:
            seconds = {"execution_seconds": executed.seconds[tutorial.stem]}  # shown by the site's exec table
            cache.cache_notebook_bundle(CacheBundleIn(executed[tutorial.stem], uri=str(tutorial), data=seconds))
    return path


def sphinx(builder: str, out, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", builder, *options]
    cmd += ["-d", str(out / "doctrees"), str(ROOT), str(out / builder)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


# An intermittent crash of the notebook *kernel* process (libzmq aborts with
# "Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)"), seen in about 1 of 10
# full builds with ipykernel 7.4: the build is retried once for that crash alone, so a
# real failure (a cell error, a warning, a second crash) still fails the test.
KERNEL_CRASH = "Assertion failed: pfd.revents & POLLIN"


@pytest.fixture(scope="session")
def site(tmp_path_factory, execution_cache):
    """The site built once per test run, with -W, showing the executions above; test_site and test_browser read it."""
    for attempt in range(2):
        out = tmp_path_factory.mktemp("site")
        # The notebooks' outputs come from the execution above, through the cache.
        build = sphinx("html", out, "-D", "nb_execution_mode=cache", "-D", f"nb_execution_cache_path={execution_cache}")
        if build.returncode == 0 or KERNEL_CRASH not in build.stdout + build.stderr:
            break
    assert build.returncode == 0, build.stdout + build.stderr  # -W: a warning fails the build
    return out / "html"
