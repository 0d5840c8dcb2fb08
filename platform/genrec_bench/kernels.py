"""`genrec bench kernels`: kernels per prefill layer and per decode-pass layer, the fused path against the unfused;
with `--hstu-preset`, also per HSTU layer (a history's prefill, candidates over it).

A layer's count is what the pass with all the model's layers runs beyond the same pass with its first layer only,
divided by the layers between: every layer alike, whatever runs once per pass (embedding, head, inputs) left out.
Counted on the CPU: aten ops that compute, as a dispatch mode sees them (a view costs nothing, a cast only when it
copies); on CUDA: the kernels torch.profiler records. Fused is the engine's `fast` option (on CUDA the layer pieces
of `genrec.model.fused` compiled, FA2 for attention); the baseline is the same pass with it off. The CPU runs the
plain pieces either way, so there its two counts agree and the figure is the ops left per layer.

Without Ray (a GPU machine): `PYTHONPATH=platform python -m genrec.cli bench kernels --device cuda [--preset P]`,
or `genrec_bench.kernels.run(KernelsOptions(device="cuda"))`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genrec.api import RetrieveRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.decode_batch import DecodeBatch
from genrec.engine.selection import choices
from genrec.model import ModelDir
from genrec.model.hstu import HistoryRows, HistorySegment
from genrec.model.ops import ModelOps
from genrec_bench.cli import KernelsOptions
from genrec_bench.common import described, hstu_preset_dir, machine, model_dir_for, random_prompt

GOALS = {"prefill": 15, "decode": 12}  # per layer, CUDA kernels on the fused path (issue #38)
aten = torch.ops.aten
FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}  # allocations, no kernel


def run(o: KernelsOptions) -> dict:
    model_dir = model_dir_for(o.preset, o.model, None)
    counts, logits = {}, {}
    cuda = torch.device(o.device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the engine's default
    ranker = (
        None if o.hstu_preset is None else ModelDir.open(hstu_preset_dir(o.hstu_preset)).load_model(o.device, dtype)
    )
    for name, fast in (("unfused", False), ("fused", True)):
        engine = Engine.from_pretrained(
            model_dir, device=o.device, cuda_fast=fast, scheduler=SchedulerConfig(prefix_cache_bytes=0)
        )
        counts[name], logits[name] = layer_counts(engine, o.prompt_len, o.requests, o.beam_width)
        if ranker is not None:
            counts[name] |= hstu_layer_counts(ranker, o.prompt_len, o.requests * o.beam_width, engine.plan.ops)
    return {
        "benchmark": "kernels",
        **described(model_dir, o, "device", "prompt_len", "requests", "beam_width"),
        "dtype": str(engine.model.dtype),
        "layers": engine.model.config.num_hidden_layers,
        "counted": "CUDA kernels (torch.profiler)" if cuda else "aten ops that compute (CPU dispatch)",
        "per_layer": counts,
        "ratios": {f"{p}_fused_over_unfused": n / counts["unfused"][p] for p, n in counts["fused"].items()},
        "goals_per_layer": GOALS if cuda else None,
        "prefill_logits_max_diff": (logits["fused"] - logits["unfused"]).abs().max().item(),
        "machine": machine(),
    }


def layer_counts(engine: Engine, prompt_len: int, requests: int, beam_width: int) -> tuple[dict, torch.Tensor]:
    """Per-layer counts of a prefill of `prompt_len` tokens and of a decode pass over `requests` x `beam_width`
    rows (contexts of `prompt_len`, a level with a beam suffix); and the prefill's last logits."""
    from genrec_bench.gpu_check import pooled_cohorts

    g = torch.Generator().manual_seed(0)
    prepared = [
        engine.prepare(RetrieveRequest(prompt_token_ids=random_prompt(engine, prompt_len, g), beam_width=beam_width))
        for _ in range(requests)
    ]
    pool = engine.runner.new_pool(requests * (prompt_len + 4096))
    cohorts = pooled_cohorts(engine, prepared, pool)
    engine.runner.decode(cohorts, bucketed=False)  # on to a level whose rows have a suffix to attend to
    selections = choices(cohorts)
    rows = sum(c.rows for c in cohorts)
    batch = DecodeBatch(rows, engine.runner.past, pool, engine.plan.ops, 1, engine.family.max_children)
    batch.fill(selections)
    passes = {
        "prefill": lambda: engine.runner.prefill_alone(prepared[0]),
        "decode": lambda: engine.runner.decode_forward(batch),
    }
    counts = {name: per_layer(engine.model.model.layers, fn, engine.device) for name, fn in passes.items()}
    return counts, passes["prefill"]().last_logits.float().cpu()


def hstu_layer_counts(model, events: int, candidates: int, ops: ModelOps) -> dict:
    """Per-layer counts of HSTU's history prefill of `events` events and of `candidates` rows over that history."""
    c, device = model.config, model.device
    g = torch.Generator().manual_seed(0)
    items = torch.randint(0, c.num_items, (events + candidates,), generator=g).to(device)
    history = model.embed_events(items[:events], None, torch.arange(events, device=device))
    rows = model.embed_events(items[events:], None, torch.full((candidates,), events, device=device))
    shape = (c.num_hidden_layers, events, c.num_attention_heads, c.head_dim)
    k, v = torch.zeros(shape, device=device, dtype=model.dtype), torch.zeros(shape, device=device, dtype=model.dtype)
    passes = {
        "hstu_prefill": lambda: model.prefill_packed([HistorySegment(history, k, v, 0)], ops),
        "hstu_candidates": lambda: model.forward_candidates(rows, [HistoryRows(0, candidates, k, v)], ops),
    }
    return {name: per_layer(model.layers, fn, device) for name, fn in passes.items()}


def per_layer(layers: torch.nn.ModuleList, fn, device) -> float:
    """What one layer adds to `fn`'s count: (all layers - the first alone) / (layers - 1)."""
    if len(layers) < 2:
        raise ValueError("counting kernels per layer needs a model of at least 2 layers")
    full = count(fn, device)
    with first_layers(layers, 1):
        one = count(fn, device)
    return (full - one) / (len(layers) - 1)


@contextlib.contextmanager
def first_layers(layers: torch.nn.ModuleList, n: int):
    """The model runs its first `n` layers only, inside the block."""
    kept = list(layers)
    del layers[n:]
    try:
        yield
    finally:
        layers.extend(kept[n:])


def count(fn, device) -> int:
    """Kernels of one call of `fn` after a warm-up call (which compiles what compiles): CUDA kernels on CUDA, aten
    ops that compute on the CPU."""
    fn()
    if torch.device(device).type != "cuda":
        with AtenOps() as ops:
            fn()
        return ops.count
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched that compute: views and allocations are free; an op that may alias (`to`,
    `contiguous`) counts when it returned new storage."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in FREE and (not func.is_view or _copied(out, args)):
            self.count += 1
            self.names.append(str(func))
        return out


def _copied(out, args) -> bool:
    source = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor) or source is None:
        return False
    return out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
