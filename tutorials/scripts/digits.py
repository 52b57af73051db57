"""The digits tutorial as a torchrun script: a small CNN learns handwritten digits with FSDP2.

    torchrun --nproc-per-node=2 digits.py

The data are the 1,797 8x8 digits that ship inside scikit-learn (nothing is downloaded). Each rank
trains the sharded model on its part of every epoch, through a DistributedSampler, and tests it on
its half of the test set; all_reduce sums the ranks' counts. Rank 0 then tests the gathered model on
the whole test set, alone, and prints both accuracies. Needs torch and scikit-learn; each rank
computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS, BATCH, LR = 5, 32, 5e-3  # twice the page's batch and fewer steps, for a quick run


class Net(nn.Module):
    """The network of PyTorch's MNIST example, scaled to 8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


def datasets():
    """The same seeded split on every rank: 360 test images, the rest for training."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels 0..16
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


@torch.no_grad()
def correct(model, loader, device):
    """How many images of ``loader`` the model labels right, as a tensor on ``device``."""
    model.eval()
    right = torch.zeros((), dtype=torch.int64, device=device)
    for images, labels in loader:
        right += (model(images.to(device)).argmax(1) == labels.to(device)).sum()
    return right


def main():
    # The rank's device: an accelerator of its own where each rank on this machine has one, else
    # the CPU (is_available: a CUDA build of torch on a machine without a GPU has none).
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)  # NCCL on GPUs, gloo on the CPU
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_set, test_set = datasets()
    # Each rank reads its own share of the indices, shuffled anew each epoch by set_epoch.
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    test_loader = DataLoader(
        test_set, batch_size=180, sampler=DistributedSampler(test_set, shuffle=False)
    )

    torch.manual_seed(0)  # the same weights on every rank
    model = Net().to(device)
    for unit in (model.conv2, model.fc1):
        fully_shard(unit)  # the two largest modules: gathered for their forward and backward
    fully_shard(model)  # the root: conv1 and fc2
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: on the shards
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            loss = F.nll_loss(model(images.to(device)), labels.to(device))
            loss.backward()  # FSDP2 averages the gradients over the ranks
            optimizer.step()
            optimizer.zero_grad()
    right = correct(model, test_loader, device)
    dist.all_reduce(right)  # each rank tested its half: the sum is the whole test set's

    # The root keeps its weights gathered after a forward, for the backward that follows; none
    # follows the test's, so shard them again. Each rank takes part in every gather.
    model.reshard()
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        alone = Net().to(device)
        alone.load_state_dict(full)
        right_alone = correct(alone, DataLoader(test_set, batch_size=360), device)
        print(
            f"FSDP2 on {world_size} ranks, {EPOCHS} epochs: test accuracy summed over ranks "
            f"{right.item()}/{len(test_set)}, gathered model in 1 process {right_alone.item()}/"
            f"{len(test_set)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
