"""When a rank dies, as a torchrun script: torchrun restarts every worker, and they resume from a checkpoint.

    torchrun --nproc-per-node=2 --max-restarts=1 rank_dies.py

Two ranks train a small FSDP2 model for 8 steps and save a DCP checkpoint every 3 steps, each into
a temporary folder renamed once every rank has written (a save cut short is never resumed from). In
torchrun's first attempt rank 1 kills itself after step 5 (SIGKILL, as the kernel's OOM killer
would); torchrun stops rank 0 and starts both again, once (``--max-restarts=1``). The same command
then resumes from the newest complete checkpoint (step 3's), model, optimizer and step, computes
steps 4 to 8, and rank 0 compares the final weights with a run of the same 2 ranks that was never
interrupted: equal bit for bit, because each step's data is a function of the step. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

STEPS, EVERY, DIES_AFTER = 8, 3, 5
CHECKPOINTS = Path("checkpoints")  # in the working directory


def build(device):
    torch.manual_seed(0)  # the same weights on every rank, and in every attempt
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step, rank, device):
    g = torch.Generator().manual_seed(
        1000 * step + rank
    )  # the data: a function of the step and rank
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def save(model, optimizer, step):
    """Every rank writes its shards into step-N.tmp; rank 0 renames it once all have written."""
    model_state, optim_state = get_state_dict(model, optimizer)
    folder = CHECKPOINTS / f"step-{step:04d}"
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{folder}.tmp")
    dist.barrier()  # every rank's part is on disk
    if dist.get_rank() == 0:
        os.rename(f"{folder}.tmp", folder)
    dist.barrier()


def resume(model, optimizer):
    """Load the newest complete checkpoint, if any; the step it was saved after (0: none)."""
    complete = sorted(CHECKPOINTS.glob("step-????"))  # a .tmp folder is a save cut short
    if not complete:
        return 0
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=complete[-1])  # in place, into this rank's shards
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(complete[-1].name.split("-")[1])


def main():
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
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # torchrun's: 0, then 1 after a restart
    # torchrun keeps one store for all its attempts and hands it to the ranks: a key per attempt, so
    # that a restarted rank never reads an address the previous attempt's ranks published.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
    )
    store = dist.PrefixStore(f"attempt-{attempt}", store)
    dist.init_process_group(
        dist.get_default_backend_for_device(device), store=store, rank=rank, world_size=world_size
    )

    if attempt == 0 and rank == 0:
        shutil.rmtree(
            CHECKPOINTS, ignore_errors=True
        )  # this demo starts afresh each time it is run
        CHECKPOINTS.mkdir()
    dist.barrier()
    model, optimizer = build(device)
    done = resume(model, optimizer)  # the same command on a first start and on a restart
    if rank == 0:
        print(
            f"attempt {attempt}: "
            + (f"resumed after step {done}" if done else "no checkpoint, starting at step 1"),
            flush=True,
        )
    for step in range(done + 1, STEPS + 1):
        train_step(model, optimizer, step, rank, device)
        if attempt == 0 and rank == 1 and step == DIES_AFTER:
            print(f"attempt {attempt}: rank 1 killed after step {step}", flush=True)
            os.kill(
                os.getpid(), signal.SIGKILL
            )  # no exception, no cleanup; torchrun sees exit code -9
        if step % EVERY == 0:
            save(model, optimizer, step)

    # The run that was never interrupted, on the same ranks: it must end with the same weights.
    straight, straight_optimizer = build(device)
    for step in range(1, STEPS + 1):
        train_step(straight, straight_optimizer, step, rank, device)
    gap = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), straight.parameters())
    )
    if rank == 0:
        print(
            f"{STEPS} steps on {world_size} ranks, rank 1 killed after step {DIES_AFTER}, resumed after step {done} "
            f"in attempt {attempt}: max |weight difference| vs a run never interrupted = {gap}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
