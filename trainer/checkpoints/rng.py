"""Random-number-generator states as JSON: what a checkpoint stores instead of a pickle.

Python's ``random.getstate()`` is a tuple of ints (and a float or None), numpy's
legacy state a tuple around a ``uint32`` array, torch's a ``uint8`` tensor:
:func:`encode` turns them into lists and numbers that ``json`` writes exactly
(floats round-trip through ``repr``), :func:`decode` turns them back. Nothing
here is unpickled, so a checkpoint's RNG file cannot run code.

:func:`capture` and :func:`restore` are the effects (read and set the process's
generators); the codec in between is pure and tested on its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "decode", "encode", "restore"]


def encode(
    python: tuple[Any, ...],
    numpy: tuple[Any, ...],
    torch_cpu: torch.Tensor,
    cuda: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """JSON-able form of the states returned by ``random.getstate()``, ``np.random.get_state()``,
    ``torch.get_rng_state()`` and (optionally) ``torch.cuda.get_rng_state_all()``."""
    version, internal, gauss_next = python
    name, keys, pos, has_gauss, cached = numpy
    state: dict[str, Any] = {
        "python": [int(version), [int(x) for x in internal], gauss_next],
        "numpy": [str(name), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch_cpu.tolist(),
    }
    if cuda is not None:
        state["cuda"] = [t.tolist() for t in cuda]
    return state


def decode(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode`: objects the ``set_state`` functions accept.

    Raises ``ValueError`` naming the part that is malformed (a checkpoint
    written by something else, or edited by hand).
    """
    try:
        version, internal, gauss_next = state["python"]
        name, keys, pos, has_gauss, cached = state["numpy"]
        out: dict[str, Any] = {
            "python": (int(version), tuple(int(x) for x in internal), gauss_next),
            "numpy": (
                str(name),
                np.asarray(keys, dtype=np.uint32),
                int(pos),
                int(has_gauss),
                float(cached),
            ),
            "torch": torch.tensor(state["torch"], dtype=torch.uint8),
        }
        if "cuda" in state:
            out["cuda"] = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed RNG state ({type(exc).__name__}: {exc})") from None
    return out


def capture() -> dict[str, Any]:
    """This process's python, numpy, torch (and CUDA, when present) RNG states, JSON-able."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return encode(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to what :func:`capture` returned."""
    s = decode(state)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
