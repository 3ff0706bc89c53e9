"""Checks: how one flag's text becomes a value, what it allows, and what it must refuse.

Each check raises ``argparse.ArgumentTypeError`` naming the value and what is allowed, which
argparse reports as ``error: argument --flag: must be ..., got '...'``. ``bad_values`` are texts
the check must refuse; tests/test_bad_inputs.py feeds them to every flag of every script.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Generous upper bounds: far above any real run, low enough to refuse a typo of ten zeros.
MAX_RANKS = 1024
MAX_COUNT = 1_000_000
MAX_MB = 1024 * 1024  # 1 TiB


class Check:
    """How one flag's text becomes a value, and what it refuses.

    A check states ``allowed`` and ``bad_values`` as a field where they are fixed and as a
    property where they follow from its bounds; here they are read-only, so either may override.
    """

    @property
    def allowed(self) -> str:
        """What the value may be, for messages and help."""
        raise NotImplementedError

    @property
    def bad_values(self) -> tuple[str, ...]:
        """Texts this check must refuse."""
        raise NotImplementedError

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
    def allowed(self) -> str:
        return f"an integer from {self.minimum} to {self.maximum}"

    @property
    def bad_values(self) -> tuple[str, ...]:
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
    def allowed(self) -> str:
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        return f"a number {low}" + ("" if math.isinf(self.high) else f" and <= {self.high:g}")

    @property
    def bad_values(self) -> tuple[str, ...]:
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
    def allowed(self) -> str:
        return "one of " + ", ".join(self.values)

    @property
    def bad_values(self) -> tuple[str, ...]:
        return ("no-such-choice",)

    def parse(self, text: str) -> str:
        if text not in self.values:
            raise self.refuse(text)
        return text


@dataclass(frozen=True)
class Word(Check):
    """One word of the characters ``pattern`` allows (a job name, a folder name); "." and ".." never."""

    pattern: str = r"[A-Za-z0-9._+:-]+"
    allowed: str = "one word of letters, digits, '.', '_', '-', '+', ':'"
    bad_values: tuple[str, ...] = ("", "two words", "semi;colon", "a/b", "..")

    def parse(self, text: str) -> str:
        if not re.fullmatch(self.pattern, text) or text in (".", ".."):
            raise self.refuse(text)
        return text


NAME = Word()  # a name given to an outside system (a SLURM partition, a job name)
FOLDER_NAME = Word(r"[A-Za-z0-9._-]+", "one folder name (letters, digits, '.', '_', '-')")  # a results tag


def _can_be_made(path: Path) -> bool:
    """Whether the nearest existing ancestor of ``path`` is a folder (not a file)."""
    for ancestor in path.resolve().parents:
        if ancestor.exists():
            return ancestor.is_dir()
    return True


@dataclass(frozen=True)
class OutputFile(Check):
    """A file to write: not a folder, and not under an existing file."""

    allowed: str = "a file path whose folder exists or can be made"
    bad_values: tuple[str, ...] = ("/", str(Path(__file__).resolve() / "x.json"))

    def parse(self, text: str) -> Path:
        path = Path(text)
        if not text or path.is_dir() or text.endswith(("/", "\\")) or not _can_be_made(path):
            raise self.refuse(text)
        return path


@dataclass(frozen=True)
class OutputFolder(Check):
    """A folder to write into: it may not exist yet, but it is not a file nor under one."""

    allowed: str = "a folder path that exists or can be made"
    bad_values: tuple[str, ...] = (str(Path(__file__).resolve()), str(Path(__file__).resolve() / "sub"))

    def parse(self, text: str) -> Path:
        path = Path(text)
        if not text or (path.exists() and not path.is_dir()) or not _can_be_made(path):
            raise self.refuse(text)
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
