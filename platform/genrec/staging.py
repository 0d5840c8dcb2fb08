"""Where data crosses between host and device, by name: nothing else in a step may block on the device.
`to_device` stages host values in pinned memory and copies them asynchronously on CUDA; `fetch` is the one
deliberate device-to-host read (once, at a request's end); `host_side()` marks host-only code (request checks
before any device work). The no-sync checker (`tests/sync_guard.py`) lets exactly these through.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import torch

_state = threading.local()


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=_NUMPY[dtype]))
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


@contextmanager
def _flagged(name: str):
    """Sets a thread-local flag for the duration of the block (nested blocks restore the outer value)."""
    before = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, before)


def fetching():
    """Marks a deliberate device-to-host read (see `fetch`)."""
    return _flagged("fetching")


def inside_fetch() -> bool:
    return getattr(_state, "fetching", False)


def host_side():
    """Marks host-only work (request checks on host tensors): nothing in it waits for the device."""
    return _flagged("host")


def on_host() -> bool:
    return getattr(_state, "host", False)


def fetch(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values on the host: the one place results wait for the device."""
    with fetching():
        return tensor.cpu().numpy()
