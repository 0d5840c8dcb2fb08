"""A GPU hazard caught on the CPU: Dynamo's recompile limit. The layer pieces compile whole (fullgraph); Dynamo keeps
at most 8 cache entries per code object and then RAISES instead of falling back. Entries pile up per piece: a decode
pass and a prefill (another rank), scoring, a live 1-row request, another dtype, another model size. gpu_check builds
several engines in one process, so a shared set of compiled pieces could fail the 1.7B engine's start.

Here the pieces compile with backend "eager" (Dynamo alone: its guards, entries and limit, no Inductor) and every
engine one process builds runs the CUDA plan's own call sequence on the CPU: its captures (every bucket, sequence
capacity and span count), its warm-up, then live requests of every kind (wide and 1-row retrieves, split passes,
scoring, ranking). No piece fails, none falls back, and each stays well under the limit (Inductor may add guards);
pieces shared across the engines (the code before the fix, planted) meet the limit.
"""

import dataclasses

import pytest
import torch

from genrec.api import Event, RankRequest, RetrieveRequest, ScoreRequest
from genrec.engine import Engine, SchedulerConfig
from genrec.engine.plan import ExecutionPlan
from genrec.model import fused
from genrec.model.ops import ModelOps
from genrec.testing.tiny import write_model_dir
from tests.conftest import TINY, random_prompt
from tests.plans import FLASH_ON_CPU, graphed_plan

pytestmark = pytest.mark.slow  # make test runs it; make test-fast skips it

LIMIT = 8  # torch._dynamo.config.recompile_limit's default
HEADROOM = 3  # entries a piece may not reach, kept for Inductor's extra guards


class Replayed:
    """A captured pass as the runner uses it (no recording: only the call sequence matters here)."""

    def __init__(self, forward):
        self.forward = forward
        self.outputs = forward()

    def replay(self):
        for captured, now in zip(self.outputs or (), self.forward() or (), strict=True):
            captured.copy_(now)


def cuda_plan(pieces: fused.Pieces, dtype: torch.dtype) -> ExecutionPlan:
    """The CUDA plan's shape for an engine of `dtype`: half precision captures graphs and runs FlashAttention-2
    (emulated); float32 compiles its pieces but runs the reference attention, with no graphs."""
    if dtype == torch.float32:
        return ExecutionPlan(torch.device("cpu"), ModelOps(pieces))
    return graphed_plan(Replayed, ModelOps(pieces, FLASH_ON_CPU), split_kv="auto", sms=132)


def served(model_dir, plan: ExecutionPlan, dtype) -> Engine:
    # Small captures (passes of up to 32 rows of up to 4 requests, prefill passes of up to 64 tokens): the shapes a
    # piece compiles for are the ranks and sizes of its calls, not their count.
    config = SchedulerConfig(prefix_cache_bytes=0, prefill_tokens_per_step=64, max_running=4)
    engine = Engine.from_pretrained(model_dir, dtype=dtype, plan=plan, cuda_graph_max_rows=32, scheduler=config)
    assert engine.scheduler.idle  # its start: captures and warm-up
    return engine


def live_decoder_requests(engine: Engine, splitting: Engine) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [random_prompt(engine, n, g) for n in (5, 40, 300)]
    engine.retrieve(
        [RetrieveRequest(prompt_token_ids=p, beam_width=w) for p, w in zip(prompts, (1, 9, 30), strict=True)]
    )
    engine.retrieve([RetrieveRequest(prompt_token_ids=prompts[1], beam_width=1)])  # a live 1-row pass
    items = engine.catalog.item_ids[:5].tolist()
    engine.score([ScoreRequest(prompt_token_ids=prompts[0], candidates=[{"item_id": i} for i in items])])
    engine.score([ScoreRequest(prompt_token_ids=prompts[2], candidates=[{"item_id": items[0]}])])  # one row
    splitting.retrieve([RetrieveRequest(prompt_token_ids=random_prompt(engine, 700, g), beam_width=12)])


def live_ranker_requests(engine: Engine) -> None:
    items = engine.catalog.item_ids.tolist()
    engine.rank([RankRequest(history=[Event(item_id=i) for i in items[3:40]], candidates=items[:9])])
    engine.rank([RankRequest(history=[Event(item_id=items[1])], candidates=[items[2]])])  # one of each


@pytest.fixture(scope="module")
def wider_dir(tmp_path_factory):
    """Another model size in the same process (as gpu_check runs the tiny preset beside Qwen3-1.7B's dimensions)."""
    spec = dataclasses.replace(TINY, hidden=96, heads=6, kv_heads=3, intermediate=160)
    return write_model_dir(tmp_path_factory.mktemp("wider") / "model", spec)


def run_every_engine(pieces_for, tiny_dir, wider_dir, hstu_dir=None, split=True) -> list[fused.Pieces]:
    """Every engine one process builds, each through its start and live requests; `pieces_for(name, dtype)`: the
    compiled pieces it gets. Returns the pieces used."""
    used = []
    for name, model_dir in (("tiny", tiny_dir), ("wider", wider_dir)):
        for dtype in (torch.bfloat16, torch.float32):
            pieces = pieces_for(name, dtype)
            used.append(pieces)
            engine = served(model_dir, cuda_plan(pieces, dtype), dtype)
            splits = split and engine.plan.graphs  # split-KV runs in the graphed plan's bucketed passes only
            plan = dataclasses.replace(cuda_plan(pieces, dtype), split_kv="on")
            live_decoder_requests(engine, served(model_dir, plan, dtype) if splits else engine)
    for dtype in (torch.bfloat16, torch.float32) if hstu_dir is not None else ():
        pieces = pieces_for("hstu", dtype)
        used.append(pieces)
        live_ranker_requests(served(hstu_dir, cuda_plan(pieces, dtype), dtype))
    return used


def entries(pieces: fused.Pieces) -> dict[str, int]:
    return {f.name: getattr(pieces, f.name).entries for f in dataclasses.fields(pieces)}


def test_every_engine_of_a_process_stays_within_the_recompile_limit(tiny_dir, wider_dir, hstu_dir):
    fused.compiled.cache_clear()
    used = run_every_engine(
        lambda name, dtype: fused.compiled("eager", f"{dtype} {name}"), tiny_dir, wider_dir, hstu_dir
    )
    counts = [entries(p) for p in used]
    assert max(max(c.values()) for c in counts) <= LIMIT - HEADROOM, counts
    assert sum(sum(c.values()) for c in counts) > len(used)  # the pieces did compile, some more than once
    fallbacks = [getattr(p, f.name).fallbacks for p in used for f in dataclasses.fields(p)]
    assert sum(fallbacks) == 0


def test_pieces_shared_by_every_engine_meet_the_limit_and_fall_back_without_failing(tiny_dir, wider_dir):
    """The planted defect: one set of pieces for every engine of the process (the code before the fix): two model
    sizes in two dtypes are enough for a piece to reach the limit. Each call past it runs the plain function: every
    request above still got its answer."""
    fused.compiled.cache_clear()
    shared = fused.compiled("eager", "shared")
    run_every_engine(lambda name, dtype: shared, tiny_dir, wider_dir, split=False)
    assert max(entries(shared).values()) >= LIMIT - 1
    assert sum(getattr(shared, f.name).fallbacks for f in dataclasses.fields(shared)) > 0
