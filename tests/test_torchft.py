"""torchft's live recovery with FSDP2 inside each replica group (fsdp_guide.recipes.replicas), longer than the page's
run: a group loses a rank and restarts slowly, the other keeps training, the group rejoins with the live state."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from isolation import linux_only, loopback_only  # torchft's manager listens on every interface: only lo exists there

from fsdp_guide import launch
from fsdp_guide.recipes import replicas

KILL_AT, AFTER_REJOIN = 10, 10
# Group 1's restart sleeps 3 s before it imports torch, three times the Lighthouse's heartbeat
# timeout (1 s): the quorum drops group 1 while it cannot yet be back, with seconds to spare
# for group 0's steps alone on a loaded machine too.
REJOIN_AFTER = 3


@linux_only
def test_a_replica_group_that_loses_a_rank_rejoins_with_the_live_state_and_all_equal_the_quorums_replay(tmp_path):
    command = [
        sys.executable,
        "-m",
        "fsdp_guide.recipes.replicas",
        "--out",
        str(tmp_path),
        "--kill-at",
        str(KILL_AT),
        "--after-rejoin",
        str(AFTER_REJOIN),
        "--rejoin-after",
        str(REJOIN_AFTER),
    ]
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=300)
    logs = "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("group?.log")))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + logs
    # the SIGKILL, as torchrun saw it
    assert "failed (exitcode: -9) local_rank: 1" in (tmp_path / "group1.log").read_text()

    steps = replicas.read_logs(tmp_path)
    made = replicas.quorums(steps)  # step -> (groups averaged, groups receiving) in the final weights' history
    last = max(line["step"] for lines in steps.values() for line in lines)
    for rank in (0, 1):
        live, restarted = steps[(0, rank)], steps[(1, rank)]
        # group 0 never stopped: every step committed once, from where it joined to the last
        committed = [s["step"] for s in live if s["committed"]]
        assert committed == list(range(live[0]["step"], last + 1)) and live[0]["step"] < KILL_AT
        back = [s for s in restarted if s["attempt"] == 1 and s["committed"]]
        assert [s["step"] for s in restarted if s["attempt"] == 0][-1] == KILL_AT
        # the quorum shrank: group 0 stepped alone while group 1 was away, dividing by 1
        alone = [s for s in live if KILL_AT < s["step"] < back[0]["step"] and s["committed"]]
        assert alone and all(s["participants"] == 1 and made[s["step"]] == ([0], []) for s in alone), live
        # group 1 came back past the step it died at (no checkpoint exists), receiving the live state first
        assert back[0]["step"] > KILL_AT and not back[0]["participating"]
        assert [s["step"] for s in back] == sorted({s["step"] for s in back}) and len(back) >= AFTER_REJOIN
        # then the quorum grew back: both groups averaged a step of the final weights. (Which later steps
        # both averaged rests on heartbeats arriving in time, so it is not asserted step by step;
        # quorums() above raised unless every step's divisor was the number of groups it averaged.)
        assert any(made[s["step"]] == ([0, 1], []) for s in back[1:] if s["step"] in made)

    # every group ends with what the sequence of quorums computed, bit for bit
    replayed = launch(replicas.replay, replicas.quorums(steps), 2, world_size=2, output="none")
    for rank in (0, 1):
        for group in (0, 1):
            final = torch.load(tmp_path / f"final-group{group}-rank{rank}.pt")
            assert all(torch.equal(a, b) for a, b in zip(final, replayed[rank], strict=True)), (group, rank)


def _lines(group, *steps):
    """Rank 0's log of a group: (step, quorum id, participating, participants) per committed step."""
    return [
        {
            "group": group,
            "rank": 0,
            "step": step,
            "quorum": quorum,
            "participating": participating,
            "participants": participants,
            "committed": True,
        }
        for step, quorum, participating, participants in steps
    ]


def test_quorums_follow_the_final_weights_back_past_a_step_two_quorums_computed():
    # Both groups took step 0 alone (quorums 1 and 2: one formed while the other's heartbeat was
    # late); group 1 then received group 0's state at step 1, so its own step 0 is not in the weights.
    logs = {
        (0, 0): _lines(0, (0, 1, True, 1), (1, 3, True, 1), (2, 3, True, 2)),
        (1, 0): _lines(1, (0, 2, True, 1), (1, 3, False, 1), (2, 3, True, 2)),
    }
    assert replicas.quorums(logs) == {0: ([0], []), 1: ([0], [1]), 2: ([0, 1], [])}
    logs[(1, 0)][2]["participants"] = 1  # a divisor the replay would not use
    with pytest.raises(
        ValueError,
        match=r"step 2: groups \[0, 1\] averaged their gradients, but the quorum divided "
        r"by \[1, 2\]",
    ):
        replicas.quorums(logs)


def test_quorums_refuse_groups_that_averaged_a_step_from_different_weights():
    # Both took step 0 alone, and both averaged step 1 without either receiving the other's state.
    logs = {(0, 0): _lines(0, (0, 1, True, 1), (1, 3, True, 2)), (1, 0): _lines(1, (0, 2, True, 1), (1, 3, True, 2))}
    with pytest.raises(
        ValueError,
        match=r"step 1: groups \[0, 1\] averaged their gradients without having "
        r"computed step 0 in one quorum",
    ):
        replicas.quorums(logs)


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        replicas.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--after-rejoin", "0"], "expected --after-rejoin 1 or more (got 0)"),
        (["--rejoin-after", "-1"], "--rejoin-after and --step-seconds 0 or more, finite (got -1, 0.1)"),
        (["--step-seconds", "nan"], "--rejoin-after and --step-seconds 0 or more, finite (got 0, nan)"),
        (["--timeout", "0"], "--timeout above 0, finite (got 0)"),
    ],
)
def test_the_driver_answers_impossible_settings_with_a_usage_error(flags, error, tmp_path, capsys):
    assert error in _usage_error(["--out", str(tmp_path), *flags], capsys)


def test_the_driver_refuses_a_directory_that_holds_a_previous_run_and_writes_nothing_there(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")  # a file of the user's: no run's, so no reason to refuse
    (tmp_path / "group0-rank0.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "stop").write_text("7")
    message = _usage_error(["--out", str(tmp_path)], capsys)
    assert "holds a previous run's files (group0-rank0.jsonl, stop)" in message and "empty directory" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["group0-rank0.jsonl", "notes.txt", "stop"]
    assert (tmp_path / "stop").read_text() == "7"


def test_the_driver_refuses_to_run_where_an_interface_other_than_loopback_exists(tmp_path, capsys, monkeypatch):
    # torchft's manager listens on every interface: the rule the module's docstring states, enforced
    monkeypatch.setattr(replicas.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    message = _usage_error(["--out", str(tmp_path)], capsys)
    assert "interfaces other than loopback exist (eth0)" in message and "loopback_only" in message
    assert list(tmp_path.iterdir()) == []
