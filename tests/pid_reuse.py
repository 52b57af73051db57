"""A process takes the number of a rank that exited while the launch runs on: does the launch leave it alone?

Run by tests/test_launcher.py in a pid namespace of its own (``unshare --pid --fork
--mount-proc``), so that only this script's processes take numbers there: outside one, any
process on the machine may be given the number first (pid_max is 32768 and every thread takes
one), and whether the sleep got it would rest on what else the machine was starting.

    python tests/pid_reuse.py FOLDER   # FSDP_GUIDE_WARM=0 or 1; prints one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fsdp_guide import LaunchError, launch

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")  # the last pid given out: writing N makes the next one N + 1


def _rank_1_leaves_early(pid_folder):
    import torch.distributed as dist

    (Path(pid_folder) / f"rank{dist.get_rank()}.tmp").write_text(str(os.getpid()))
    (Path(pid_folder) / f"rank{dist.get_rank()}.tmp").rename(Path(pid_folder) / f"rank{dist.get_rank()}.pid")
    dist.barrier()  # both pids written
    if dist.get_rank() == 1:
        raise ValueError("rank 1 leaves early")
    time.sleep(30)  # rank 0 works on; the launch stops it once it sees rank 1 fail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a zombie not yet reaped counts: its number is still taken
    except ProcessLookupError:
        return False
    return True


def _take_the_number_when_it_is_free(folder: Path, seen: dict, stop: threading.Event) -> None:
    """Wait for rank 1's number to be free, note whether rank 0 still ran then, and start a `setsid sleep` with it."""
    while not (folder / "rank1.pid").exists() or not (folder / "rank0.pid").exists():
        if stop.wait(0.001):
            return
    rank0, rank1 = int((folder / "rank0.pid").read_text()), int((folder / "rank1.pid").read_text())
    while _alive(rank1):
        if stop.wait(0.001):
            return
    seen["free while rank 0 ran"] = _alive(rank0)
    seen["rank 1"], seen["tries"] = rank1, []
    for _ in range(20):  # rank 0, still running here, may start a thread first: it takes a number too
        NS_LAST_PID.write_text(str(rank1 - 1))
        sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
        seen["tries"].append(sleeper.pid)
        if sleeper.pid == rank1:
            seen["sleeper"] = sleeper
            return
        sleeper.kill()
        sleeper.wait()


def main(folder: Path) -> dict:
    seen, stop = {}, threading.Event()
    thief = threading.Thread(target=_take_the_number_when_it_is_free, args=(folder, seen, stop))
    thief.start()
    try:
        launch(_rank_1_leaves_early, str(folder), world_size=2, output="none")
        error = None
    except LaunchError as e:
        error = str(e)
    time.sleep(0.5)  # the sleep may have got the number after the launch: it must live on too
    stop.set()
    thief.join()
    sleeper = seen.get("sleeper")
    result = {
        "error": error,
        "rank 1": seen.get("rank 1"),
        "numbers the sleep got": seen.get("tries"),
        "free while rank 0 ran": seen.get("free while rank 0 ran"),
        "sleeper alive after the launch": sleeper is not None and sleeper.poll() is None,
    }
    if sleeper is not None:
        sleeper.kill()
        sleeper.wait()
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
