"""Two replica groups of FSDP2 training joined by torchft, one of them losing a rank mid-run.

    python tests/torchft_replicas.py --steps S --kill-at K --rejoin-after SECONDS --out DIR

runs a torchft Lighthouse on 127.0.0.1 and two replica groups, each started by its own
``torchrun --nproc-per-node=2 --max-restarts=1`` (FSDP2 inside a group, torchft's
fault-tolerant all-reduce across groups). In group 1's first attempt, rank 1 dies (SIGKILL)
after step K; torchrun restarts group 1, whose workers wait SECONDS (a slow restart: a new
node, a long import), then rejoin the quorum and take the weights from group 0, live,
while group 0 keeps stepping. Every worker appends one JSON line
per step to ``DIR/group<G>-rank<R>.jsonl`` (``{"group", "rank", "step", "participants",
"committed", "params", "attempt", "time"}``, params a digest of the rank's shards after the step),
each group's output goes to ``DIR/group<G>.log``, and the driver prints the exit codes. Run it in a network namespace with only loopback
(``tests/isolation.py``): torchft's manager listens on every interface.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta


def worker(steps: int, kill_at: int, rejoin_after: float, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    group = int(os.environ["REPLICA_GROUP"])
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    if not first_attempt:
        time.sleep(rejoin_after)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict():  # this rank's shards: the same rank of a live group holds the same slices
        return {"params": [p.detach().to_local().clone() for p in model.parameters()]}

    @torch.no_grad()
    def load_state_dict(state):
        for p, shard in zip(model.parameters(), state["params"]):
            p.to_local().copy_(shard)

    timeout = timedelta(seconds=30)
    across = ProcessGroupGloo(timeout=timeout)  # reconfigured by torchft for each quorum
    manager = Manager(
        pg=across, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"group{group}", rank=rank, world_size=world, hostname="127.0.0.1",
        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], init_sync=False, timeout=timeout, quorum_timeout=timeout,
        # weights to a rejoining group over the process group, not HTTP on the host's name
        checkpoint_transport=PGTransport(across, timeout=timeout, device=torch.device("cpu")),
    )
    while manager.current_step() < steps:
        manager.start_quorum()
        manager.wait_quorum()  # a rejoining group learns the step here, with the weights
        step = manager.current_step()
        batch = torch.Generator().manual_seed(1000 * step + 10 * group + rank)  # each group's own data
        x, y = torch.randn(8, 16, generator=batch), torch.randint(4, (8,), generator=batch)
        nn.functional.cross_entropy(model(x), y).backward()  # FSDP reduce-scatters within the group
        for work in [manager.allreduce(p.grad.to_local()) for p in model.parameters()]:  # across groups
            work.wait()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        shards = b"".join(bytes(p.detach().to_local().flatten().view(torch.uint8).tolist()) for p in model.parameters())
        with open(os.path.join(out, f"group{group}-rank{rank}.jsonl"), "a") as log:
            log.write(json.dumps({"group": group, "rank": rank, "step": step, "participants": manager.num_participants(),
                                  "committed": committed, "params": hashlib.sha1(shards).hexdigest()[:12],
                                  "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "time": time.time()}) + "\n")
        if group == 1 and rank == 1 and first_attempt and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)  # a step of real work would take this long; it gives group 1 time to come back
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, required=True)
    parser.add_argument("--rejoin-after", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.kill_at, args.rejoin_after, args.out)
    from torchft.coordination import LighthouseServer

    # A replica that stops heartbeating for a second is dropped from the next quorum: the others go on without it.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    groups = []
    for group in (0, 1):
        env = {**os.environ, "REPLICA_GROUP": str(group), "GLOO_SOCKET_IFNAME": "lo",
               # its address as a number: the lighthouse advertises the host's name
               "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a store per attempt (see test_llm's restart tests)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--local-addr=127.0.0.1",
                   __file__, "--worker", "--steps", str(args.steps), "--kill-at", str(args.kill_at),
                   "--rejoin-after", str(args.rejoin_after), "--out", args.out]
        # To a file, not a pipe: torchft logs every step, and a pipe read only at the end fills and blocks the group.
        with open(os.path.join(args.out, f"group{group}.log"), "w") as log:
            groups.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for group, proc in enumerate(groups):
            proc.wait(timeout=240)
            print(f"group {group} exited with {proc.returncode}", flush=True)
    finally:
        for proc in groups:
            proc.kill()
        lighthouse.shutdown()


if __name__ == "__main__":
    main()
