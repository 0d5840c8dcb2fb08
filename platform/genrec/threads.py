"""An engine's CPU threads: torch's intra-op thread count and, when asked, the cores they are bound to
(docs/operations.md, "Threads"). Serve replicas, batch actors and `genrec bench load` apply `ThreadSettings` here,
before the engine loads. Cores are chosen among those the process may run on (`os.sched_getaffinity`: Ray reserves
CPUs by count, not by core), starting at `slot` (default: the process ID), so replicas that each pin fewer threads
than the node has cores do not all land on the first ones.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pydantic import BaseModel, Field, field_validator

from genrec.api import Int, Switch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What `apply_threads` did: torch's thread count and the cores bound to (None: not bound)."""

    threads: int
    cores: tuple[int, ...] | None

    def as_dict(self) -> dict:
        return {"threads": self.threads, "pinned_cores": list(self.cores) if self.cores is not None else None}


class ThreadSettings(BaseModel):
    """An engine process's CPU threads, as a Serve engine replica's config and a batch job's flags state them."""

    threads: Int | None = Field(
        None, ge=1, description="torch intra-op threads (default: torch's; under Ray, one per CPU)"
    )
    pin_threads: Switch = Field(
        False, description="bind the threads to `threads` cores of the node (genrec.threads; Linux)"
    )

    @field_validator("pin_threads")
    @classmethod
    def _pinning_needs_a_count(cls, pin: bool, info) -> bool:
        if pin and info.data.get("threads") is None:
            raise ValueError("needs threads: the number of cores to bind the threads to")
        return pin

    def apply(self, slot: int | None = None, *, threads_name: str = "threads", pin_name: str = "pin_threads"):
        """`apply_threads` with these settings (names: how the caller's user wrote them, for its errors)."""
        return apply_threads(self.threads, self.pin_threads, slot=slot, threads_name=threads_name, pin_name=pin_name)


def check_thread_settings(
    threads: int | None, pin: bool, *, threads_name: str = "threads", pin_name: str = "pin"
) -> None:
    """Refuse bad settings with the name of the setting at fault (the caller's: a config field or a flag)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"{threads_name}={threads!r}: a number of threads, 1 or more")
    if not isinstance(pin, bool):
        raise ValueError(f"{pin_name}={pin!r}: true or false")
    if pin and threads is None:
        raise ValueError(f"{pin_name} needs {threads_name}: the number of cores to bind the threads to")


def available_cores() -> list[int]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def choose_cores(count: int, available: list[int], slot: int = 0) -> list[int]:
    """`count` of the `available` cores, consecutive (wrapping) from position `slot` modulo their number."""
    if count > len(available):
        raise ValueError(f"{count} threads pinned to distinct cores, but only {len(available)} are available")
    start = slot % len(available)
    return sorted(available[(start + i) % len(available)] for i in range(count))


def apply_threads(
    threads: int | None,
    pin: bool = False,
    *,
    slot: int | None = None,
    threads_name: str = "threads",
    pin_name: str = "pin",
) -> Applied:
    """Set torch's intra-op threads (None: torch's default) and, with `pin`, bind every thread of this process to
    `threads` cores: first, so the threads torch starts afterwards inherit them (not Linux: a warning)."""
    import torch

    check_thread_settings(threads, pin, threads_name=threads_name, pin_name=pin_name)
    cores = None
    if pin:
        available = available_cores()
        if threads > len(available):
            raise ValueError(
                f"{threads_name}={threads} with {pin_name}: only {len(available)} core(s) available to this process "
                f"({available})"
            )
        if hasattr(os, "sched_setaffinity"):
            if threads == len(available):
                log.warning(
                    "%s: %s=%d is every core this process may use (%s); binding to them changes nothing",
                    pin_name, threads_name, threads, available,
                )  # fmt: skip
            cores = choose_cores(threads, available, os.getpid() if slot is None else slot)
            _bind_all_threads(set(cores))
        else:
            log.warning("%s: this OS cannot bind threads to cores; only the thread count is set", pin_name)
    if threads is not None:
        torch.set_num_threads(threads)
    return Applied(torch.get_num_threads(), tuple(cores) if cores is not None else None)


def _bind_all_threads(cores: set[int]) -> None:
    """Linux binds one thread at a time: the calling one (new threads inherit it), then every other one listed
    in /proc/self/task (torch's pool if it already runs, Ray's and gRPC's threads)."""
    os.sched_setaffinity(0, cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            continue
