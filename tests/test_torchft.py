"""torchft's live recovery with FSDP2 inside each replica group: a group loses a rank, the other keeps training, the group rejoins with the live weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from isolation import linux_only, loopback_only  # torchft's manager listens on every interface: only lo exists there

STEPS, KILL_AT = 150, 10


def _steps(out: Path, group: int, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"group{group}-rank{rank}.jsonl").read_text().splitlines()]


@linux_only
def test_a_replica_group_that_loses_a_rank_rejoins_with_the_live_groups_weights_while_it_keeps_training(tmp_path):
    command = [sys.executable, str(Path(__file__).with_name("torchft_replicas.py")), "--steps", str(STEPS),
               "--kill-at", str(KILL_AT), "--rejoin-after", "1", "--out", str(tmp_path)]
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=300)
    logs = "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("group?.log")))
    assert done.returncode == 0 and "group 0 exited with 0" in done.stdout and "group 1 exited with 0" in done.stdout, \
        done.stdout + done.stderr + logs
    assert "failed (exitcode: -9) local_rank: 1" in (tmp_path / "group1.log").read_text()  # the SIGKILL, as torchrun saw it

    for rank in (0, 1):
        live, restarted = _steps(tmp_path, 0, rank), _steps(tmp_path, 1, rank)
        # group 0 never stopped: every step once from where it joined (the group that starts second
        # takes the weights of the first, as a rejoining one does) to the last, every step committed
        assert [s["step"] for s in live] == list(range(live[0]["step"], STEPS)) and live[0]["step"] < KILL_AT
        assert all(s["committed"] for s in live)
        back = [s for s in restarted if s["attempt"] == 1]
        assert [s["step"] for s in restarted if s["attempt"] == 0][-1] == KILL_AT
        # the quorum shrank: group 0 stepped alone while group 1 was away, then grew back to 2
        alone = [s for s in live if KILL_AT < s["step"] < back[0]["step"]]
        assert len(alone) >= 3 and all(s["participants"] == 1 for s in alone), live
        assert all(s["participants"] == 2 for s in live if s["step"] > back[0]["step"])
        # group 1 came back at group 0's current step, not at 0 nor at a checkpoint (there is none),
        # and from then on holds the same shards as group 0's same rank after every step, bit for bit
        by_step = {s["step"]: s["params"] for s in live}
        assert [s["step"] for s in back] == list(range(back[0]["step"], STEPS))
        assert all(s["params"] == by_step[s["step"]] for s in back)
