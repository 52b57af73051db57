"""torchft, as torchrun scripts: two replica groups train one model; one loses a rank, the other trains on.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 500 --heartbeat_timeout_ms 1000 --bind 127.0.0.1:29510 &
    LIGHTHOUSE=$!
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc-per-node=2 --max-restarts=1 torchft_recovery.py &
    GROUP_0=$!
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc-per-node=2 --max-restarts=1 torchft_recovery.py --kill-after 8
    wait $GROUP_0
    kill $LIGHTHOUSE

A Lighthouse (torchft's quorum server) and a torchrun per replica group, on one machine. Each group
holds a whole copy of the model, sharded by FSDP2 over its 2 ranks; each step, torchft's Manager
forms a quorum of the groups that are up and averages their gradients across them. In torchrun's
first attempt, group 1's rank 1 kills itself after step 8 (SIGKILL, as the kernel's OOM killer
would): torchrun restarts group 1 alone, group 0 goes on stepping in a quorum of its own, and the
restarted group joins the next quorum and receives the step, the weights and the optimizer state
from group 0 over the network, not from a checkpoint. The run ends once both groups have stepped
together past step 20. Each rank prints a digest of its shards: the same rank of both groups holds
the same bytes. (A fresh store per torchrun attempt, TORCH_DISABLE_SHARE_RDZV_TCP_STORE: on the one
torchrun keeps, a restarted rank can read a dead rank's address.) Needs torch and torchft; each rank
computes on its accelerator where there is one (give each group GPUs of its own with
CUDA_VISIBLE_DEVICES), else on the CPU (gloo).
"""

import argparse
import hashlib
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing.pg_transport import PGTransport

GROUPS, STEPS = 2, 20
STEP_SECONDS = 0.1  # a real model's step takes a while: this one's would race through hundreds during a restart


def say(line):
    """Print a line in one write: ranks of both groups print at once, and a line written in two
    parts (its text, then its newline) can interleave with another's."""
    print(line + "\n", end="", flush=True)


def build(device):
    torch.manual_seed(
        0
    )  # the same weights in every group: no sync needed at step 0 (init_sync=False)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step, group, rank, device):
    """This rank's rows of the step: a function of the step, so a group that rejoins reads the right ones."""
    g = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
    return torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)


def recoverable_state(model, optimizer):
    """What a live group sends a restarted one (this rank's shards: the same rank of every group holds
    the same slices), and how the restarted one loads it, as its own parameters are placed."""
    params = dict(model.named_parameters())

    def local(value):
        return value.to_local() if isinstance(value, DTensor) else value

    def state_dict():
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": tree_map(local, model_state), "optim": tree_map(local, optim_state)}

    def load_state_dict(state):  # torchft calls it in should_commit, before the optimizer step
        def placed(name, shard):
            p = params[name]
            return DTensor.from_local(
                shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )

        optim = {
            "param_groups": state["optim"]["param_groups"],
            "state": {
                name: {k: v if k == "step" else placed(name, v) for k, v in kept.items()}
                for name, kept in state["optim"]["state"].items()
            },
        }
        model_state = {name: placed(name, shard) for name, shard in state["model"].items()}
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim)

    return state_dict, load_state_dict


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--kill-after", type=int, help="this group's rank 1 dies after that step, once"
    )
    kill_after = parser.parse_args().kill_after
    # The rank's device: an accelerator of its own where each rank on this machine has one, else the CPU.
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
    group, attempt = (
        int(os.environ["REPLICA_GROUP_ID"]),
        int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    )
    dist.init_process_group(
        dist.get_default_backend_for_device(device)
    )  # this group's ranks: FSDP2's
    rank = dist.get_rank()
    model, optimizer = build(device)
    state_dict, load_state_dict = recoverable_state(model, optimizer)

    timeout = timedelta(seconds=30)
    # across groups, rebuilt by torchft for each quorum; the state goes to a rejoining group over it
    across = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
    manager = Manager(
        pg=across,
        min_replica_size=1,  # the others go on while a group is away
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{group}",
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timeout,
        checkpoint_transport=PGTransport(across, timeout=timeout, device=device),
    )
    seen, deadline = None, time.monotonic() + 120
    while True:
        started = time.monotonic()
        manager.start_quorum()
        manager.wait_quorum()  # a rejoining group learns the step here (the state is loaded in should_commit)
        step = manager.current_step()
        x, y = batch(step, group, rank, device)
        F.mse_loss(model(x), y).backward()
        # summed over the groups in the quorum, divided by their number; a group receiving the state adds zeros
        for work in [manager.allreduce(p.grad.to_local()) for p in model.parameters()]:
            work.wait()
        if manager.should_commit():  # every rank of the group says yes (no error, no lost peer)
            optimizer.step()
        optimizer.zero_grad()
        quorum = (manager.num_participants(), manager.is_participating())
        if rank == 0 and quorum != seen:
            receiving = "" if quorum[1] else ", this group receiving the state"
            say(
                f"group {group} attempt {attempt}: step {step}, {quorum[0]} group(s) averaging{receiving}"
            )
        seen = quorum
        if kill_after is not None and rank == 1 and attempt == 0 and step >= kill_after:
            say(f"group {group} rank 1: killed after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no goodbye to the quorum
        if manager.current_step() > STEPS and manager.num_participants() == GROUPS:
            break  # every group is in this quorum: they all stop here
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"group {group}: the {GROUPS} groups did not step together again within 120 s"
            )
        time.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - started)))

    shards = b"".join(p.to_local().detach().cpu().numpy().tobytes() for p in model.parameters())
    say(
        f"group {group} rank {rank} attempt {attempt}: stopped after step {manager.current_step() - 1}, "
        f"shards sha256 {hashlib.sha256(shards).hexdigest()[:16]}"
    )
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
