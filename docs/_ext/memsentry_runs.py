"""The directives that run something when the docs are built: ``memsentry-output`` (a shell
command and what it printed), ``memsentry-python`` (a program, then what it printed) and
``memsentry-file`` (a file put in the directory of the page's later runs). The runs and their
cache are :mod:`memsentry_outputs`."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any, ClassVar

import memsentry_outputs as outputs
from docutils import nodes
from docutils.parsers.rst import directives
from memsentry_nodes import digest, literal, track
from sphinx.directives.code import container_wrapper
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

def _seconds(text: str | None) -> float:
    value = float(directives.unchanged_required(text))
    if value <= 0:
        raise ValueError("expected a positive number of seconds")
    return value


def _page_files(env: BuildEnvironment) -> dict[str, str]:
    """The files that ``memsentry-file`` wrote so far on the page being read."""
    files = env.temp_data.setdefault("memsentry_files", {})
    assert isinstance(files, dict)
    return files


class _RunDirective(SphinxDirective):
    """What the two directives that run something share: options, cache, warnings."""

    has_content = True
    kind: ClassVar[str] = ""
    what: ClassVar[str] = "command"
    option_spec: ClassVar[dict[str, Any]] = {
        "returncode": int,
        "timeout": _seconds,
        "stdout-only": directives.flag,
        "caption": directives.unchanged_required,
        "setup": directives.unchanged_required,
        "head": directives.nonnegative_int,
        "tail": directives.nonnegative_int,
    }

    def execute(self, command: str, files: dict[str, str] | None = None
                ) -> tuple[str, nodes.paragraph]:
        """Run ``command`` (or take it from the cache) with the page's files and ``files``;
        its output, cut to ``:head:``/``:tail:``, and the line that says where it comes
        from. Warns when it exits with another status or runs too long."""
        track(self)
        expected = self.options.get("returncode", 0)
        cache = Path(self.env.srcdir) / "_build" / ".outputs"
        started = time.monotonic()
        try:
            result, cached = outputs.cached_run(
                self.kind, command, cache=cache, sources=digest(), expected=expected,
                timeout=self.options.get("timeout", outputs.DEFAULT_TIMEOUT),
                stdout_only="stdout-only" in self.options,
                files={**_page_files(self.env), **(files or {})},
                setup=self.options.get("setup"),
            )
        except outputs.OutputTimeout as error:
            self.warn(f"`{command}` ran past its {error.timeout:g} s (raise :timeout:); "
                      f"{outputs.ending(error.output)}")
            return self.cut(error.output) + f"\n[timed out after {error.timeout:g} s]", \
                self._note(None)
        except outputs.SetupFailed as error:
            self.warn(f"{error}; {outputs.ending(error.output)}")
            return f"[{error}]", self._note(None)
        if not cached:
            logger.info("memsentry-%s: %s ran in %.1f s", self.kind, command,
                        time.monotonic() - started, location=self.get_location())
        problem = outputs.status_problem(command, expected, result)
        if problem is not None:
            self.warn(problem)
        return self.cut(result.output), self._note(result)

    def cut(self, output: str) -> str:
        return outputs.shorten(output, head=self.options.get("head"),
                               tail=self.options.get("tail"))

    def warn(self, message: str) -> None:
        logger.warning("%s", message, location=self.get_location(), type="memsentry",
                       subtype="output")

    def _note(self, result: outputs.Result | None) -> nodes.paragraph:
        where = "" if result is None else f" (torch {result.torch}, {result.device})"
        text = f"Output of this {self.what} when these docs were built{where}."
        return nodes.paragraph(text, text, classes=["memsentry-output-note"])

    def framed(self, block: nodes.literal_block) -> nodes.Element:
        if "caption" in self.options:
            return container_wrapper(self, block, self.options["caption"])
        return block


class OutputDirective(_RunDirective):
    """````{memsentry-output}```` with one shell command: the command and what it printed."""

    kind = "output"

    def run(self) -> list[nodes.Node]:
        command = "\n".join(self.content).strip()
        if not command:
            raise self.error("memsentry-output: name a command to run")
        output, note = self.execute(command)
        text = f"$ {command}\n{output}" if output else f"$ {command}"
        block = literal(text)
        self.set_source_info(block)
        return [self.framed(block), note]


class PythonDirective(_RunDirective):
    """````{memsentry-python}```` with a program: the program, then what it printed."""

    kind = "python"
    what = "program"
    option_spec: ClassVar[dict[str, Any]] = {
        **_RunDirective.option_spec,
        "filename": directives.unchanged_required,
        "hide-code": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        code = "\n".join(self.content).strip("\n") + "\n"
        filename = self.options.get("filename", "example.py")
        if "/" in filename or not filename.endswith(".py"):
            raise self.error(f"memsentry-python: :filename: {filename!r} is not a name.py")
        output, note = self.execute(f"python {shlex.quote(filename)}", {filename: code})
        shown = literal(output or "(no output)")
        self.set_source_info(shown)
        result: list[nodes.Node] = []
        if "hide-code" not in self.options:
            program = literal(code.rstrip("\n"), "python")
            self.set_source_info(program)
            result.append(self.framed(program))
            result.append(nodes.paragraph("Output:", "Output:"))
            result.append(shown)
        else:
            result.append(self.framed(shown))
        result.append(note)
        return result


_LANGUAGES = {".py": "python", ".toml": "toml", ".ini": "ini", ".cfg": "ini", ".json": "json",
              ".yaml": "yaml", ".yml": "yaml", ".sh": "bash", ".txt": "text"}


class FileDirective(SphinxDirective):
    """````{memsentry-file} name```` with the file's text: shows it (captioned with its name
    unless ``:caption:`` says otherwise; ``:hide:`` shows nothing) and puts it in the
    directory of every later run on the same page."""

    has_content = True
    required_arguments = 1
    option_spec: ClassVar[dict[str, Any]] = {
        "caption": directives.unchanged_required,
        "hide": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        if name.startswith("/") or ".." in Path(name).parts:
            raise self.error(f"memsentry-file: {name!r} is not a path inside the directory")
        text = "\n".join(self.content).strip("\n") + "\n"
        _page_files(self.env)[name] = text
        if "hide" in self.options:
            return []
        block = literal(text.rstrip("\n"), _LANGUAGES.get(Path(name).suffix, "text"))
        self.set_source_info(block)
        return [container_wrapper(self, block, self.options.get("caption", name))]
