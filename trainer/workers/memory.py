"""Peak memory of a worker process, reported with its metrics (``perf/``)."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["peak_memory_metrics"]


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """``perf/peak_rss_gb`` of this process, and on CUDA ``perf/max_memory_allocated_gb``.

    Peaks since the process started (RSS) or since CUDA was initialised
    (allocator), in GiB: what a user sizing a card or a node looks for.
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
    out = {"perf/peak_rss_gb": rss_bytes / 2**30}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out
