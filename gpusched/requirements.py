"""What a test needs: a number of GPUs and, optionally, a minimum memory per card.

Pure parsing and validation, shared by the pytest plugin (markers, path globs)
and the command line (``--simulate-gpus``). Every error message names the input
and what is wrong with it, because it ends up in front of a user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

SHORTHAND_MARKERS = {"gpu1": 1, "gpu2": 2, "gpu4": 4, "gpu8": 8}


class RequirementError(ValueError):
    """A GPU requirement that cannot be understood (bad marker, glob or memory)."""


@dataclass(frozen=True, order=True)
class Requirement:
    """GPUs a test (or a whole file) needs: ``gpus`` cards with at least ``memory`` bytes each."""

    gpus: int = 0
    memory: int | None = None

    def combine(self, other: Requirement) -> Requirement:
        """The requirement of a file holding both: the most cards, the most memory per card."""
        memories = [m for m in (self.memory, other.memory) if m is not None]
        return Requirement(max(self.gpus, other.gpus), max(memories) if memories else None)

    def describe(self) -> str:
        if self.gpus == 0:
            return "cpu"
        text = f"{self.gpus} GPU" + ("s" if self.gpus != 1 else "")
        return text + (f" >= {format_memory(self.memory)}" if self.memory else "")


def parse_memory(value: object) -> int:
    """Bytes from ``"40GB"``, ``"80GiB"``, ``"512MB"`` or a plain integer of bytes.

    GB is decimal (10**9) as on GPU spec sheets: an "80GB" card reports about
    85.5e9 bytes through NVML, so ``memory="80GB"`` admits it.
    """
    if isinstance(value, bool):
        raise RequirementError(f"memory {value!r} is not a size like '40GB'")
    if isinstance(value, int):
        if value <= 0:
            raise RequirementError(f"memory {value!r} must be positive")
        return value
    if not isinstance(value, str):
        raise RequirementError(f"memory {value!r} is not a size like '40GB'")
    match = _MEMORY_RE.match(value)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise RequirementError(f"memory {value!r} is not a size like '40GB', '80GiB' or '512MB'")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise RequirementError(f"memory {value!r} must be positive")
    return size


def format_memory(size: int | None) -> str:
    """Human form of a byte count, in decimal GB like the spec sheets."""
    if size is None:
        return "?"
    if size >= 10**9:
        return f"{size / 10**9:.4g}GB"
    return f"{size / 10**6:.4g}MB"


def parse_gpu_count(value: object, what: str) -> int:
    """A non-negative integer count of GPUs; ``what`` names the source in errors."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequirementError(f"{what}: GPU count {value!r} is not an integer")
    if value < 0:
        raise RequirementError(f"{what}: GPU count {value} is negative")
    return value


def requirement_from_marker(name: str, args: tuple, kwargs: dict) -> Requirement:
    """The requirement one marker states: ``gpu(n, memory=...)`` or a ``gpuN`` shorthand."""
    if name in SHORTHAND_MARKERS:
        if args:
            raise RequirementError(f"@{name} takes no positional arguments, got {args!r}")
        unknown = set(kwargs) - {"memory"}
        if unknown:
            raise RequirementError(f"@{name} got unknown arguments {sorted(unknown)}")
        memory = kwargs.get("memory")
        return Requirement(SHORTHAND_MARKERS[name], parse_memory(memory) if memory else None)
    if name != "gpu":
        raise RequirementError(f"@{name} is not a GPU marker")
    unknown = set(kwargs) - {"memory", "n"}
    if unknown:
        raise RequirementError(f"@gpu got unknown arguments {sorted(unknown)}")
    if len(args) > 1:
        raise RequirementError(f"@gpu takes one count, got {args!r}")
    if args and "n" in kwargs:
        raise RequirementError("@gpu got the count twice (positional and n=)")
    if not args and "n" not in kwargs:
        raise RequirementError("@gpu needs a count, e.g. @pytest.mark.gpu(2)")
    count = parse_gpu_count(args[0] if args else kwargs["n"], "@gpu")
    memory = kwargs.get("memory")
    return Requirement(count, parse_memory(memory) if memory is not None else None)


def requirement_from_glob_value(pattern: str, value: object) -> Requirement:
    """A ``[tool.gpusched.gpus]`` entry: ``"tests/multi/*" = 2`` or ``= {gpus = 2, memory = "40GB"}``."""
    where = f"[tool.gpusched.gpus] {pattern!r}"
    if isinstance(value, dict):
        unknown = set(value) - {"gpus", "memory"}
        if unknown:
            raise RequirementError(f"{where}: unknown keys {sorted(unknown)}")
        if "gpus" not in value:
            raise RequirementError(f"{where}: missing 'gpus'")
        memory = value.get("memory")
        return Requirement(
            parse_gpu_count(value["gpus"], where),
            parse_memory(memory) if memory is not None else None,
        )
    return Requirement(parse_gpu_count(value, where))
