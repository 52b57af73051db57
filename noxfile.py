"""The two commands of the README: `nox -s docs` builds the site, `nox -s tests torch` runs every test.

`nox -s lab` opens the tutorials in JupyterLab; `nox -s gpu` is the check for a machine
with GPUs; `nox -s bench` measures speed."""

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# -j auto: Sphinx reads and writes the pages in a process per core (the notebooks execute before,
# docs/_ext/execution.py)
SPHINX = ["sphinx-build", "-W", "--keep-going", "-n", "-j", "auto", "-b", "html"]


# The tests, two at a time, in the groups tests/conftest.py gives them (a module, or every test
# that uses the executed pages): the package's tests alone took 211 s one at a time, 162 s so.
XDIST = ["--numprocesses=2", "--dist=loadscope"]


def install(session: nox.Session, *extras: str) -> None:
    # The pinned environment the site is executed with (torch==2.13.0 among it).
    session.install(*uv_options(session), "-c", "constraints.txt", "-e", f".[{','.join(('test', 'docs', *extras))}]")


def uv_options(session: nox.Session) -> list[str]:
    """What pip does by itself and uv must be told.

    uv reads none of pip's settings: the folders of wheels pip is told to look in
    (PIP_FIND_LINKS), where a machine may keep its torch build (the project's: the CPU one),
    are passed on. And uv writes no bytecode unless asked: where PYTHONDONTWRITEBYTECODE is
    set (the project's machines set it), every process, each rank and kernel among them,
    would compile torch's modules from source each time it imports them."""
    if session.venv_backend != "uv":
        return []
    return [
        "--compile-bytecode",
        *(f"--find-links={folder}" for folder in os.environ.get("PIP_FIND_LINKS", "").split()),
    ]


def install_chromium(session: nox.Session) -> None:
    """The browser tests drive Debian's Chromium (Playwright's own download is not reachable offline)."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        session.error("the browser tests need Chromium: install it (Debian: apt-get install chromium) and rerun")
    session.run("apt-get", "update", "-qq", external=True)
    session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium", external=True)


@nox.session(venv_backend="uv")
def tests(session: nox.Session) -> None:
    """Unit and multi-process tests, every tutorial as a notebook, the doctests, the site build and in a browser."""
    install(session, "jupyter")  # tests/test_jupyter.py: the pages as JupyterLab saves them
    install_chromium(session)
    # The code's form first, in seconds: pyproject.toml's [tool.ruff] (tutorials/ruff.toml for the pages).
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    # Two at a time (pytest-xdist): one worker takes the tests that use the executed pages (it
    # executes them, two at a time, and builds the site), the other every other module, a module
    # at a time (tests/conftest.py); one at a time, 2 cores stood idle a third of the time.
    session.run("pytest", *XDIST, "--durations=15", *session.posargs)  # CI's log names what to make faster


# The supported torch range, tested at both ends: the oldest release pyproject allows, and
# whatever is newest on the package index when the session runs. torchao 0.16 with torch 2.9:
# the oldest torchao that peft 0.21 imports beside (it raises ImportError on older ones); its
# Python float8 runs on 2.9, and it skips its compiled kernels (CUDA-only, built for 2.10).
TORCH = {"oldest": ["torch==2.9.1", "torchao==0.16.0"], "newest": ["--upgrade", "torch", "torchao"]}
# The package's own tests. Left out: the site (executing the pages, the built site, the
# browser, the pages' code, the pages in JupyterLab), the install-alone test (it installs the
# pinned torch), the GPU-run script (it executes the pages), the noxfile's own checks (nox is
# not installed there), and torchft's live recovery (torchft is the pages' library, not the
# package's; it passed on 2.9.1 and on 2.15 when added, and costs half a minute a session), and
# the pages' torchrun scripts (the pages' code, run on the pinned torch the pages executed with).
SITE_TESTS = [
    "test_tutorials.py",
    "test_execution.py",
    "test_site.py",
    "test_browser.py",
    "test_device_generic.py",
    "test_install.py",
    "test_gpu_run.py",
    "test_jupyter.py",
    "test_torchft.py",
    "test_noxfile.py",
    "test_scripts.py",
]
# Also left out: the launcher's handling of processes that start fresh interpreters (a
# script's __main__, a killed parent, a Jupyter kernel, import hygiene, the warm server's
# fallback, warm launches off, what a fork shares: numpy's state, the hash seed, the Hugging Face modules) and its
# waits (timeouts, Ctrl-C). They test the operating
# system and the launcher, not torch, and take over a minute per session that CI's 30 do
# not have; `nox -s tests` runs them.
PROCESS_TESTS = [
    "test_the_parent_does_not_import_torch",
    "test_a_function_defined_in_a_scripts_main_is_shipped_by_value",
    "test_a_killed_parent_leaves_no_rank_no_grandchild_and_no_run_directory",
    "test_interrupting_the_notebook_kernel_stops_every_rank",
    "test_a_launch_whose_torch_environment_changed_gets_a_server_of_that_environment",
    "test_killing_the_launching_process_ends_the_server_the_warm_ranks_and_their_children",
    "test_a_hang_in_a_collective_ends_at_the_timeout",
    "test_a_timeout_names_the_ranks_still_running_and_stops_them",
    "test_a_timeout_shows_the_line_each_rank_is_stuck_on",
    "test_keyboard_interrupt_stops_every_rank",
    "test_warm_launches_can_be_turned_off",
    "test_interrupts_that_keep_coming_while_the_ranks_are_stopped_change_nothing",
    "test_an_interrupt_while_the_warm_server_is_still_importing_ends_the_launch_at_once",
    "test_warm_ranks_draw_different_numpy_numbers_as_cold_ones_do",
    "test_warm_ranks_share_the_string_hash_seed_where_cold_ones_do_not",
    "test_a_warm_rank_starts_with_the_hugging_face_modules_its_parent_imported",
    "test_a_notebook_kernel_that_launched_shuts_down_by_itself",
    # which rank a failure names whatever order the ranks exit in, signals and the stacks they
    # leave, what a rank started and a number an exited rank left, a warm rank's set-up and
    # its process attributes: the launcher's bookkeeping of processes (about 45 s of CI's two
    # torch sessions); the launcher tests that rest on torch (process groups set up and torn
    # down, threads, torchrun, what a warm rank imports) stay.
    "test_the_rank_that_raised_is_the_one_named_whatever_order_the_ranks_exit_in",
    "test_a_rank_killed_by_a_fatal_signal_reports_every_threads_python_stack",
    "test_what_a_rank_started_is_stopped_with_it",
    "test_a_process_that_took_an_exited_ranks_number_and_leads_a_group_survives_the_launch",
    "test_a_warm_rank_whose_set_up_raises_is_reported_as_raising",
    "test_a_warm_rank_starts_with_the_umask_limits_and_nice_value_a_cold_one_would",
]
# The same for the live ranks (fsdp_guide.live) and run's scripts: what they test of torch (state
# across cells, a failure beside a collective, the page scripts under run) stays in the torch
# sessions; their interrupts, timeouts, killed parents, kernels and bad input are the launcher's.
LIVE_PROCESS_TESTS = [
    "test_live.py::test_a_cell_that_hangs_in_a_collective_ends_at_its_timeout_with_the_stack_and_new_ranks",
    "test_live.py::test_an_interrupt_ends_the_cell_on_every_rank_and_keeps_the_state",
    "test_live.py::test_an_interrupt_while_a_rank_waits_in_a_collective_restarts_the_ranks",
    "test_live.py::test_closing_leaves_no_process_and_a_closed_session_says_so",
    "test_live.py::test_the_ranks_end_when_the_process_that_started_them_is_killed",
    "test_live.py::test_bad_options_are_refused_before_any_rank_starts",
    "test_live.py::test_bad_cells_and_calls_are_refused_on_this_side",
    "test_live.py::test_the_magics_in_a_notebook_kernel",
    "test_run.py::test_a_hang_ends_at_the_timeout_with_each_ranks_stack",
    "test_run.py::test_bad_input_is_refused_before_anything_starts",
    "test_run.py::test_a_scripts_sys_exit_gives_its_status",
]


# What one torch session may need on disk: PyPI's torch is the CUDA build, about 3 GB of
# wheels that uv keeps in its cache and 5 GB unpacked in the environment (hard links from
# the cache where both are on one filesystem); a new release comes with new wheels.
TORCH_SESSION_BYTES = 10 * 10**9


def free_space_problem(folders: list[Path], needed: int, installed: bool) -> str | None:
    """Why a torch session would run out of disk, or None: said before the install starts,
    not in the middle of an extraction (where an earlier CI run ran out)."""
    if installed:
        return None  # this release is in the environment already: nothing new to download
    for folder in folders:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        if free < needed:
            return (
                f"{existing} has {free / 1e9:.1f} GB free, and installing torch's CUDA wheels there needs about "
                f"{needed / 1e9:.0f} GB: free some (`uv cache prune` removes uv's unused archives, "
                "`uv cache clean` all of them; old environments in .nox/ can go) and run again"
            )
    return None


def installed_torch(session: nox.Session) -> str | None:
    """The torch version in this session's environment, or None."""
    python = Path(session.virtualenv.location) / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"], capture_output=True, text=True
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def uv_cache_dir() -> Path:
    out = subprocess.run(["uv", "cache", "dir"], capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else Path.home() / ".cache" / "uv"


@nox.session(venv_backend="uv")  # uv: torch's CUDA wheels from PyPI in seconds, and no local cap on the version
@nox.parametrize("release", list(TORCH), ids=list(TORCH))
def torch(session: nox.Session, release: str) -> None:
    """The package's tests on the oldest supported torch and on the newest the index serves."""
    # The pinned versions of everything else: constraints.txt without its torch and torchao.
    pins = [
        line
        for line in Path("constraints.txt").read_text().splitlines()
        if not line.startswith(("torch==", "torchao=="))
    ]
    constraints = Path(session.create_tmp()) / "constraints-but-torch.txt"
    constraints.write_text("\n".join(pins) + "\n")
    wanted = TORCH[release][0].partition("==")[2]  # "" for newest: whatever the index serves now
    have = installed_torch(session)
    problem = free_space_problem(
        [uv_cache_dir(), Path(session.virtualenv.location)],
        TORCH_SESSION_BYTES,
        installed=bool(have) and have.split("+")[0] == wanted,
    )
    if problem:
        session.error(problem)
    session.install("--compile-bytecode", *TORCH[release])
    session.install(
        "--compile-bytecode",
        "-c",
        str(constraints),
        "-e",
        ".[hf]",
        "peft",
        "pytest",
        "pytest-timeout",
        "pytest-xdist",
        "psutil",
        "hypothesis",
        "scikit-learn",
        "matplotlib",  # the package's figures' doctests (fsdp_guide.collectives.draw_flight_recorder)
    )
    session.run(
        "python", "-c", "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
    )
    ignored = [f"--ignore=tests/{name}" for name in SITE_TESTS]
    ignored += [f"--deselect=tests/test_launcher.py::{name}" for name in PROCESS_TESTS]
    ignored += [f"--deselect=tests/{name}" for name in LIVE_PROCESS_TESTS]
    # The magics import IPython, which these sessions do not install (the tests session runs them).
    ignored += ["--ignore=src/fsdp_guide/_magics.py"]
    # A deadlock in a new torch release (one in 2.7's gloo teardown, for one) fails its test
    # after 5 minutes instead of running into CI's limit.
    session.run("pytest", *XDIST, "--timeout=300", "--durations=15", *ignored, *session.posargs)


@nox.session(venv_backend="uv")
def docs(session: nox.Session) -> None:
    """Build the site into _build/html, executing every tutorial.

    `nox -s docs -- --cached` reuses the execution cache for notebooks whose cells did not
    change (the cache keys on the notebook alone: it does not see edits to src/). Other
    arguments after `--` go to sphinx-build (`-D execution_workers=1`: one page at a time).
    """
    install(session)
    fresh = []
    if "--cached" not in session.posargs:
        shutil.rmtree("_build/.jupyter_cache", ignore_errors=True)  # conf.py's nb_execution_cache_path
        # -E: every page read again, so every tutorial executes; otherwise Sphinx reads only the
        # pages changed since the last build, and a change in src/ would leave stale outputs.
        fresh = ["-E"]
    # Cache mode, even when every page executes: docs/_ext/execution.py executes two pages
    # at a time into the cache before Sphinx reads them (myst-nb's "force" executes one by one).
    session.run(*SPHINX, *fresh, *(arg for arg in session.posargs if arg != "--cached"), ".", "_build/html")
    session.log("open _build/html/index.html, or: python -m http.server -b 127.0.0.1 -d _build/html 8000")


# JupyterLab as `nox -s lab` runs it: on loopback;
# the repository as its root, so that jupytext finds jupytext.toml, with the file browser
# on tutorials/; and jupyter/ as its application settings directory, whose overrides.json
# makes a double-click open a .py page as a notebook (read there, never written); and
# jupytext's contents manager with the pages' references to other pages made into links
# JupyterLab follows (fsdp_guide._jupyter: rewritten on open, put back on save).
LAB = [
    "--ServerApp.ip=127.0.0.1",
    "--ServerApp.root_dir=.",
    "--ServerApp.preferred_dir=tutorials",
    "--LabApp.app_settings_dir=jupyter",
    "--ServerApp.contents_manager_class=fsdp_guide._jupyter.ContentsManager",
]


@nox.session(venv_backend="uv")
def lab(session: nox.Session) -> None:
    """JupyterLab on 127.0.0.1, its file browser on tutorials/: a double-click opens a .py tutorial as a notebook.

    The pinned environment with the `jupyter` extra, and two settings given to this
    command only: jupyter/overrides.json (.py files open with jupytext's notebook view),
    and fsdp_guide._jupyter's contents manager (references to other pages become links).
    Arguments after `--` go to `jupyter lab` (e.g. `nox -s lab -- --no-browser --port 8890`).
    """
    session.install(*uv_options(session), "-c", "constraints.txt", "-e", ".[docs,jupyter]")
    # containers often run as root; Jupyter refuses it otherwise
    as_root = ["--allow-root"] if os.geteuid() == 0 else []
    session.run("jupyter", "lab", *LAB, *as_root, *session.posargs)


@nox.session(venv_backend="uv")
def bench(session: nox.Session) -> None:
    """Launcher latency against torchrun and the floor; site build times, notebook times, page weight (see bench/)."""
    install(session)
    session.run("python", "bench/bench_launch.py", *session.posargs)
    session.run("python", "bench/bench_site.py")


# The notebook tools bench/live_cells.py measures %%ranks against, at the versions it was measured with.
LIVE_TOOLS = ["nbdistributed==0.1.0", "jupyter-distributed==0.1.1", "ipyparallel==9.2.0"]


@nox.session(venv_backend="uv")
def bench_live(session: nox.Session) -> None:
    """Notebook cells on 2 ranks: %%ranks and launch against ipyparallel, nbdistributed, jupyter-distributed.

    Arguments after `--` go to bench/live_cells.py (`-- --record` keeps its table in bench/results/)."""
    session.install(*uv_options(session), "-c", "constraints.txt", "-e", ".[test,docs,jupyter]", *LIVE_TOOLS)
    session.run("python", "bench/live_cells.py", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """Execute every page with the ranks on GPUs and the LLM recipe in bf16; record it in src/fsdp_guide/gpu_record.json

    Needs a GPU: it refuses to run (exit status 2) where there is none. On the pinned
    environment pip installs torch==2.13.0 from PyPI, a CUDA build on Linux. On a machine
    whose Python already has a CUDA build of torch and the packages, and no network,
    run `nox -s gpu --no-venv`. Pass page names to run only those: `nox -s gpu -- quickstart`.
    """
    if session.venv_backend != "none":
        install(session)
    session.run("python", "tests/gpu_run.py", *session.posargs)
