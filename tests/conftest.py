"""Paths shared by the tests, and the one execution of every tutorial that the notebook tests and the site build use."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Nothing is downloaded: Hugging Face libraries read this when imported, and the ranks inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"
# scikit-learn sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK as it is imported (the digits
# tests import it). Imported before any launch, it does not change halfway through the session
# the environment the warm server started in, which would start another server.
import sklearn  # noqa: E402, F401

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))
# pages that execute code: the tutorials and the cluster page
NOTEBOOKS = TUTORIALS + sorted((ROOT / "docs").glob("*.py"))


# The pages are executed as the site build executes them (docs/_ext/execution.py): two
# at a time, each in its own kernel with its folder as working directory, into a jupyter-cache.
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from execution import Execution, MachineLock, execution_order, recorded_seconds  # noqa: E402

WANTED = pytest.StashKey[list]()
PAGE_FIXTURES = {"executed", "execution_cache", "site"}


# `nox -s tests` runs the tests two at a time (pytest-xdist, --dist loadscope). A test's scope is
# its group: the tests that use the executed pages are one, which one worker takes whole (it
# executes the pages once, two at a time as the build does, and builds the site once); every
# other module is one, so that its fixtures are set up once. xdist's loadgroup would carry the
# group in the test's id, which pytest 9.2 no longer lets a plugin change: the workers write the
# groups of what they collected to a file, and the scheduler (ByGroup) reads it. The pages'
# alone cells (a machine-wide byte counter, a timed schedule) take the machine from the other
# worker's tests: the workers share a MachineLock in the same folder.
def _uses_the_pages(item) -> bool:
    return bool(PAGE_FIXTURES & set(getattr(item, "fixturenames", ())))


def _group(item) -> str:
    return "pages" if _uses_the_pages(item) else item.nodeid.split("::")[0]


def _run_folder(config) -> str:
    """The folder the controller shares with its workers (the groups, the MachineLock's files), made once."""
    if not hasattr(config, "fsdp_guide_run_folder"):
        config.fsdp_guide_run_folder = tempfile.mkdtemp(prefix="fsdp-guide-tests-")
        config.add_cleanup(lambda: shutil.rmtree(config.fsdp_guide_run_folder, ignore_errors=True))
    return config.fsdp_guide_run_folder


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the process that starts the workers
def pytest_configure_node(node):
    node.workerinput["fsdp_guide_run_folder"] = _run_folder(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    folder = Path(_run_folder(config))

    class ByGroup(LoadScopeScheduling):
        """loadscope, with each test's group for its scope (written by the workers once they have collected)."""

        groups: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            if not self.groups:
                # every worker writes the same groups; none written (a worker that never reached
                # collection's end): each module its own scope, xdist's loadscope
                for written in sorted(folder.glob("groups-*.json"))[:1]:
                    self.groups.update(json.loads(written.read_text()))
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return ByGroup(config, log)


def _machine_lock_folder(config) -> Path | None:
    """The folder of the workers' MachineLock, in an xdist worker; None in a run of one process."""
    folder = getattr(config, "workerinput", {}).get("fsdp_guide_run_folder")
    return Path(folder) / "machine" if folder else None


MACHINE = pytest.StashKey[MachineLock]()


def pytest_configure(config):
    if folder := _machine_lock_folder(config):
        config.stash[MACHINE] = MachineLock(folder)  # this worker's share: its tests and their background work


def machine_share(config) -> contextlib.AbstractContextManager:
    """Held while a test's work runs: this worker's share of the machine (nothing in a run of one process)."""
    lock = config.stash.get(MACHINE, None)
    return lock.share() if lock else contextlib.nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that does not use the pages runs (set-up to teardown) with a share of the machine."""
    if _uses_the_pages(item):
        return (yield)
    with machine_share(item.config):
        return (yield)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config, items):
    """The pages this run's tests will ask for, so that they execute together from the first ask on."""
    wanted = set()
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "site" in names or "execution_cache" in names:
            wanted = set(NOTEBOOKS)
            break
        callspec = getattr(item, "callspec", None)
        if "executed" in names and callspec is not None and "tutorial" in callspec.params:
            wanted.add(callspec.params["tutorial"])
    config.stash[WANTED] = execution_order(wanted, recorded_seconds(ROOT))
    if hasattr(config, "workerinput"):  # the groups, for the controller's scheduler (ByGroup)
        folder, worker = Path(config.workerinput["fsdp_guide_run_folder"]), config.workerinput["workerid"]
        (folder / f"{worker}.tmp").write_text(json.dumps({item.nodeid: _group(item) for item in items}))
        (folder / f"{worker}.tmp").rename(folder / f"groups-{worker}.json")  # whole, when the scheduler reads it


class Executed(dict):
    """Tutorial stem -> executed notebook, executed the first time a test asks for it.

    The first ask starts every page this run's tests ask for (``pytest -k lora`` executes
    the LoRA page alone; the site build asks for every page), two at a time, in
    ``execution_order``; each ask waits for its page. A page that failed raises its
    error (``execution.PageFailed``) wherever it is used.
    """

    def __init__(self, cache_path: Path, wanted: list[Path], machine_lock: Path | None = None):
        super().__init__()
        self.cache_path, self.wanted = cache_path, wanted
        self.execution = Execution(cache_path, workers=2, timeout=180, machine_lock=machine_lock)

    def __missing__(self, stem):
        page = next(p for p in NOTEBOOKS if p.stem == stem)
        futures = self.execution.submit_all(self.wanted)
        self[stem] = self.execution.submit(page).result()
        if all(future.done() for future in futures.values()):  # the pages' warm servers are not kept for
            self.execution.close_servers()  # the rest of the run, where tests count this process's children
        return self[stem]


@pytest.fixture(scope="session")
def executed(request, tmp_path_factory):
    """Every notebook page, executed at most once per test run."""
    wanted = request.config.stash.get(WANTED, [])
    pages = Executed(tmp_path_factory.mktemp("jupyter_cache"), wanted, _machine_lock_folder(request.config))
    yield pages
    pages.execution.stop()  # pages no test asked for are not started, or not waited for (after a Ctrl-C too)


@pytest.fixture(scope="session")
def execution_cache(executed) -> Path:
    """The jupyter-cache holding the executed tutorials, for the site build to read.

    myst-nb's ``nb_execution_mode=cache`` takes a notebook's outputs from the cache when
    its code cells match, and the cells are the same whether jupytext or myst-nb reads the
    .py file: the site then shows the outputs the notebook tests checked, instead of
    executing every tutorial a second time. A tutorial missing here is executed by the build.
    """
    for tutorial in NOTEBOOKS:
        try:
            executed[tutorial.stem]
        except Exception:  # noqa: BLE001  (its own tests report it; the build executes it again)
            continue
    return executed.cache_path


def sphinx(builder: str, out, *options: str, doctrees=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", builder, *options]
    cmd += ["-d", str(doctrees or out / "doctrees"), str(ROOT), str(out / builder)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


def site_options(execution_cache) -> list[str]:
    """The site build's options: a build with the same ones reuses its doctrees (reads no page again)."""
    return ["-D", "nb_execution_mode=cache", "-D", f"nb_execution_cache_path={execution_cache}"]


@pytest.fixture(scope="session")
def site(tmp_path_factory, execution_cache):
    """The site built once per test run, with -W, showing the executions above; test_site and test_browser read it."""
    out = tmp_path_factory.mktemp("site")
    # The notebooks' outputs come from the execution above, through the cache: the build starts no kernel
    # (a page that failed there is executed again, and fails the build too).
    build = sphinx("html", out, "-j", "auto", *site_options(execution_cache))
    assert build.returncode == 0, build.stdout + build.stderr  # -W: a warning fails the build
    return out / "html"
