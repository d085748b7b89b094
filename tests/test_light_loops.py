"""Loops of many small steps kept within the budget: an agent that fills a replay buffer with
inference calls before its first optimizer step, then trains. The iterations merged when the
optimizer appears are counted right, inference calls are watched thinned out (and the finding
says so), and a census walks a buffer of plain records at C speed."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch
from torch import nn

import memsentry
from memsentry.census.children import only_atoms


class Agent(nn.Module):
    """Acts through ``self.forward`` (as many RL scripts do), so its layers are the outermost
    calls memsentry sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(4, 32), nn.Linear(32, 32), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    def act(self, obs: np.ndarray) -> int:
        return int(self.forward(torch.from_numpy(obs)).argmax().item())  # autograd on


def play(agent: Agent, *, warmup: int, updates: int) -> tuple[list[float], int]:
    """``warmup`` acting steps into a replay buffer, then ``updates`` episodes of 5 acting
    steps and 2 Adam steps each; the losses and the optimizer steps taken."""
    rng = np.random.default_rng(0)
    random.seed(0)
    buffer: collections.deque[tuple[np.ndarray, int, float, np.ndarray, float]] = \
        collections.deque(maxlen=5000)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    obs = rng.standard_normal(4).astype(np.float32)

    def step() -> None:
        nonlocal obs
        action = agent.act(obs)
        following = rng.standard_normal(4).astype(np.float32)
        buffer.append((obs, action, float(rng.random()), following, 1.0))
        obs = following

    for _ in range(warmup):
        step()
    losses, steps = [], 0
    for _ in range(updates):
        for _ in range(5):
            step()
        for _ in range(2):
            batch = random.sample(buffer, 16)
            states = torch.from_numpy(np.stack([b[0] for b in batch]))
            rewards = torch.tensor([b[2] for b in batch])
            loss = (agent(states).max(1).values - rewards).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            losses.append(loss.item())
    return losses, steps


def test_an_agent_that_acts_before_it_learns_is_tracked_within_its_budget() -> None:
    torch.manual_seed(0)
    plain_agent = Agent()
    plain, steps = play(plain_agent, warmup=600, updates=40)
    torch.manual_seed(0)
    agent = Agent()
    with memsentry.track(overhead=1e-6, on_leak="ignore") as t:
        tracked, _ = play(agent, warmup=600, updates=40)
    assert tracked == plain
    assert all(torch.equal(a, b) for a, b in
               zip(plain_agent.state_dict().values(), agent.state_dict().values(), strict=True))
    report = t.report()
    cost = report.cost
    assert cost is not None
    # The acting steps before the first optimizer step are part of its iteration: one
    # iteration per optimizer step, and no more sampled iterations than iterations.
    assert cost.iterations == steps
    assert 0 <= cost.sampled <= cost.iterations
    (note,) = [n for n in report.notes if "kept to its budget" in n]
    assert f"in {cost.sampled:,} of {cost.iterations:,} iterations" in note
    # The acting calls run with autograd on and no backward uses them: found, from the
    # calls memsentry watched, and the finding says how many it did not judge.
    wastes = [f for f in report.findings if f.rule == "missing-no-grad"]
    assert wastes
    assert any("more were not judged" in f.message for f in wastes)
    assert all(f.objects is not None and f.objects < 600 + 40 * 5 for f in wastes)
    assert not [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


def test_a_backward_through_unwatched_calls_still_ends_an_iteration() -> None:
    """No optimizer: the ends of backward passes close the iterations, found through the
    watched calls; when memsentry watched none of a pass's calls, the pass still counts."""
    torch.manual_seed(0)
    agent = Agent()
    obs = np.ones(4, dtype=np.float32)
    with memsentry.track(overhead=1e-6, on_leak="ignore") as t:
        for _ in range(400):  # acting only, each call a FORWARD boundary
            agent.act(obs)
        for _ in range(6):  # then updates by hand, through the same outermost calls
            loss = agent.forward(torch.ones(8, 4)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in agent.parameters():
                    p -= 1e-3 * p.grad
                    p.grad = None
    cost = t.report().cost
    assert cost is not None
    # The 400 acting calls merge into the first pass's iteration; each pass is one.
    assert cost.iterations == 6
    assert 0 <= cost.sampled <= cost.iterations


def test_a_buffer_of_plain_records_is_skipped_in_bulk() -> None:
    floats = np.zeros(4, dtype=np.float32)
    records = [(floats.copy(), 1, 0.5, floats.copy(), True) for _ in range(1000)]
    assert only_atoms(records)
    assert only_atoms(collections.deque(records))
    # Anything that may hold a tensor is walked item by item.
    assert not only_atoms([*records, (floats, torch.ones(2))])
    assert not only_atoms([*records, (torch.ones(2).numpy(), 1)])  # a tensor's storage
    assert not only_atoms([*records, (np.array([torch.ones(1)], dtype=object), 1)])
    assert not only_atoms(records[:100])  # small: walked as before


def test_a_dataset_of_dicts_is_skipped_in_bulk_unless_a_tensor_is_in_it() -> None:
    # A dataset kept as a list of dicts (a DataLoader's usual source): thousands of records
    # of numbers, strings and short lists; a tensor two levels down is still walked to.
    records = [{"features": [float(i)] * 8, "label": i % 4, "path": f"img_{i}.jpg"}
               for i in range(5_000)]
    assert only_atoms(records)
    assert not only_atoms([*records, {"features": [torch.ones(2)], "label": 0}])
    assert not only_atoms([*records, {"nested": {"deeper": [torch.ones(2)]}}])


def test_a_chat_dataset_three_levels_deep_is_skipped_in_bulk() -> None:
    # ShareGPT-style records, as fine-tuning scripts json.load() them: a census used to walk
    # these one by one until its time ran out (0.5 s a census on 100,000 records).
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q {i}"},
                                                   {"from": "gpt", "value": f"a {i}"}]}
               for i in range(5_000)]
    assert only_atoms(records)
    turn = {"from": "gpt", "value": "a", "ids": torch.ones(2)}
    assert not only_atoms([*records, {"id": "x", "conversations": [turn]}])


def test_a_buffer_that_keeps_graphs_in_its_records_is_named() -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    replay: list[tuple[np.ndarray, float, torch.Tensor]] = [
        (np.zeros(4, dtype=np.float32), 0.0, torch.zeros(1)) for _ in range(400)]
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(12):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            replay.append((np.zeros(4, dtype=np.float32), 1.0, loss))  # keeps the graph
    leaks = [f for f in t.report().findings if f.severity is memsentry.Severity.LEAK]
    assert any("`replay`" in f.message for f in leaks), [f.message for f in leaks]


def test_light_inference_hooks_only_the_module_that_ends_iterations() -> None:
    """Inference, no optimizer: the next call of the first outermost module ends an
    iteration. In light iterations only that module keeps memsentry's hooks: the global
    hooks come off without a model, and the other outermost layers of a model entered
    through ``.forward()`` lose theirs."""
    from torch.nn.modules import module as module_globals

    agent = Agent()
    obs = np.ones(4, dtype=np.float32)
    before = len(module_globals._global_forward_pre_hooks)
    seen: list[tuple[int, bool, bool, bool]] = []

    def hooked() -> tuple[int, bool, bool, bool]:
        """memsentry's global hooks, and which layers the loop calls carry a hook."""
        return (len(module_globals._global_forward_pre_hooks) - before,
                *(bool(m._forward_pre_hooks) for m in (agent.fc1, agent.fc2, agent.out)))

    for model in (None, agent):
        seen.clear()
        with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
            for _ in range(300):
                agent.act(obs)
                seen.append(hooked())
        cost = t.report().cost
        assert cost is not None and cost.iterations == 299  # and the partial one at the end
        measured = (1, False, False, False) if model is None else (0, True, True, True)
        assert seen[0] == measured
        assert seen[-1] == (0, True, False, False)  # light: `fc1` alone
        assert hooked() == (0, False, False, False)


def _hand_updated(model: nn.Module, step: int, *, grad: bool) -> torch.Tensor:
    """One step of a loop with no torch.optim: ``.backward()`` (or ``autograd.grad``), then
    the weights updated by hand."""
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss = nn.functional.mse_loss(model(x), y)
    params = list(model.parameters())
    if grad:
        grads = torch.autograd.grad(loss, params)
    else:
        model.zero_grad()
        loss.backward()
        grads = tuple(p.grad for p in params)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= 0.01 * g
    return loss


@pytest.mark.parametrize("make", [memsentry.track, memsentry.watch])
def test_a_loop_updated_by_hand_goes_unhooked_between_measured_iterations(make) -> None:
    # Its iterations end at backward passes; once the wrapped torch.autograd.backward is seen
    # ending them, light iterations hook no module (each read boundary had cost 30 us and
    # more, 2.5x the tiny step) and still count every iteration; the leak is still named.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    kept, unhooked = [], 0
    with make(model, on_leak="ignore") as t:
        for step in range(1500):
            kept.append(_hand_updated(model, step, grad=False))
            unhooked += not model._forward_hooks and not model._forward_pre_hooks
    report = t.report()
    assert report.cost is not None and report.cost.iterations == 1500
    assert unhooked > 1000
    assert any(f.rule == "tensor-accumulation" and f.subject is not None
               and f.subject.name == "kept" for f in report.findings)


def test_a_loop_of_autograd_grad_keeps_its_hooks_and_its_count() -> None:
    # torch.autograd.grad is not wrapped: only the hooks see its passes end.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with memsentry.watch(model, on_leak="ignore") as t:
        for step in range(600):
            _hand_updated(model, step, grad=True)
    cost = t.report().cost
    assert cost is not None and cost.iterations == 600


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 64), nn.Linear(64, 2)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(torch.relu(self.hidden(state))), dim=1)


def _episodes(policy: Policy, count: int, *, keep: list[torch.Tensor] | None) -> None:
    """``count`` episodes of 60 forwards each and one Adam step (REINFORCE's shape); with
    ``keep``, each episode's loss is kept with its graph."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    for _ in range(count):
        log_probs = []
        for _ in range(60):
            probs = policy(torch.randn(1, 4))
            log_probs.append(torch.log(probs[0, 0]))
        loss = -torch.stack(log_probs).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if keep is not None:
            keep.append(loss)


@pytest.mark.parametrize("given", [False, True])
def test_a_census_in_a_light_episode_leaves_its_other_forwards_unhooked(given: bool) -> None:
    # A census waits for the first module call of the iteration after its boundary, so the
    # hooks stayed on for the whole light episode after it: its 60 forwards all went through
    # them (180 counted calls with the global hooks, 60 with the model's). Once the census
    # is taken, the hooks come off as that first call ends; the leak is still found and
    # named, and the weights are bit for bit the same.
    torch.manual_seed(0)
    plain = Policy()
    _episodes(plain, 40, keep=[])
    torch.manual_seed(0)
    policy = Policy()
    episode_losses: list[torch.Tensor] = []
    # watch() with no model takes global hooks; track(model) hooks the model's modules
    tracking = memsentry.track(policy, on_leak="ignore") if given else \
        memsentry.watch(on_leak="ignore")
    with tracking as t:
        _episodes(policy, 40, keep=episode_losses)
    assert all(torch.equal(a, b) for a, b in
               zip(plain.state_dict().values(), policy.state_dict().values(), strict=True))
    report = t.report()
    light = {it.index: it.forward_calls for it in report.iterations if not it.sampled}
    censused = [c.iteration + 1 for c in report.censuses if c.iteration + 1 in light]
    assert censused, "no census fell in a light iteration"
    assert all(light[index] <= 3 for index in censused)  # one forward's calls, then none
    assert max(light.values()) <= 3
    assert any(f.severity is memsentry.Severity.LEAK and f.subject is not None
               and f.subject.name == "keep" for f in report.findings)
