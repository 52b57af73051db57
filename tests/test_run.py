"""fsdp_guide.run: an unmodified torchrun script on N local ranks (real processes, gloo)."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_scripts import CLAIMS, SCRIPTS

import fsdp_guide
from fsdp_guide import LaunchError, launch, run


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def nothing_left():
    """Every process a test's run started is gone when it returns (the warm server, if any, was there before)."""
    before = _children()
    yield
    left = [psutil.Process(pid) for pid in _children() - before if psutil.pid_exists(pid)]
    left = [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left running: {[(p.pid, p.cmdline()) for p in left]}"


def _script(tmp_path: Path, code: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def _without_prefixes(out: str) -> str:
    return re.sub(r"^\[rank\d+\] ", "", out, flags=re.M)


@pytest.mark.parametrize("name", ["quickstart", "deterministic_init"])
def test_a_page_script_runs_unmodified_and_prints_what_its_page_says(name, capfd, nothing_left, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a reader's copy would run
    ranks, check = CLAIMS[name][:2]
    assert run(SCRIPTS / f"{name}.py", nproc=ranks) == 0
    out = capfd.readouterr().out
    assert re.search(r"^\[rank0\] ", out, re.M), out  # streamed with its rank's prefix
    check(_without_prefixes(out))


TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "FROM_THE_CALLER",
)  # fmt: skip

WAITS_FOR_THE_TEST = """
    import json, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist

    folder = Path(sys.argv[1])
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    rank = dist.get_rank()
    seen = {k: os.environ.get(k) for k in KEYS}
    seen.update(argv=sys.argv, path0=sys.path[0], executable=sys.executable, name=__name__, sum=t.item())
    (folder / f"env{rank}.json").write_text(json.dumps(seen))
    (folder / f"ready{rank}").touch()
    while not (folder / "go").exists():  # the test looks at the listening sockets meanwhile
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
""".replace("KEYS", repr(TORCHRUN_ENV))


def test_the_ranks_get_torchruns_environment_and_listen_on_loopback_only(tmp_path, capfd, nothing_left, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the caller's, passed on untouched
    script = _script(tmp_path, WAITS_FOR_THE_TEST)
    before = _children()  # a kernel or server another test left to this worker may listen too: not this run's
    returned = []
    runner = threading.Thread(
        target=lambda: returned.append(
            run(script, nproc=2, args=[str(tmp_path), "--flag"], env={"FROM_THE_CALLER": "1"})
        )
    )
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert runner.is_alive() and time.monotonic() < deadline, capfd.readouterr()
            time.sleep(0.05)
        listening = [
            (p.pid, c.laddr)
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
    finally:
        (tmp_path / "go").touch()
        runner.join(60)
    assert returned == [0], capfd.readouterr()
    assert len({pid for pid, _ in listening}) == 3, listening  # the store, and gloo in each rank
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]
    for rank, env in enumerate(seen):
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank), env
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2", env
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == ("0", "1", "default"), env
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == seen[0]["MASTER_PORT"], env
        assert env["TORCHELASTIC_RUN_ID"] == seen[0]["TORCHELASTIC_RUN_ID"] and env["TORCHELASTIC_RUN_ID"], env
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0"), env
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True", env
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1"), env
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["FROM_THE_CALLER"] == "1", env
        # as `python SCRIPT ARGS` runs it: this Python, the script as __main__, its folder first on sys.path
        assert env["argv"] == [str(script), str(tmp_path), "--flag"], env
        assert (env["executable"], env["name"], env["path0"]) == (sys.executable, "__main__", str(tmp_path)), env
        assert env["sum"] == 2.0, env


RANK_1_RAISES = """
    import time
    import torch.distributed as dist

    def fail():
        raise ValueError("rank 1 fails on purpose")

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        fail()
    try:
        dist.barrier()  # blocked: rank 1 never comes
    except Exception:
        pass
    time.sleep(600)  # and if gloo lets it go, it waits on: ended by run all the same
"""


def test_a_rank_that_raises_is_named_with_its_traceback_and_the_other_is_ended(tmp_path, capfd, nothing_left):
    script = _script(tmp_path, RANK_1_RAISES, "fails.py")
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run(script, nproc=2, timeout=120)
    assert time.monotonic() - start < 60  # not the timeout: the failure ended the run
    error = caught.value
    assert error.rank == 1 and error.failed[1] == 1 and error.exit_code == 1, str(error)
    assert list(error.failed) == [1] and "The other ranks (0) were stopped." in str(error), str(error)
    assert re.search(r'fails\.py", line 1[25] in <module>', error.stacks[0]), error.stacks  # in barrier, or after
    assert str(error).startswith("rank 1 raised ValueError: rank 1 fails on purpose (exit code 1)"), str(error)
    tb = error.remote_traceback
    assert tb.startswith("Traceback (most recent call last):") and 'fails.py", line 10, in <module>' in tb, tb
    assert 'fails.py", line 6, in fail' in tb and "runpy" not in tb and "_script.py" not in tb, tb
    assert "Traceback from rank 1" in str(error)
    err = capfd.readouterr().err  # streamed as Python printed it, through torch's hook that prefixes "[rank1]:"
    assert "\n[rank1]: ValueError: rank 1 fails on purpose" in err and "[rank1] [rank1]" not in err, err
    assert '[rank1]:   File "' + str(script) + '", line 10, in <module>' in err and "runpy" not in err, err


ENDS_AS_PYTHON_DOES = """
    import atexit, os, sys, threading, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = open(f"rank{rank}.log", "w")  # never closed: the end of the process flushes it
    log.write("written, not flushed")
    atexit.register(print, f"atexit on rank {rank}")
    threading.Thread(target=lambda: (time.sleep(0.5), print(f"thread done on rank {rank}", flush=True))).start()
    dist.barrier()  # no rank tears the group down while its peer still connects (see test_live's HELLO)
    dist.destroy_process_group()
    sys.exit(int(os.environ.get("STATUS", "0")))
"""


def test_a_script_ends_as_python_ends_it_threads_atexit_and_open_files(tmp_path, capfd, nothing_left, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(_script(tmp_path, ENDS_AS_PYTHON_DOES, "ends.py"), nproc=2, timeout=120) == 0
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.log").read_text() == "written, not flushed"
        assert f"[rank{rank}] thread done on rank {rank}" in out and f"[rank{rank}] atexit on rank {rank}" in out, out
        assert out.index(f"thread done on rank {rank}") < out.index(f"atexit on rank {rank}"), out


@pytest.mark.parametrize(("exit_with", "status"), [("3", 3), ("'a message'", 1), ("None", 0)])
def test_a_scripts_sys_exit_gives_its_status(exit_with, status, tmp_path, capfd, nothing_left):
    script = _script(tmp_path, f"import sys\nprint('ran')\nsys.exit({exit_with})\n", "exits.py")
    if status == 0:
        assert run(script, nproc=1, timeout=120) == 0
    else:
        with pytest.raises(LaunchError) as caught:
            run(script, nproc=1, timeout=120)
        assert caught.value.failed == {0: status}, str(caught.value)
    captured = capfd.readouterr()
    assert "[rank0] ran" in captured.out
    assert ("a message" in captured.err) == (exit_with == "'a message'"), captured.err


HANGS = """
    import time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("initialised", flush=True)
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never calls it
    else:
        time.sleep(600)
"""


def test_a_hang_ends_at_the_timeout_with_each_ranks_stack(tmp_path, capfd, nothing_left):
    script = _script(tmp_path, HANGS, "hangs.py")
    with pytest.raises(LaunchError) as caught:
        run(script, nproc=2, timeout=15)
    error = caught.value
    assert capfd.readouterr().out.count("initialised") == 2  # both were past init_process_group
    assert "did not finish within timeout=15 s" in str(error) and error.ranks == [0, 1], str(error)
    assert set(error.stacks) == {0, 1}, str(error)
    assert "barrier" in error.stacks[0] and 'hangs.py", line 8' in error.stacks[0], error.stacks[0]
    assert 'hangs.py", line 10' in error.stacks[1], error.stacks[1]
    assert all(stack.splitlines()[-1].endswith("in <module>") for stack in error.stacks.values()), error.stacks


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda d: run(d / "missing.py"), r"script '.*missing\.py' does not exist .*give the path of a Python file"),
        (lambda d: run(d), r"is a directory"),
        (lambda d: run(d / "ok.py", nproc=0), r"nproc must be an int >= 1 .* got 0"),
        (lambda d: run(d / "ok.py", nproc=True), r"nproc must be an int >= 1"),
        (lambda d: run(d / "ok.py", args="--steps 10"), r"args must be a list of strings.*shlex\.split"),
        (lambda d: run(d / "ok.py", args=["--steps", 10]), r"args must be a list of strings.*10 is a int"),
        (lambda d: run(d / "ok.py", timeout=0), r"timeout must be a finite number of seconds > 0"),
        (lambda d: run(d / "ok.py", env={"RANK": "3"}), r"env sets RANK, which run sets for each rank"),
        (lambda d: run(d / "ok.py", env={"X": 1}), r"env must be a dict of str to str"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(call, words, tmp_path):
    (tmp_path / "ok.py").write_text("print('never run')\n")
    before = _children()
    with pytest.raises(ValueError, match=words):
        call(tmp_path)
    assert _children() == before


def test_launch_of_a_function_that_initialises_its_own_group_says_to_use_run(monkeypatch, nothing_left):
    monkeypatch.setenv("FSDP_GUIDE_WARM", "0")  # cold ranks: no server left behind by this test

    def main():
        import torch.distributed as dist

        dist.init_process_group("gloo")

    with pytest.raises(LaunchError, match=r"main called init_process_group.*fsdp_guide\.run\('train\.py'"):
        launch(main, world_size=2, output="none")


def test_run_is_exported():
    assert fsdp_guide.run is run and "run" in fsdp_guide.__all__ and "run" in dir(fsdp_guide)
