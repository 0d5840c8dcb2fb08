"""Shared benchmark plumbing: preset model directories, random prompts, timing."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import socket
import statistics
import time
from pathlib import Path

import torch

from genrec.model.tiny import preset, write_model_dir


def model_dir_for(preset_name: str, model: Path | None, levels: int | None) -> Path:
    """The user's directory, or a cached random-weight directory of the preset's dimensions."""
    if model is not None:
        if levels is not None:
            raise ValueError("--levels sets the code length of a preset's catalog; --model brings its own: drop one")
        return model
    overrides = {"levels": levels} if levels else {}
    spec = preset(preset_name, **overrides)
    root = Path(os.environ.get("GENREC_CACHE", Path.home() / ".cache" / "genrec")) / "presets"
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:10]
    target = root / f"{preset_name}-L{spec.levels}-{digest}"
    if not (target / "genrec" / "catalog.parquet").exists():
        dtype = torch.bfloat16 if spec.hidden >= 2048 else torch.float32
        init_device = "cuda" if torch.cuda.is_available() else "cpu"
        partial = target.with_suffix(".partial")
        for stale in (partial, target):  # left by an interrupted earlier write
            shutil.rmtree(stale, ignore_errors=True)
        write_model_dir(partial, spec, dtype=dtype, init_device=init_device)
        partial.rename(target)  # a crash mid-write leaves no half directory under the real name
    return target


def check_device(device: str) -> str:
    """`device` if this machine has it (cpu, cuda, cuda:N); otherwise one clear error before any work."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: genrec runs on cpu or cuda")
    return device


def check_rate(rate: float) -> float:
    """An offered load in requests per second: positive and finite (a Poisson clock never advances otherwise)."""
    if not 0 < rate < math.inf:
        raise ValueError(f"rate {rate}: offered loads must be positive numbers of requests per second")
    return rate


def parse_rates(text: str) -> list[float]:
    """`--rates 1,2,4`: comma-separated offered loads, each checked."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates {text!r}: expected comma-separated numbers, e.g. 1,2,4") from None
    if not rates:
        raise ValueError("--rates is empty: give at least one offered load, e.g. 1,2,4")
    return [check_rate(r) for r in rates]


def random_prompt(engine, length: int, generator: torch.Generator) -> list[int]:
    """Token IDs drawn from the ordinary (non semantic-ID, non special) part of the vocabulary."""
    first_semantic = int(engine.family.trie.token[0].min())
    ordinary = torch.ones(first_semantic, dtype=torch.bool)
    ordinary[[i for i in engine.family.tokenizer.all_special_ids if i < first_semantic]] = False
    pool = ordinary.nonzero()[:, 0]
    return pool[torch.randint(0, len(pool), (length,), generator=generator)].tolist()


def synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int, device, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict, repeats: int, device, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timed round-robin so that machine drift hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def load_hf(model_dir: Path, device, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def machine() -> dict:
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (benchmarks only ever listen on the loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
