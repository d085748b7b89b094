"""The breakdown of memory at each iteration's peak: parameters, gradients, optimizer state,
activations and the rest, checked against what the model and optimizer hold, counted
independently here."""

from __future__ import annotations

import json

import pytest
import torch
from fake_clock import FakeClock
from seams import tracked
from torch import nn

import memsentry
from memsentry.model import CATEGORIES, Boundary, Breakdown

WIDTH = 1024


def storages(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def saved_for_backward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves in one forward of ``model``, parameters left out, counted with
    torch's own saved-tensor hooks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, steps: int = 3,
          **options: object) -> memsentry.Report:
    x = torch.randn(batch, WIDTH)
    with memsentry.track(model, on_leak="ignore", **options) as tracker:  # type: ignore[arg-type]
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return tracker.report()


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_adam_step_peak_holds_parameters_gradients_and_twice_the_parameters_of_state(
        exact: bool) -> None:
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    report = train(model, optimizer, batch=64, exact=exact)
    weights = storages(params)
    steps = storages([s["step"] for s in optimizer.state.values()])
    assert steps == 4 * len(params)  # one float32 step counter per parameter
    for index, parts in enumerate(report.breakdown.iterations):
        assert parts.parameters == weights
        assert sum(parts.part(name) for name in CATEGORIES) == parts.total
        assert parts.excess == 0
        if index:  # the first step made the state
            assert parts.optimizer_state == 2 * weights + steps
    peak = report.breakdown.peak
    assert peak is not None
    if not exact:  # glibc's heap: the iterations table's scale
        assert peak.total == max(it.peak for it in report.iterations)
        return  # where glibc's heap peaks depends on its fragmentation
    # Counting storages, Adam's step is where a small batch peaks: every gradient and the
    # state exist there, the activations are gone.
    assert peak.where == "optimizer step"
    assert peak.gradients == weights
    assert peak.optimizer_state == 2 * weights + steps
    assert peak.activations == 0


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_a_large_batch_peaks_with_every_activation_saved_for_backward(exact: bool) -> None:
    model = mlp()
    x = torch.randn(2048, WIDTH)
    expected = saved_for_backward(model, x)
    assert expected == 2 * 2048 * WIDTH * 4  # the input of each Linear (ReLU's output once)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = train(model, optimizer, batch=2048, exact=exact)
    peak = report.breakdown.peak
    assert peak is not None
    assert peak.activations == expected
    assert peak.gradients == 0 and peak.optimizer_state == 0  # zero_grad() set them to None
    assert peak.where in ("between layers", "backward of `Sequential`",
                          "backward of `2`", "forward of `Sequential`")
    assert peak.other + peak.parameters + peak.activations == peak.total
    if exact:  # tensor storages only: the rest is the loss's temporaries, each 8 MiB
        assert 0 < peak.other <= 4 * 2048 * WIDTH * 4 + 64


def test_parameters_of_a_second_optimizer_and_tied_weights_count_once() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 64)
    head = nn.Linear(64, 100, bias=False)
    head.weight = embedding.weight  # tied: one storage
    model = nn.Sequential(embedding, nn.Linear(64, 64), head)
    extra = nn.Parameter(torch.zeros(1000))  # trained, not part of the model
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1),
                  torch.optim.SGD([{"params": [extra]}], lr=0.1, momentum=0.9)]
    tokens = torch.randint(0, 100, (8, 16))
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(3):
            (model(tokens).mean() + extra.sum()).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    parts = tracker.report().breakdown.iterations[-1]
    assert parts.parameters == storages([*model.parameters(), extra])
    assert parts.parameters == (100 * 64 + 64 * 64 + 64 + 1000) * 4
    # SGD with momentum keeps one buffer per parameter, the second optimizer's only here
    assert parts.optimizer_state == 1000 * 4


def test_the_breakdown_is_read_without_a_model_from_the_outermost_modules() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2048, WIDTH)  # activations (16 MiB) outweigh gradients (8 MiB)
    with memsentry.track(on_leak="ignore") as tracker:
        for _ in range(3):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    breakdown = tracker.report().breakdown
    assert breakdown.peak is not None
    # From the first iteration on: the outermost module brings its parameters in at its call.
    assert {parts.parameters for parts in breakdown.iterations} == {
        storages(list(model.parameters()))}
    assert breakdown.peak.activations == saved_for_backward(model, x)


def test_breakdowns_survive_json_and_show_in_the_text_report(tmp_path: object) -> None:
    model = mlp()
    report = train(model, torch.optim.Adam(model.parameters()), batch=64)
    path = f"{tmp_path}/report.json"
    report.to_json(path)
    data = json.loads(open(path, encoding="utf-8").read())
    assert data["breakdown"]["peak"]["optimizer_state"] == report.breakdown.peak.optimizer_state
    again = memsentry.Report.from_json(path)
    assert again.breakdown == report.breakdown
    assert isinstance(again.breakdown.peak, Breakdown)
    text = str(report)
    assert "Memory at the highest peak" in text
    assert "optimizer state" in text and "activations (saved for backward)" in text
    with pytest.raises(KeyError, match="the categories are parameters"):
        report.breakdown.peak.part("weights")


def _sampled_parts(report: memsentry.Report) -> dict[int, Breakdown]:
    """The breakdown of each sampled iteration, by its index."""
    return {it.index: it.parts for it in report.iterations if it.parts is not None}

def test_iterations_that_measure_layers_in_turn_carry_the_last_reading() -> None:
    # 400 modules of tiny ops, on a clock where each of memsentry's readings takes 10 us and
    # a step 0.5 s: measuring every call costs far more than 5% of the loop, so from the
    # fourth iteration layers are measured in turn (in the iterations the budget samples) and
    # the parts are read only when the outermost call is.
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(8, 8), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    clock = FakeClock(tick=1e-5)
    with tracked(model, on_leak="ignore", overhead=0.05, clock=clock, credit=0.0) as tracker:
        for _ in range(12):
            clock.advance(0.5)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    report = tracker.report()
    parts = _sampled_parts(report)
    carried = [index for index, part in parts.items() if part.read_in is not None]
    assert carried, "every iteration read the parts"
    peaks = {it.index: it.peak for it in report.iterations}
    for index, part in parts.items():
        if part.read_in is not None:
            assert part.read_in < index
            assert parts[part.read_in].read_in is None
            assert part.parameters == parts[part.read_in].parameters
        assert part.total == peaks[index]

@pytest.mark.parametrize("made_inside", [False, True], ids=["model-before", "model-inside"])
def test_carried_readings_in_exact_mode_count_what_the_counter_missed_once(
        made_inside: bool) -> None:
    # With storage counting, parameters made before tracking are outside the counter and
    # are added to each peak. An iteration that carries a reading must add what that
    # reading found outside, not the gradients it saw then (freed by zero_grad since, so no
    # longer counted): those once made carried totals 6 MiB over the peak on the sample.
    torch.manual_seed(0)

    def build() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(8, 8), nn.ReLU())])

    model = None if made_inside else build()
    x = torch.randn(4, 8)
    clock = FakeClock(tick=3e-5)  # counting storages reads less often than glibc's heap
    with tracked(model, exact=True, on_leak="ignore", overhead=0.05, clock=clock,
                 credit=0.0) as tracker:
        if model is None:
            model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(12):
            clock.advance(1.0)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    report = tracker.report()
    parts = _sampled_parts(report)
    carried = [index for index, part in parts.items() if part.read_in is not None]
    assert carried, "every iteration read the parts"
    outside = {parts[it.index].total - it.peak for it in report.iterations
               if it.index in parts and it.boundary is Boundary.OPTIMIZER}
    # The same bytes outside the counter in every iteration: the parameters made before
    # tracking, or nothing when the model was made inside it.
    assert outside == ({0} if made_inside else {parts[0].parameters})
    assert report.breakdown.peak.total <= report.peak + parts[0].parameters


def test_a_table_of_a_lower_peak_than_the_runs_says_so() -> None:
    from builders import MiB, iterations, parts, report

    from memsentry.reporters.breakdown import render_breakdown

    read = parts(40 * MiB, activations=30 * MiB, parameters=10 * MiB)
    its = iterations([10 * MiB, 10 * MiB, 10 * MiB], peak=[40 * MiB, 48 * MiB, 40 * MiB],
                     parts=[read, None, None], sampled=[True, False, False])
    text = render_breakdown(report(iterations=its, peak=48 * MiB))
    assert text is not None
    assert text.startswith("Memory at the highest peak whose parts were read (iteration 0")
    assert "The run's peak, 48 MiB, came in an iteration measured without reading the parts" \
        in " ".join(text.split())
    same = render_breakdown(report(iterations=its, peak=40 * MiB))
    assert same is not None and same.startswith("Memory at the highest peak (iteration 0")
    assert "The run's peak" not in same
