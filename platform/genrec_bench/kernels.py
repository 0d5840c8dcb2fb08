"""`genrec bench kernels`: kernels per prefill layer and per decode-pass layer, the fused path against the unfused;
with `--hstu-preset`, also per HSTU layer (a history's prefill, candidates over it).

A layer's count is what the pass with all the model's layers runs beyond the same pass with its first layer only,
divided by the layers between: every layer alike, whatever runs once per pass (embedding, head, inputs) left out.
Counted on the CPU: aten ops that compute, as a dispatch mode sees them (a view costs nothing, a cast only when it
copies), the ops inside genrec's custom ops (the attention's static call) included; on CUDA: the kernels
torch.profiler records. Fused is the engine's `fast` option (on CUDA the layer pieces of `genrec.model.fused`
compiled, FA2 for attention); the baseline is the same pass with it off. The CPU runs the plain pieces either way, so
there its two counts agree and the figure is the ops left per layer.

On the CPU `cpu_breakdown` also says where a layer's ops run: inside the plan's pieces (what CUDA compiles, each a
kernel or two there), inside the attention kernel's call, or outside both, those by kind (matrix products, copies,
concatenations, fills, other). Outside ops plus piece and attention calls is what a layer would launch with every
piece compiled to one kernel (and a matrix product inside a piece to one more, as Inductor calls it):
`kernels_if_fused`, the CPU's estimate of the CUDA count (FA2's call counted as one).

Without Ray (a GPU machine): `PYTHONPATH=platform python -m genrec.cli bench kernels --device cuda [--preset P]`,
or `genrec_bench.kernels.run(KernelsOptions(device="cuda"))`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genrec.api import RetrieveRequest
from genrec.attention.kernels import AttentionKernels
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.decode_batch import DecodeBatch
from genrec.engine.plan import ExecutionPlan
from genrec.engine.selection import choices
from genrec.model.directory import ModelDir
from genrec.model.fused import Pieces
from genrec.model.hstu import HistoryRows, HistorySegment
from genrec.model.ops import ModelOps
from genrec_bench.cli import KernelsOptions
from genrec_bench.common import described, hstu_preset_dir, machine, model_dir_for, random_prompt

GOALS = {"prefill": 15, "decode": 12}  # per layer, CUDA kernels on the fused path (issue #38)
aten = torch.ops.aten
FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}  # allocations, no kernel
# Kinds of the ops outside the pieces and the attention, by aten name (anything else: "other"); inference mode
# dispatches `linear` and `einsum` whole.
KINDS = {
    "matmul": {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "_scaled_mm"},
    "copy": {"copy_", "_to_copy", "clone", "index", "index_select", "gather", "index_copy", "index_copy_", "index_put",
             "index_put_", "repeat", "embedding"},
    "cat": {"cat", "stack"},
    "fill": {"fill_", "zero_", "masked_fill", "masked_fill_", "where", "full", "zeros", "ones", "full_like",
             "zeros_like", "ones_like", "new_zeros", "new_full", "new_ones"},
}  # fmt: skip


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
            model_dir,
            device=o.device,
            cuda_fast=fast,
            scheduler=SchedulerConfig(prefix_cache_bytes=0),
            plan=None if cuda else marked_plan(o.device),  # the CPU's: the same plain plan, its calls marked
        )
        figures, logits[name] = layer_counts(engine, o.prompt_len, o.requests, o.beam_width)
        if ranker is not None:
            figures |= hstu_layer_counts(ranker, o.prompt_len, o.requests * o.beam_width, engine.plan.ops)
        counts[name] = {p: ops_of(figure) for p, figure in figures.items()}
    return {
        "benchmark": "kernels",
        **described(model_dir, o, "device", "prompt_len", "requests", "beam_width"),
        "dtype": str(engine.model.dtype),
        "layers": engine.model.config.num_hidden_layers,
        "counted": "CUDA kernels (torch.profiler)" if cuda else "aten ops that compute (CPU dispatch)",
        "per_layer": counts,
        "ratios": {f"{p}_fused_over_unfused": n / counts["unfused"][p] for p, n in counts["fused"].items()},
        "goals_per_layer": GOALS if cuda else None,
        "cpu_breakdown": None if cuda else figures,
        "prefill_logits_max_diff": (logits["fused"] - logits["unfused"]).abs().max().item(),
        "machine": machine(),
    }


def layer_counts(engine: Engine, prompt_len: int, requests: int, beam_width: int) -> tuple[dict, torch.Tensor]:
    """Per-layer figures (`per_layer`) of a prefill of `prompt_len` tokens and of a decode pass over `requests` x
    `beam_width` rows (contexts of `prompt_len`, a level with a beam suffix); and the prefill's last logits."""
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
    figures = {name: per_layer(engine.model.model.layers, fn, engine.device) for name, fn in passes.items()}
    return figures, passes["prefill"]().last_logits.float().cpu()


def hstu_layer_counts(model, events: int, candidates: int, ops: ModelOps) -> dict:
    """Per-layer figures of HSTU's history prefill of `events` events and of `candidates` rows over that history."""
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


def per_layer(layers: torch.nn.ModuleList, fn, device) -> float | dict:
    """What one layer adds to `fn`'s figure, (all layers - the first alone) / (layers - 1): on CUDA its kernels, on
    the CPU its tally (`Tally.per_layer`: "ops" the count, and where they ran)."""
    if len(layers) < 2:
        raise ValueError("counting kernels per layer needs a model of at least 2 layers")
    full = count(fn, device)
    with first_layers(layers, 1):
        one = count(fn, device)
    if isinstance(full, Tally):
        return full.per_layer(one, len(layers) - 1)
    return (full - one) / (len(layers) - 1)


def ops_of(figure: float | dict) -> float:
    """A `per_layer` figure's count."""
    return figure["ops"] if isinstance(figure, dict) else figure


@contextlib.contextmanager
def first_layers(layers: torch.nn.ModuleList, n: int):
    """The model runs its first `n` layers only, inside the block."""
    kept = list(layers)
    del layers[n:]
    try:
        yield
    finally:
        layers.extend(kept[n:])


def count(fn, device) -> int | Tally:
    """Kernels of one call of `fn` after a warm-up call (which compiles what compiles): CUDA kernels on CUDA; on the
    CPU the tally of the aten ops that compute."""
    fn()
    if torch.device(device).type != "cuda":
        with AtenOps() as ops:
            fn()
        return ops.tally
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched that compute: views and allocations are free; an op that may alias (`to`,
    `contiguous`) counts when it returned new storage. A genrec custom op counts the ops its kernel runs (dispatched
    under this mode). Calls marked by a `marked_plan` say where each op ran (`tally`)."""

    active: AtenOps | None = None  # the counting mode entered last (what `Marked` calls report to)

    def __init__(self):
        super().__init__()
        self.tally = Tally()
        self.inside: str | None = None  # the marked call running: "pieces" or "attention"
        self.outer: list = []  # the modes active before each entry (a custom op's kernel re-enters this one)

    def __enter__(self):
        self.outer.append(AtenOps.active)
        AtenOps.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        AtenOps.active = self.outer.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "genrec":  # its kernel's own ops, under this mode (here the mode is popped)
            with self:
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func not in FREE and (not func.is_view or _copied(out, args)):
            self.tally.op(func.overloadpacket.__name__, self.inside)
        return out

    def marked(self, role: str, fn, args, kwargs):
        """`fn` run as a marked call of `role`: its ops counted as inside it (a call within a marked call: its)."""
        if self.inside is not None:
            return fn(*args, **kwargs)
        self.tally.calls[role] += 1
        self.inside = role
        try:
            return fn(*args, **kwargs)
        finally:
            self.inside = None


class Tally:
    """Where a pass's ops ran: inside the pieces, inside the attention's calls, or outside both (by kind)."""

    def __init__(self):
        self.calls = collections.Counter()  # marked calls by role
        self.inside = collections.Counter()  # ops inside marked calls, by role
        self.outside = collections.Counter()  # the other ops, by kind (KINDS)

    def op(self, name: str, inside: str | None) -> None:
        if inside is not None:
            self.inside[inside] += 1
            self.inside[f"{inside} matmul"] += name in KINDS["matmul"]
        else:
            self.outside[next((kind for kind, names in KINDS.items() if name in names), "other")] += 1

    def per_layer(self, first: Tally, layers: int) -> dict:
        """One layer's share: (self - first) / layers, `first` the same pass's tally with one layer."""

        def share(a: collections.Counter, b: collections.Counter, key: str) -> float:
            return (a[key] - b[key]) / layers

        outside = {kind: share(self.outside, first.outside, kind) for kind in (*KINDS, "other")}
        calls = {role: share(self.calls, first.calls, role) for role in ("pieces", "attention")}
        inside = {role: share(self.inside, first.inside, role) for role in ("pieces", "attention")}
        piece_matmuls = share(self.inside, first.inside, "pieces matmul")  # compiled: each an extern kernel
        return {
            "ops": sum(outside.values()) + sum(inside.values()),
            "outside": outside,
            "calls": calls,
            "inside": inside,
            "piece_matmuls": piece_matmuls,
            "kernels_if_fused": sum(outside.values()) + sum(calls.values()) + piece_matmuls,
        }


class Marked:
    """A plan's callable (a piece, an attention kernel) that reports its calls to the counting mode, if any."""

    def __init__(self, role: str, fn):
        self.role, self.fn = role, fn
        self.__name__ = getattr(fn, "__name__", role)

    def __call__(self, *args, **kwargs):
        counter = AtenOps.active
        return self.fn(*args, **kwargs) if counter is None else counter.marked(self.role, self.fn, args, kwargs)


def marked_plan(device) -> ExecutionPlan:
    """The CPU's plan with every piece and attention call marked (`Marked`): the same ops, told apart."""
    plain = ExecutionPlan(torch.device(device))
    pieces = Pieces(**{f.name: Marked("pieces", getattr(plain.ops.pieces, f.name)) for f in dataclasses.fields(Pieces)})
    k = plain.ops.attention
    attention = AttentionKernels(
        k.name, Marked("attention", k.varlen), Marked("attention", k.static), k.query_block, k.max_sequences
    )
    return dataclasses.replace(plain, ops=ModelOps(pieces, attention))


def _copied(out, args) -> bool:
    source = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor) or source is None:
        return False
    return out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
