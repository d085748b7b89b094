"""A loop that dies of an out-of-memory error: its fourth step reads a batch size of 4,194,304
from a bad config. `memsentry run samples/train_oom.py` says where it died, what memory held
and what batch would have fit."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(),
                      nn.Linear(512, 10))
optimizer = torch.optim.Adam(model.parameters())
for step in range(10):
    batch = 256 if step < 3 else 2**22  # step 3 reads its batch size from a bad config
    # (the big batch is one sample broadcast, a view: the first layer is what fails)
    x = torch.randn(batch, 512) if batch <= 256 else torch.randn(1, 512).expand(batch, 512)
    loss = nn.functional.cross_entropy(model(x), torch.zeros(batch, dtype=torch.long))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
