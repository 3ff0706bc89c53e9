"""One command-line dialect for every script, generated from its settings dataclass.

A settings field becomes a flag when its metadata holds an :class:`Option` (``--model-size``
for ``model_size``), with a :class:`Check` that parses and validates the text where it is
parsed: a bad value ends the script with one line, ``error: argument --flag: ...`` naming the
value and what is allowed, and exit status 2, before any process starts. Checks that span
several flags (a batch that must split over the world size, a device that must exist) are the
settings' ``validate()``, reported the same way. The same words mean the same thing in every
script: ``--world-size``, ``--global-batch`` (sequences per step over all ranks),
``--model-size {choices}``, ``--out`` (the results file) and ``--tag`` (its folder).

Every check also knows values it must refuse (:attr:`Check.bad_values`); the bad-input test
feeds them to every flag of every script, so a new flag is covered when it is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from cs336_systems.launch.signals import Interrupted
from cs336_systems.results.paths import results_path

# Generous upper bounds: far above any real run, low enough to refuse a typo of ten zeros.
MAX_RANKS = 1024
MAX_COUNT = 1_000_000
MAX_MB = 1024 * 1024  # 1 TiB


class Check:
    """How one flag's text becomes a value, and what it refuses."""

    allowed: str = ""  # what the value may be, for messages and help
    bad_values: tuple[str, ...] = ()  # texts this check must refuse

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def __call__(self, text: str) -> Any:
        return self.parse(text)

    def refuse(self, text: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"must be {self.allowed}, got {text!r}")


@dataclass(frozen=True)
class Integer(Check):
    minimum: int = 1
    maximum: int = MAX_COUNT

    @property
    def allowed(self) -> str:  # type: ignore[override]
        return f"an integer from {self.minimum} to {self.maximum}"

    @property
    def bad_values(self) -> tuple[str, ...]:  # type: ignore[override]
        return (str(self.minimum - 1), "1.5", "ten", str(self.maximum * 1000))

    def parse(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise self.refuse(text) from None
        if not self.minimum <= value <= self.maximum:
            raise self.refuse(text)
        return value


@dataclass(frozen=True)
class Number(Check):
    low: float = 0.0
    high: float = math.inf
    low_open: bool = True  # True: value > low; False: value >= low

    @property
    def allowed(self) -> str:  # type: ignore[override]
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        return f"a number {low}" + ("" if math.isinf(self.high) else f" and <= {self.high:g}")

    @property
    def bad_values(self) -> tuple[str, ...]:  # type: ignore[override]
        below = self.low if self.low_open else self.low - 1
        above = () if math.isinf(self.high) else (f"{self.high * 1000:g}",)
        return (f"{below:g}", "-7", "nan", "inf", "many", *above)

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise self.refuse(text) from None
        too_low = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or too_low or value > self.high:
            raise self.refuse(text)
        return value


@dataclass(frozen=True)
class Choice(Check):
    values: tuple[str, ...] = ()

    @property
    def allowed(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(self.values)

    @property
    def bad_values(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("no-such-choice",)

    def parse(self, text: str) -> str:
        if text not in self.values:
            raise self.refuse(text)
        return text


@dataclass(frozen=True)
class Name(Check):
    """A name given to an outside system (a SLURM partition, a job name): one word."""

    allowed: str = "one word of letters, digits, '.', '_', '-', '+', ':'"
    bad_values: tuple[str, ...] = ("", "two words", "semi;colon")

    def parse(self, text: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._+:-]+", text):
            raise self.refuse(text)
        return text


@dataclass(frozen=True)
class FolderName(Check):
    allowed: str = "one folder name (letters, digits, '.', '_', '-')"
    bad_values: tuple[str, ...] = ("a/b", "..", "")

    def parse(self, text: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", text) or text in (".", ".."):
            raise self.refuse(text)
        return text


@dataclass(frozen=True)
class OutputFile(Check):
    """A file to write: not a folder, and not under an existing file."""

    allowed: str = "a file path whose folder exists or can be made"
    bad_values: tuple[str, ...] = ("/", str(Path(__file__).resolve() / "x.json"))

    def parse(self, text: str) -> Path:
        path = Path(text)
        if not text or path.is_dir() or text.endswith(("/", "\\")):
            raise self.refuse(text)
        for ancestor in path.resolve().parents:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise self.refuse(text)
                break
        return path


@dataclass(frozen=True)
class OutputFolder(Check):
    """A folder to write into: it may not exist yet, but it is not a file nor under one."""

    allowed: str = "a folder path that exists or can be made"
    bad_values: tuple[str, ...] = (str(Path(__file__).resolve()), str(Path(__file__).resolve() / "sub"))

    def parse(self, text: str) -> Path:
        path = Path(text)
        if not text or (path.exists() and not path.is_dir()):
            raise self.refuse(text)
        for ancestor in path.resolve().parents:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise self.refuse(text)
                break
        return path


@dataclass(frozen=True)
class ExistingFolder(Check):
    allowed: str = "an existing folder"
    bad_values: tuple[str, ...] = ("/no/such/folder/cs336",)

    def parse(self, text: str) -> Path:
        path = Path(text)
        if not path.is_dir():
            raise self.refuse(text)
        return path


@dataclass(frozen=True)
class Option:
    """Field metadata that makes a settings field a flag."""

    help: str
    check: Check | None = None  # None: a switch (store_true)
    many: bool = False  # one or more values (nargs="+")
    flag: str | None = None  # default: "--" + the field name with '-' for '_'


def option(help: str, check: Check | None = None, many: bool = False, flag: str | None = None) -> dict:
    """``field(metadata=option(...))``."""
    return {"cli": Option(help, check, many, flag)}


def count(help: str, minimum: int = 1, maximum: int = MAX_COUNT, many: bool = False) -> dict:
    return option(help, Integer(minimum, maximum), many)


def positive(help: str, high: float = math.inf, many: bool = False) -> dict:
    return option(help, Number(0.0, high, low_open=True), many)


def nonnegative(help: str, high: float = math.inf) -> dict:
    return option(help, Number(0.0, high, low_open=False))


def fraction(help: str) -> dict:
    return option(help, Number(0.0, 1.0, low_open=True))


def choice(help: str, values: Iterable[str], many: bool = False) -> dict:
    return option(help, Choice(tuple(values)), many)


def switch(help: str) -> dict:
    return option(help)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that builds a settings dataclass and reports its ValueErrors as usage errors."""

    def __init__(self, settings: type, description: str, **kwargs: Any):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.settings = settings
        self._fields: dict[str, dataclasses.Field] = {}
        for f in dataclasses.fields(settings):
            opt = f.metadata.get("cli")
            if opt is not None:
                self._add_field(f, opt)

    def _add_field(self, f: dataclasses.Field, opt: Option) -> None:
        name = opt.flag or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
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

    def add_output(self, default_name: str) -> None:
        """``--out`` (the results file) and ``--tag`` (its folder under writeup/results)."""
        self.add_argument("--out", type=OutputFile(), default=None, metavar="PATH",
                          help=f"results file (default: writeup/results/<tag>/{default_name})")
        self.add_argument("--tag", type=FolderName(), default=None, metavar="NAME",
                          help="results folder under writeup/results (default: this machine's tag)")

    def output_path(self, args: argparse.Namespace, kind: str, suffix: str | None = None) -> Path:
        """Where the results go: ``--out``, else ``writeup/results/<--tag or machine tag>/<kind>[-<suffix>].json``."""
        return args.out or results_path(kind, args.tag, suffix)

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

    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, the script's name and the reason: no usage dump to scroll past.
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def stops_cleanly(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Wrap a script's ``main``: a run stopped by SIGTERM or SIGINT (``launch.Interrupted``, raised
    after every rank has been stopped) ends with one line, ``interrupted: ...``, and the shell's
    status for the signal, having written nothing."""

    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except Interrupted as e:
            print(f"interrupted: {e}", file=sys.stderr)
            return e.exit_status

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
