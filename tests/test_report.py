"""Report: JSON round trip, the text report, layer lookup, and byte units."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import MiB, make_deep, make_mlp, table_rows, train

import memsentry
from memsentry import (
    Finding,
    Location,
    Report,
    Severity,
    Step,
    StepKind,
    Subject,
    format_bytes,
    parse_size,
)


@pytest.fixture(scope="module")
def small_report() -> Report:
    model = make_mlp()
    with memsentry.track(model) as t:
        train(model, 3)
    return t.report()


@pytest.fixture(scope="module")
def deep_report() -> Report:
    """A 101-layer model (25 blocks of Linear, ReLU, Linear) trained for four iterations."""
    model = make_deep()
    with memsentry.track(model) as t:
        train(model, 4)
    return t.report()


# -- serialisation -----------------------------------------------------------------------------


def test_dict_and_json_round_trip(small_report: Report, tmp_path: Path) -> None:
    holder = (Step(StepKind.ROOT, "logger"), Step(StepKind.ATTRIBUTE, "history"),
              Step(StepKind.KEY, "'loss'"))
    finding = Finding(rule="growth", severity=Severity.LEAK, message="allocated grows",
                      fix="detach the loss", bytes=MiB, rate=1024.5,
                      subject=Subject.holder(holder),
                      location=Location("train.py", 12, "train"))
    report = dataclasses.replace(small_report, findings=(finding,))
    assert Report.from_dict(report.to_dict()) == report
    assert Report.from_dict(json.loads(report.to_json())) == report
    path = tmp_path / "report.json"
    text = report.to_json(path)
    assert path.read_text(encoding="utf-8").strip() == text
    again = Report.from_json(path)
    assert again == report
    assert again.findings[0].severity is Severity.LEAK
    assert again.findings[0].where == "train.py:12"
    assert again.findings[0].subject is not None
    assert again.findings[0].subject.path == holder
    assert again.findings[0].subject.name == "logger.history['loss']"
    assert again.findings[0].location == Location("train.py", 12, "train")


def test_json_file_has_the_documented_keys(small_report: Report, tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    small_report.to_json(path)
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    assert data["schema"] == 2
    assert {"layers", "iterations", "findings", "baseline", "device", "peak"} <= data.keys()
    assert [layer["name"] for layer in data["layers"]] == ["Sequential", "0", "1", "2"]
    assert {"output_bytes", "saved_bytes", "forward_delta", "param_bytes"} <= (
        data["layers"][0].keys()
    )
    assert [it["boundary"] for it in data["iterations"]] == ["optimizer"] * 3
    assert data["findings"] == []


def test_from_dict_ignores_unknown_keys(small_report: Report) -> None:
    data = small_report.to_dict()
    data["written_by"] = "a newer memsentry"
    assert Report.from_dict(data) == small_report


# -- text --------------------------------------------------------------------------------------


def test_default_text_fits_100_columns(deep_report: Report) -> None:
    text = str(deep_report)
    assert text == deep_report.format()
    too_long = [line for line in text.splitlines() if len(line) > 100]
    assert too_long == []


def test_default_text_has_header_table_totals_and_iterations(deep_report: Report) -> None:
    text = str(deep_report)
    assert len(deep_report.layers) == 101
    assert "memsentry: cpu" in text
    for word in ("layer", "type", "calls", "params", "output", "saved", "peak"):
        assert word in text
    assert "30 of 101" in " ".join(text.split())  # however the title is wrapped
    assert len(table_rows(text)) == 30
    assert "total (leaf layers)" in text
    assert "Iterations (4 recorded" in text
    assert "median iteration" in text
    assert "/iter" in text  # the growth rate over the complete iterations
    assert "KiB" in text or "MiB" in text


def test_totals_row_sums_leaf_layers(small_report: Report) -> None:
    text = small_report.format()
    totals = next(line for line in text.splitlines() if line.startswith("total (leaf layers)"))
    leaves = [layer for layer in small_report.layers if layer.is_leaf]
    params = sum(layer.param_bytes for layer in leaves)
    assert format_bytes(params, compact=True) in totals.split()


def test_no_limits_show_every_layer(deep_report: Report) -> None:
    rows = table_rows(deep_report.format(top=None, max_depth=None))
    assert [row[0] for row in rows] == [layer.name for layer in deep_report.layers]
    assert " of 101 shown" not in " ".join(deep_report.format(top=None).split())


def test_max_depth_hides_deeper_layers(deep_report: Report) -> None:
    text = deep_report.format(max_depth=1, top=None)
    names = [row[0] for row in table_rows(text)]
    shallow = [layer.name for layer in deep_report.layers if layer.depth <= 1]
    assert names == shallow
    assert len(names) == 26  # the root and its 25 blocks
    assert "depth <= 1" in " ".join(text.split())
    root_only = deep_report.format(max_depth=0, top=None)
    assert [row[0] for row in table_rows(root_only)] == ["Sequential"]


def test_top_keeps_the_largest_footprints_in_call_order() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 2))
    with memsentry.track(model) as t:
        train(model, 2, batch=64)
    report = t.report()
    # The 4096-wide activation (64 * 4096 * 4 = 1 MiB, saved by the ReLU and the last Linear)
    # dominates: the root, "1", "2" and "3" all carry it, the small first Linear does not.
    rows = table_rows(report.format(top=4))
    assert [row[0] for row in rows] == ["Sequential", "1", "2", "3"]
    assert report.layer("2").saved_bytes == MiB
    assert "1.0MiB" in report.format(top=4)


def test_empty_report_renders() -> None:
    report = Report(device="cpu", backend="none", baseline=0)
    text = str(report)
    assert "no module forward ran" in text
    assert "Iterations: none ended" in text


def test_unknown_layer_raises_key_error_listing_names(small_report: Report) -> None:
    with pytest.raises(KeyError) as info:
        small_report.layer("missing")
    message = info.value.args[0]
    assert "'missing'" in message
    for name in ("Sequential", "0", "1", "2"):
        assert repr(name) in message
    assert small_report.layer("1").type == "ReLU"


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "kwargs", "text"),
    [
        (0, {}, "0 B"),
        (1, {}, "1 B"),
        (1023, {}, "1023 B"),
        (1024, {}, "1.0 KiB"),
        (1536, {}, "1.5 KiB"),
        (131072, {}, "128 KiB"),
        (3 * MiB // 2, {}, "1.5 MiB"),
        (10 * MiB, {}, "10 MiB"),
        (5 * 1024**3, {}, "5.0 GiB"),
        (-131072, {}, "-128 KiB"),
        (131072, {"signed": True}, "+128 KiB"),
        (-512, {"signed": True}, "-512 B"),
        (0, {"signed": True}, "0 B"),
        (131072, {"compact": True}, "128KiB"),
        (None, {}, "-"),
        (None, {"signed": True}, "-"),
    ],
)
def test_format_bytes(value: int | None, kwargs: dict, text: str) -> None:
    assert format_bytes(value, **kwargs) == text


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512 KiB", 512 * 1024),
        ("2GB", 2 * 10**9),
        ("1.5 MiB", 3 * MiB // 2),
        ("100", 100),
        ("100 B", 100),
        ("4k", 4000),
        (" 3 MB ", 3 * 10**6),
        ("2 gib", 2 * 1024**3),
        (".5 KiB", 512),
        (0, 0),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("value", ["abc", "-1", "1 XB", "", "1.5.5 MB", "MiB", True, False, -1,
                                   None, 1.5])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, 1, 1000, 131072, 3 * MiB // 2, 7 * 1024**3])
def test_format_then_parse_is_close(size: int) -> None:
    # The text is rounded to at most two significant decimals: within 5% of the value.
    parsed = parse_size(format_bytes(size))
    assert abs(parsed - size) <= 0.05 * size
