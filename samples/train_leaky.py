"""A training loop with two classic leaks. Try: memsentry run samples/train_leaky.py

1. ``running_loss += loss`` keeps every step's autograd graph alive (use ``loss.item()``).
2. A validation forward without ``torch.no_grad()`` whose outputs are kept in a list: each
   entry holds that forward's activations, saved for a backward that never comes.
"""

import torch
from torch import nn
from toy import Classifier, batches, parse_args

args = parse_args(__doc__)
torch.manual_seed(0)
model = Classifier().to(args.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
criterion = nn.CrossEntropyLoss()
x_val, y_val = next(batches(1, args.batch, args.device))

running_loss = 0.0
val_logits = []
for x, y in batches(args.steps, args.batch, args.device):
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    running_loss += loss  # leak 1: a tensor, so it drags the graph of every step along

    model.eval()
    val_logits.append(model(x_val))  # leak 2: autograd is still on, the graph is kept
    model.train()

accuracy = (torch.stack(val_logits).argmax(-1) == y_val).float().mean()
print(f"mean loss {running_loss.item() / args.steps:.4f}, validation accuracy {accuracy:.3f}")
