"""Data-parallel training on CPU processes (gloo) where only rank 1 keeps its outputs:
`torchrun --nproc-per-node 2 -m memsentry run samples/train_ddp.py` reports the leak on
rank 1 in rank 0's combined report."""

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
optimizer = torch.optim.Adam(model.parameters())
outputs = []
for _step in range(20):
    out = model(torch.randn(32, 64))
    out.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 1:
        outputs.append(out)  # only rank 1 keeps its outputs, graphs and all
dist.destroy_process_group()
