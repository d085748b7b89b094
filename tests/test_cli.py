"""The memsentry command: run an unmodified script under tracking, and info about the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import table_rows

import memsentry
from memsentry import Report
from memsentry.cli import main

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"

SCRIPT = """\
import sys

import torch
from torch import nn

print("argv:", sys.argv)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("main ran")


if __name__ == "__main__":
    main()
{ending}
"""


def write_script(directory: Path, ending: str = "", name: str = "train_script.py") -> Path:
    path = directory / name
    path.write_text(SCRIPT.format(ending=textwrap.dedent(ending)), encoding="utf-8")
    return path


def _layer_names_in(text: str) -> list[str]:
    return [row[0] for row in table_rows(text)]


# -- memsentry run -----------------------------------------------------------------------------


def test_run_reports_the_scripts_layers_and_passes_its_argv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path)
    argv_before, path_before = sys.argv[:], sys.path[:]
    code = main(["run", str(script), "arg1", "two words"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"argv: [{str(script)!r}, 'arg1', 'two words']" in out
    assert "main ran" in out  # the script ran as __main__
    assert "memsentry report" in out
    assert out.index("main ran") < out.index("memsentry report")
    assert _layer_names_in(out) == ["Sequential", "0", "1", "2"]
    assert "Iterations (3 recorded" in out
    # memsentry put the process back as it found it.
    assert sys.argv == argv_before
    assert sys.path == path_before


def test_run_returns_the_scripts_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path, "sys.exit(3)")
    assert main(["run", str(script)]) == 3
    out = capsys.readouterr().out
    assert "main ran" in out and "memsentry report" in out
    assert _layer_names_in(out) == ["Sequential", "0", "1", "2"]


def test_run_of_a_failing_script_returns_1_and_still_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path, 'raise RuntimeError("the script failed")')
    assert main(["run", str(script)]) == 1
    captured = capsys.readouterr()
    assert "RuntimeError: the script failed" in captured.err
    assert "memsentry report" in captured.out
    assert _layer_names_in(captured.out) == ["Sequential", "0", "1", "2"]


def test_run_with_a_message_exit_prints_it_and_returns_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path, 'sys.exit("no data found")')
    assert main(["run", str(script)]) == 1
    assert "no data found" in capsys.readouterr().err


def test_run_json_writes_a_readable_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path)
    out_json = tmp_path / "out.json"
    assert main(["run", "--json", str(out_json), str(script)]) == 0
    capsys.readouterr()
    report = Report.from_json(out_json)
    assert [layer.name for layer in report.layers] == ["Sequential", "0", "1", "2"]
    assert [layer.type for layer in report.layers] == ["Sequential", "Linear", "ReLU", "Linear"]
    # (a row for the block's end comes last when the run ended in an iteration with no hook)
    assert [it.boundary for it in report.iterations if it.boundary != "exit"] == \
        ["optimizer"] * 3
    assert report.layer("0").calls == 3


def test_options_after_the_script_belong_to_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path)
    assert main(["run", str(script), "--json", "theirs.json", "--top", "1", "-m"]) == 0
    out = capsys.readouterr().out
    assert "'--json', 'theirs.json', '--top', '1', '-m']" in out
    assert not (tmp_path / "theirs.json").exists()
    assert len(_layer_names_in(out)) == 4  # memsentry's --top stayed at its default


def test_run_output_file_top_and_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path)
    text_file = tmp_path / "report.txt"
    assert main(["run", "-o", str(text_file), "--depth", "0", str(script)]) == 0
    out = capsys.readouterr().out
    assert "main ran" in out
    assert "memsentry report" not in out
    text = text_file.read_text(encoding="utf-8")
    assert _layer_names_in(text) == ["Sequential"]
    assert main(["run", "-o", str(text_file), "--top", "2", str(script)]) == 0
    capsys.readouterr()
    assert len(_layer_names_in(text_file.read_text(encoding="utf-8"))) == 2


def test_run_exact_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = write_script(tmp_path)
    out_json = tmp_path / "exact.json"
    assert main(["run", "--exact", "--json", str(out_json), str(script)]) == 0
    capsys.readouterr()
    report = Report.from_json(out_json)
    assert report.peak_mode == "exact"
    assert report.layer("0").output_bytes == 4 * 16 * 4


def test_run_a_module_with_dash_m(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, name="memsentry_cli_test_module.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "-m", "memsentry_cli_test_module", "x"]) == 0
    out = capsys.readouterr().out
    assert "main ran" in out
    assert "'x']" in out
    assert _layer_names_in(out) == ["Sequential", "0", "1", "2"]


def test_run_missing_script_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.py"
    assert main(["run", str(missing)]) == 2
    captured = capsys.readouterr()
    assert "no such script" in captured.err and "nope.py" in captured.err
    assert "memsentry report" not in captured.out


@pytest.mark.parametrize(("option", "where", "message"), [
    ("-o", "missing/report.txt", "-o: the folder of '{p}' does not exist; create it first"),
    ("--json", "missing/report.json",
     "--json: the folder of '{p}' does not exist; create it first"),
    ("-o", ".", "-o: '{p}' is a directory; give a file name"),
])
def test_an_unwritable_report_path_stops_the_run_before_the_script(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, where: str,
        message: str) -> None:
    script = write_script(tmp_path)
    target = str(tmp_path / where)
    assert main(["run", option, target, str(script)]) == 2
    captured = capsys.readouterr()
    assert "main ran" not in captured.out  # the script never started
    assert f"memsentry run: {message.format(p=target)}" in captured.err


def test_run_of_a_missing_module_is_one_line_not_a_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-m", "memsentry_no_such_module_here"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("memsentry run: no module named 'memsentry_no_such_module_here' "
                            "(-m takes a module name, as python -m)\n")
    assert "Traceback" not in captured.out + captured.err


def test_run_with_a_bad_device_returns_2_and_restores_the_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = write_script(tmp_path)
    # Copies, put back at teardown whatever main() does, so a failure here stays here.
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    monkeypatch.setattr(sys, "path", sys.path[:])
    argv_before, path_before = sys.argv[:], sys.path[:]
    assert main(["run", "--device", "tpu", str(script)]) == 2
    err = capsys.readouterr().err
    assert "'cpu'" in err and "'cuda'" in err
    assert sys.argv == argv_before
    assert sys.path == path_before


def test_bad_option_values_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path)
    for argv in (["run", "--top", "0", str(script)], ["run", "--width", "x", str(script)], []):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "usage: memsentry" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import memsentry

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert memsentry.__version__ in capsys.readouterr().out


# -- entry points, as a user starts them -------------------------------------------------------


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_python_dash_m_memsentry_run(tmp_path: Path) -> None:
    script = write_script(tmp_path, "sys.exit(5)")
    result = subprocess.run(
        [sys.executable, "-m", "memsentry", "run", str(script), "hello"],
        capture_output=True, text=True, timeout=120, env=_environment(), cwd=tmp_path,
    )
    assert result.returncode == 5, result.stderr
    assert "'hello']" in result.stdout
    assert "memsentry report" in result.stdout
    assert _layer_names_in(result.stdout) == ["Sequential", "0", "1", "2"]


def _console_script() -> str | None:
    found = shutil.which("memsentry")
    if found:
        return found
    beside = Path(sys.executable).parent / "memsentry"
    return str(beside) if beside.exists() else None


def test_memsentry_console_script(tmp_path: Path) -> None:
    command = _console_script()
    if command is None:
        pytest.skip("the memsentry console script is not installed (pip install -e .)")
    script = write_script(tmp_path)
    result = subprocess.run(
        [command, "run", "--json", "r.json", str(script)],
        capture_output=True, text=True, timeout=120, env=_environment(), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "main ran" in result.stdout
    assert Report.from_json(tmp_path / "r.json").layer("Sequential").calls == 3


# -- memsentry info ----------------------------------------------------------------------------


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    if not torch.cuda.is_available():
        assert "CUDA: unavailable:" in out
        assert "NVML: unavailable:" in out
    else:
        assert "cuda:0" in out


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch_version"] == torch.__version__
    assert data["cuda_available"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert data["cuda_reason"]
        assert data["nvml"]["available"] is False and data["nvml"]["reason"]


# -- the bundled samples -----------------------------------------------------------------------


def _run_sample(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Report:
    script = SAMPLES / name
    assert script.is_file(), f"{script} is missing"
    out_json = tmp_path / f"{script.stem}.json"
    code = main(["run", "--json", str(out_json), str(script),
                 "--steps", "10", "--batch", "64", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "validation accuracy" in out
    assert "memsentry report" in out
    return Report.from_json(out_json)


def _growth(report: Report) -> float:
    """allocated per iteration, from the second iteration (the first carries set-up) to the
    last complete one in the timeline. ``memsentry run`` keeps to memsentry's budget: a light
    iteration may pass with a count only (no row), so the loop's 10 iterations are counted in
    ``report.cost`` and the rows are some of them, in order."""
    assert report.cost is not None and report.cost.iterations == 10
    complete = [it for it in report.iterations if it.boundary != "exit"]
    indices = [it.index for it in complete]
    assert indices[:2] == [0, 1] and indices == sorted(set(indices)) and indices[-1] <= 9
    second, last = complete[1], complete[-1]
    assert last.index >= 5  # a span of several steps: the growth is no one step's noise
    return (last.allocated - second.allocated) / (last.index - second.index)


def test_samples_leaky_grows_and_fixed_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    leaky = _run_sample("train_leaky.py", tmp_path, capsys)
    fixed = _run_sample("train_fixed.py", tmp_path, capsys)
    for report in (leaky, fixed):
        names = [layer.name for layer in report.layers]
        assert names[:4] == ["Classifier", "encoder", "encoder.0", "encoder.1"]
        assert "head" in names
    # The leaky loop keeps each step's graph (running_loss += loss) and each validation
    # forward's activations; with batch 64 and 1024-wide hidden layers that is hundreds of
    # KiB a step. The fixed loop keeps 64 x 10 logits (2.5 KiB) a step.
    leaky_growth, fixed_growth = _growth(leaky), _growth(fixed)
    assert leaky_growth > 256 * 1024
    assert fixed_growth < 16 * 1024
    assert leaky_growth > 10 * fixed_growth
    # The heuristics engine names both leaks and the missing no_grad in the leaky run, with
    # the variables and lines; the fixed run has nothing to say.
    # (Hints that read timings, such as input-bound, may come and go with the machine's load:
    # the verdicts on memory are what is asserted.)
    found = {f.rule: f for f in leaky.findings if f.severity is not memsentry.Severity.HINT}
    assert sorted(found) == ["missing-no-grad", "retained-graph", "tensor-accumulation"]
    assert found["retained-graph"].severity is memsentry.Severity.LEAK
    assert "`running_loss`" in found["retained-graph"].message
    assert (found["retained-graph"].where or "").endswith("train_leaky.py:26")
    assert "`val_logits`" in found["tensor-accumulation"].message
    assert (found["tensor-accumulation"].where or "").endswith("train_leaky.py:29")
    assert found["missing-no-grad"].severity is memsentry.Severity.WASTE
    assert "`Classifier`" in found["missing-no-grad"].message
    assert [f for f in fixed.findings if f.severity is not memsentry.Severity.HINT] == []


@pytest.mark.parametrize("option", [["--depth", "-1"], ["--top", "0"], ["--width", "wide"]])
def test_run_rejects_bad_table_options(
    option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["run", *option, str(script)])
    assert exited.value.code == 2
    assert option[0] in capsys.readouterr().err


def test_the_oom_sample_dies_with_a_post_mortem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "oom.json"
    code = main(["run", "--json", str(out_json), str(SAMPLES / "train_oom.py")])
    captured = capsys.readouterr()
    assert code == 1  # the script's own failure, as python would exit
    assert "DefaultCPUAllocator: can't allocate memory" in captured.err
    if sys.version_info >= (3, 11):  # the note, printed with the traceback
        assert "memsentry: out of memory in the forward of `0` (iteration 3) asking for " \
            "32 GiB" in captured.err
    assert "Out of memory: RuntimeError in the forward of `0` (iteration 3, batch 4194304)" \
        in captured.out
    oom = Report.from_json(out_json).oom
    assert oom is not None and oom.batch == 4194304
    (fix,) = [f for f in oom.fixes if f.kind == "batch"]
    assert fix.batch is not None and 256 < fix.batch < 4194304
    assert "the iterations before ran batches of 256" in fix.text


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: memsentry {argv[0]} ")  # the subcommand's usage
    return " ".join(err.split())


def test_a_mistyped_option_gets_the_subcommands_usage_and_a_suggestion(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["run", "--jsn", "r.json", str(SAMPLES / "toy.py")], capsys)
    assert "memsentry run: error: unrecognized arguments: --jsn (--jsn: did you mean --json?)" \
        in err
    err = _refused(["show", "--wdth", "80", "r.json"], capsys)
    assert "did you mean --width?" in err


def test_an_option_before_the_command_is_named_not_its_value(
        capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took the option's value for the command: "invalid choice: 'x.json'"."""
    with pytest.raises(SystemExit) as exited:
        main(["--jsn", "x.json", "run", str(SAMPLES / "toy.py")])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "memsentry: error: --jsn comes before the command: the options of run go after " \
           "its name (memsentry run [options] ...); did you mean memsentry run --json?" in err
    assert "x.json" not in err


def test_the_scripts_options_before_its_name_are_put_after_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    script = str(SAMPLES / "train_leaky.py")
    err = _refused(["run", "--exact", "--steps", "5", "--json", "r.json", script, "--batch",
                    "8"], capsys)
    assert ("memsentry's options go before the script's name, the script's own after it: "
            f"memsentry run --exact --json r.json {script} --steps 5 --batch 8") in err
    err = _refused(["run"], capsys)
    assert ("memsentry run: error: name the script to run: memsentry run script.py [its "
            "arguments] (or -m module)") in err


def test_a_script_that_exits_in_its_own_argument_parsing_gets_no_report(
        capsys: pytest.CaptureFixture[str]) -> None:
    script = str(SAMPLES / "train_leaky.py")
    assert main(["run", script, "--help"]) == 0
    captured = capsys.readouterr()
    assert "usage: train_leaky.py" in captured.out
    assert "memsentry report" not in captured.out
    assert "before any module ran; there is no report" in captured.err
    assert main(["run", script, "--stepz", "3"]) == 2  # argparse's own status
    captured = capsys.readouterr()
    assert "unrecognized arguments: --stepz 3" in captured.err
    assert "memsentry report" not in captured.out
