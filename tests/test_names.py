"""Names as the code spells them (issue 25): a model entered through its own method
(``self.forward(x)`` from ``act()``) is the module the finding is about, its layers are named
as its attributes, and the line is the caller's."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import memsentry


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.forward(obs).argmax()  # acts with autograd on: a graph nobody uses


class Shared(nn.Module):
    """One layer applied twice (tied weights), entered through a method."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(self.layer(x)))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).softmax(-1)


def _acting_loop(agent: Agent, *, model: bool) -> tuple[memsentry.Report, int]:
    torch.manual_seed(0)
    opt = torch.optim.Adam(agent.parameters())
    with memsentry.track(agent if model else None, on_leak="ignore") as t:
        for step in range(40):
            agent.act(torch.randn(4))
            if step % 4 == 0:
                loss = agent(torch.randn(32, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    lines, first = inspect.getsourcelines(_acting_loop)
    acted = first + next(i for i, line in enumerate(lines) if "agent.act(" in line)
    return t.report(), acted


@pytest.mark.parametrize("model", [True, False], ids=["track(model)", "track()"])
def test_a_model_entered_through_its_own_method_is_one_finding_at_the_callers_line(
        model: bool) -> None:
    report, acted = _acting_loop(Agent(), model=model)
    (finding,) = [f for f in report.findings if f.rule == "missing-no-grad"]
    # 40 calls of act(); fewer counted where the budget left calls unfollowed, then said so
    assert re.match(r"`Agent` ran (40|at least \d+) forward passes with autograd on from "
                    rf"_acting_loop\(\) at tests/test_names.py:{acted} ", finding.message)
    assert finding.location is not None and finding.location.line == acted
    # Its layers are named as its attributes, whether or not the model was given.
    assert {"fc1", "fc2", "fc3"} <= {layer.name for layer in report.layers}
    assert not any(layer.name.startswith("Linear") for layer in report.layers)


def test_a_layer_applied_twice_inside_a_method_entered_model_is_still_one_finding() -> None:
    net = Shared()
    with memsentry.track(on_leak="ignore") as t:
        for _ in range(6):
            net.predict(torch.randn(8, 16))
            t.step()
    findings = [f for f in t.report().findings if f.rule == "missing-no-grad"]
    assert [f.subject.name for f in findings if f.subject is not None] == ["Shared"]
    assert [layer.name for layer in t.report().layers] == ["layer"]  # not `Linear`


def _validate(model: nn.Module) -> float:
    return model(torch.randn(64, 16)).mean().item()  # no no_grad here


def _predict(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(8, 16)).argmax(-1)  # nor here


def test_each_call_site_without_no_grad_is_its_own_finding_at_its_line() -> None:
    # Two functions run the model with autograd on: each is a line to change, and neither's
    # calls are counted as the other's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        for step in range(12):
            model(torch.randn(32, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            _validate(model)
            if step % 3 == 0:
                _predict(model)
    found = {f.location.function: f for f in t.report().findings
             if f.rule == "missing-no-grad" and f.location is not None}
    assert set(found) == {"_validate", "_predict"}
    assert "ran 12 forward passes" in found["_validate"].message
    assert "ran 4 forward passes" in found["_predict"].message
    for function, text in ((_validate, "model(torch.randn(64"), (_predict, "model(torch.randn(8")):
        lines, first = inspect.getsourcelines(function)
        line = first + next(i for i, source in enumerate(lines) if text in source)
        assert found[function.__name__].location.line == line  # type: ignore[union-attr]


def test_forward_passes_counted_in_part_are_said_to_be_a_lower_bound() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probes = []
    with memsentry.track(model, on_leak="ignore") as t:  # the default budget
        for _ in range(20):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            probes.append(model(torch.randn(256, 64)).argmax())  # autograd on, never used
    report = t.report()
    (finding,) = [f for f in report.findings if f.rule == "missing-no-grad"]
    cost = report.cost
    assert cost is not None and finding.objects is not None
    if cost.sampled < cost.iterations:  # the budget left calls unfollowed: a lower bound
        assert finding.message.startswith(f"`Sequential` ran at least {finding.objects} ")
        assert (f"memsentry followed every module call in {cost.sampled} of 20 iterations"
                in finding.message)
    else:
        assert finding.objects == 20 and " at least " not in finding.message


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class Maker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def test_two_models_with_attributes_of_one_name_are_told_apart_by_their_variables() -> None:
    net_g, net_d = Maker(), Critic()  # dcgan: both keep their layers in `main`
    with memsentry.track(on_leak="ignore") as t:  # no model: every module is followed
        for _ in range(4):
            net_d(net_g(torch.randn(4, 8))).mean().backward()
            t.step()
    names = [layer.name for layer in t.report().layers]
    assert names[:4] == ["Maker", "main", "main.0", "main.1"]  # the first keeps its names
    assert "net_d" in names and "net_d.main" in names and "net_d.main.2" in names
    assert not any("#" in name for name in names)


def test_two_models_of_one_class_are_named_by_their_variables() -> None:
    critics = [Critic(), Critic()]
    first, second = critics
    with memsentry.track(on_leak="ignore") as t:
        for _ in range(4):
            (first(torch.randn(4, 8)) + second(torch.randn(4, 8))).mean().backward()
            t.step()
    names = [layer.name for layer in t.report().layers]
    assert names[0] == "Critic" and "second" in names and "second.main.0" in names
