"""The benchmarks' harness: model directories, checks of the command line's values, prompts, timing, ratios, the
latency plot and the machine's description."""

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

from genrec.errors import GenrecError
from genrec.testing.tiny import hstu_preset, preset, write_hstu_dir, write_model_dir


def presets_root() -> Path:
    """Where random-weight preset directories are cached (GENREC_CACHE, else ~/.cache/genrec)."""
    return Path(os.environ.get("GENREC_CACHE", Path.home() / ".cache" / "genrec")) / "presets"


def model_dir_for(preset_name: str, model: Path | None, levels: int | None) -> Path:
    """The user's directory, or a cached random-weight directory of the preset's dimensions."""
    if model is not None:
        if levels is not None:
            raise ValueError("--levels sets the code length of a preset's catalog; --model brings its own: drop one")
        return model
    spec = preset(preset_name, **({"levels": levels} if levels else {}))
    return cached_dir(f"{preset_name}-L{spec.levels}", spec, write_decoder)


def hstu_preset_dir(name: str) -> Path:
    return cached_dir(f"hstu-{name}", hstu_preset(name), write_hstu_dir)


def cached_dir(name: str, spec, write) -> Path:
    """The directory `write(path, spec)` makes (genrec.testing's writers), written once under presets_root() and
    named by the spec's hash, so that a changed spec is a new directory."""
    target = presets_root() / f"{name}-{hashlib.sha1(repr(spec).encode()).hexdigest()[:10]}"
    if not (target / "genrec" / "catalog.parquet").exists():
        partial = target.with_name(target.name + ".partial")
        for stale in (partial, target):  # left by an interrupted earlier write
            shutil.rmtree(stale, ignore_errors=True)
        write(partial, spec)
        partial.rename(target)  # a crash mid-write leaves no half directory under the real name
    return target


def write_decoder(path: Path, spec) -> None:
    """A Qwen3 preset's directory: bf16 from Qwen3-1.7B's width up, initialised on the GPU where there is one."""
    dtype = torch.bfloat16 if spec.hidden >= 2048 else torch.float32
    write_model_dir(path, spec, dtype=dtype, init_device="cuda" if torch.cuda.is_available() else "cpu")


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


def decoder(engine):
    """The parts of a Qwen3 engine the benches read (tokenizer, trie, projector, placeholder_id, levels): reached
    through here only, so that where an engine keeps them is said once."""
    return engine.family


def random_prompt(engine, length: int, generator: torch.Generator) -> list[int]:
    """Token IDs drawn from the ordinary (non semantic-ID, non special) part of the vocabulary."""
    first_semantic = int(decoder(engine).trie.token[0].min())
    ordinary = torch.ones(first_semantic, dtype=torch.bool)
    ordinary[[i for i in decoder(engine).tokenizer.all_special_ids if i < first_semantic]] = False
    pool = ordinary.nonzero()[:, 0]
    return pool[torch.randint(0, len(pool), (length,), generator=generator)].tolist()


def synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    """Seconds of one call of `fn`, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median_seconds(fn, repeats: int, device, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def interleaved_medians(fns: dict, repeats: int, device, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timed round-robin so that machine drift hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def described(model_dir, o, *names: str) -> dict:
    """A report's model, its preset (None where --model gave a directory) and the options named, as given."""
    return {"model": str(model_dir), "preset": None if o.model else o.preset, **{n: getattr(o, n) for n in names}}


def ratio(a, b) -> float | None:
    """a / b, or None where either figure is missing (b also where it is 0)."""
    return a / b if a is not None and b else None


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


def plot_latency(path, title: str, xlabel: str, curves: list, lines: list) -> None:
    """Latency (ms, log scale) against load: `curves` are (label, xs, seconds, plot style), `lines` vertical
    marks (x, axvline style)."""
    try:
        import matplotlib
    except ImportError:
        raise GenrecError("--plot needs matplotlib: pip install 'genrec[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, seconds, style in curves:
        ax.plot(xs, [s * 1000 for s in seconds], marker="o", label=label, **style)
    for x, style in lines:
        ax.axvline(x, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
