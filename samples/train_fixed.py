"""The twin of train_leaky.py with both leaks fixed. Try: memsentry run samples/train_fixed.py"""

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
correct = 0
for x, y in batches(args.steps, args.batch, args.device):
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    running_loss += loss.item()  # fixed: a Python float keeps no graph

    model.eval()
    with torch.no_grad():  # fixed: no graph is built for validation
        correct += (model(x_val).argmax(-1) == y_val).sum().item()  # keep a count, not tensors
    model.train()

accuracy = correct / (args.steps * len(y_val))
print(f"mean loss {running_loss / args.steps:.4f}, validation accuracy {accuracy:.3f}")
