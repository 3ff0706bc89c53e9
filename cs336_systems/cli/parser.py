"""The parser every script uses: flags generated from a settings dataclass, one-line errors.

Also the pieces every script's ``main`` shares: :func:`stops_cleanly` (an interrupted run ends
with one line and the signal's status) and :func:`format_table` (console tables, whose cells
:func:`in_ms` and :func:`in_mb` write).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

from cs336_systems.cli.checks import FOLDER_NAME, Check, Choice, Integer, Number, OutputFile
from cs336_systems.cli.options import Option
from cs336_systems.launch.signals import Interrupted
from cs336_systems.results.files import LoadedMachine
from cs336_systems.results.paths import RESULTS_ROOT, results_path
from cs336_systems.units import MB


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that builds a settings dataclass and reports its ValueErrors as usage errors."""

    def __init__(self, settings: type, description: str, results_kind: str | None = None, **kwargs: Any):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.settings = settings
        self.results_kind = results_kind
        self._fields: dict[str, dataclasses.Field] = {}
        for f in dataclasses.fields(settings):
            opt = f.metadata.get("cli")
            if opt is not None:
                self._add_field(f, opt)
        if results_kind is not None:
            self._add_output()

    def _add_field(self, f: dataclasses.Field, opt: Option) -> None:
        name = opt.flag or "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if opt.check is None:
            self.add_argument(name, dest=f.name, action="store_true", help=opt.help)
        else:
            shown = " ".join(map(str, default)) if isinstance(default, (tuple, list)) else default
            notes = [] if isinstance(opt.check, Choice) else [opt.check.allowed]
            notes += [] if default is None else [f"default: {shown}"]
            self.add_argument(
                name, dest=f.name, type=opt.check, nargs="+" if opt.many else None,
                default=default, metavar=_metavar(opt.check),
                help=opt.help + (f" ({'; '.join(notes)})" if notes else ""),
            )
        self._fields[f.name] = f

    def _add_output(self) -> None:
        """``--out`` (the results file) and ``--tag`` (its folder under writeup/results)."""
        default = results_path(self.results_kind, "<tag>").relative_to(RESULTS_ROOT.parent.parent)
        self.add_argument("--out", type=OutputFile(), default=None, metavar="PATH",
                          help=f"results file (default: {default.as_posix()})")
        self.add_argument("--tag", type=FOLDER_NAME, default=None, metavar="NAME",
                          help="results folder under writeup/results (default: this machine's tag)")

    def parse_with_output(self, argv: Sequence[str] | None = None) -> tuple[Any, Path]:
        """The settings and where their results go: ``--out``, else the results kind's path under
        ``--tag`` (or this machine's tag), with the settings' ``results_suffix`` if they have one."""
        settings, args = self.parse_settings(argv)
        try:
            return settings, args.out or results_path(self.results_kind, args.tag, getattr(settings, "results_suffix", None))
        except ValueError as e:  # a bad BENCH_MACHINE_TAG
            self.error(str(e))

    def settings_from(self, args: argparse.Namespace, **overrides: Any) -> Any:
        """The settings dataclass from parsed arguments; its validate() errors end the script (exit 2)."""
        values = {}
        for name in self._fields:
            value = getattr(args, name)
            values[name] = tuple(value) if isinstance(value, list) else value
        values.update(overrides)
        try:
            settings = self.settings(**values)
            if hasattr(settings, "validate"):
                settings.validate()
        except ValueError as e:
            self.error(str(e))
        return settings

    def parse_settings(self, argv: Sequence[str] | None = None) -> tuple[Any, argparse.Namespace]:
        args = self.parse_args(argv)
        return self.settings_from(args), args

    def error(self, message: str) -> NoReturn:
        # One line, the script's name and the reason: no usage dump to scroll past.
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


LOADED_EXIT_STATUS = 3  # a script whose run was refused for the machine's load


def stops_cleanly(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Wrap a script's ``main``: a run stopped by SIGTERM or SIGINT (``launch.Interrupted``, raised
    after every rank has been stopped) ends with one line, ``interrupted: ...``, and the shell's
    status for the signal, having written nothing; a run refused for the machine's load
    (results.files.LoadedMachine) ends with one line saying so, and status 3."""

    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except Interrupted as e:
            print(f"interrupted: {e}", file=sys.stderr)
            return e.exit_status
        except LoadedMachine as e:
            print(f"refused: {e}", file=sys.stderr)
            return LOADED_EXIT_STATUS

    return wrapper


def _metavar(check: Check) -> str:
    if isinstance(check, Choice):
        return "{" + ",".join(check.values) + "}"
    return {Integer: "N", Number: "X"}.get(type(check), "VALUE")


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]], right: Callable[[int], bool] | None = None) -> str:
    """A console table: columns as wide as their widest cell, numbers (all but the first column,
    unless ``right`` says otherwise) right-aligned."""
    right = right or (lambda i: i > 0)
    cells = [list(map(str, header))] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.rjust(w) if right(i) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def in_ms(seconds: float | None) -> str | None:
    """A time as a table cell, in milliseconds (None stays None: format_table shows "-")."""
    return None if seconds is None else f"{1e3 * seconds:.1f}"


def ratio_cell(median: float, interval: Sequence[float] | None) -> str:
    """A median ratio as a table cell, with its 95% interval when there is one: "0.78 [0.71, 0.84]"."""
    return f"{median:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def in_mb(n_bytes: float | None) -> str | None:
    """A size as a table cell, in MB of 2**20 bytes (None stays None: format_table shows "-")."""
    return None if n_bytes is None else f"{n_bytes / MB:.1f}"
