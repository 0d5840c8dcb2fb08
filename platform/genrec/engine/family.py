"""The seam between the engine and a model family: all the engine, its scheduler and runner, and the servers use
(docs/design.md, 'One path for two families'). A job is prefilled into a `ContextKV`, then either generates
(`Generating`: beam search) or runs rows in bounded passes, then finishes. Implementations:
`genrec.engine.retriever.Retriever` (Qwen3: retrieve, score, recommend), `genrec.engine.ranker.Ranker` (HSTU: rank).
"""

from __future__ import annotations

from typing import Protocol

import torch

from genrec.api import (
    PromptForms,
    PromptResult,
    RankRequest,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
    ScoreRequest,
)
from genrec.catalog import Catalog
from genrec.catalog.catalog import ItemIndex
from genrec.engine.decode_batch import DecodeBatch
from genrec.engine.job import Job, JobState, Prepared
from genrec.engine.pass_cost import PassCost
from genrec.engine.prefill_graphs import PrefillGraphs
from genrec.engine.served_catalog import CatalogVersions
from genrec.errors import InvalidRequestError
from genrec.model.ops import ModelOps

# The request class of each kind, the most specific first (a RecommendRequest is also a RetrieveRequest).
KINDS = {"recommend": RecommendRequest, "retrieve": RetrieveRequest, "score": ScoreRequest, "rank": RankRequest}


def request_kind(request, expected: str | None = None) -> str:
    """The request's kind, checked once on its way in: one of KINDS, and `expected` when given (the entry for a
    kind takes exactly that kind: retrieve refuses a RecommendRequest, too)."""
    kind = next((k for k, cls in KINDS.items() if isinstance(request, cls)), None)
    if kind is None:
        names = ", ".join(cls.__name__ for cls in KINDS.values())
        raise InvalidRequestError("request", f"expected one of {names}, got {type(request).__name__}")
    if expected is not None and kind != expected:
        raise InvalidRequestError("request", f"expected {KINDS[expected].__name__}, got {type(request).__name__}")
    return kind


class Family(Protocol):
    """What both families implement."""

    name: str  # "qwen3" | "hstu"
    kinds: tuple[str, ...]  # the request kinds it answers
    model: torch.nn.Module  # its `config` has the KV shape (num_hidden_layers, num_key_value_heads, head_dim)
    ops: ModelOps  # what its passes run: the engine's execution plan's (genrec.engine.plan)
    catalog: Catalog | ItemIndex  # item IDs <-> what the model reads of them: codes, or embedding rows (served now)
    catalogs: CatalogVersions | None  # the catalog versions it serves, changed live; None: its catalog is fixed
    cost: PassCost  # what its passes cost in token-equivalents: rows passes and prefill chunks are bounded by it
    score_max_tokens: int  # the bound of one rows pass, in token-equivalents (`cost`)
    levels: int  # decode passes of the longest generation (0: it never generates)

    def prepare(self, request, kind: str) -> Prepared:
        """Check a request of one of `kinds` against the model; raise InvalidRequestError naming the field."""

    def render_prompt(self, request: PromptForms) -> PromptResult:
        """A request's prompt as `prepare` runs it, checked the same way (a family with no prompt refuses)."""

    def block_keys(self, prepared: Prepared, salt: bytes) -> list[bytes]:
        """The prefix cache's reusable block keys, under the request's scope (genrec.engine.prefix_cache)."""

    def context_embeds(self, prepared: Prepared, start: int, stop: int) -> torch.Tensor:
        """Input embeddings of context rows [start, stop) on the model's device."""

    def prefill(self, segments: list[tuple[torch.Tensor, object]], graphs=None) -> list[torch.Tensor | None]:
        """Each (embeds, ctx) at the positions after ctx.length, its K/V written into ctx, all in one pass: the output
        at each segment's last position, or None. `graphs`: `capture_prefill`'s, replayed where they hold the pass."""

    def capture_prefill(self, session, max_tokens: int, pool) -> PrefillGraphs | None:
        """The prefill captured as graphs up to `max_tokens` per pass (genrec.engine.prefill_graphs), writing the K/V
        of `pool` (the engine's), in the start-up capture session (genrec.engine.plan.CudaCapture), or None."""

    def start(self, job: Job) -> JobState:
        """A prefilled job's next state: DECODING (its beam cohort started; Generating only) or SCORING."""

    def rows_pass(self, jobs: list[Job], budget: int) -> None:
        """One pass of the jobs' next rows, in order, estimated (`cost`) at most `budget` token-equivalents unless
        its first row alone costs more; a job whose rows are all done gets its `result`."""

    def describe(self) -> dict:
        """What /v1/model says of this family's model (the other family's fields None)."""

    def warmup_requests(self) -> list:
        """Small requests of each kind it answers, in two sizes each: what an engine whose pieces compile (its execution
        plan's) runs before it is seen, so that they compile then (a piece recompiles once, for dynamic shapes, at
        the second size it sees), never on a live request."""


class Generating(Family, Protocol):
    """A family whose jobs generate before their rows (the Qwen3 decoder's beam search): `levels` > 0."""

    max_children: int  # the most children a node of any catalog it may serve has: a captured pass's columns

    def decode_forward(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode pass over a filled `DecodeBatch`: (gains [B, C]: the next token's log-probabilities at the
        batch's `columns` [B, C], new_k, new_v)."""

    def generated(self, job: Job, beams: list[tuple[int, float]]) -> RetrieveResult | RecommendResult | None:
        """A job whose generation finished (its beams fetched): its result (a retrieve's; a recommend's that scores
        nothing), or None if it goes on to rows (the beams kept on the job)."""
