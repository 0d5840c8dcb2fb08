"""The Engine: retrieve, score and recommend on our Qwen3 forward pass. No Ray in here.

The synchronous methods run a batch of requests to completion. The pieces they are built from
(prepare, prefill, start_beams, decode_step, *_result) are what the AsyncEngine's loop interleaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from genrec.api import (
    CandidateScore,
    RecommendedItem,
    RecommendRequest,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
    ScoredItem,
    ScoreRequest,
    ScoreResult,
)
from genrec.catalog import Catalog, CodeTrie
from genrec.engine.beam import BeamCohort
from genrec.engine.checks import check_int
from genrec.engine.decode import decode_step
from genrec.engine.prepared import Prepared, check_kind, prepare
from genrec.engine.scoring import LabelScores, ScoreJob, score_jobs
from genrec.engine.soft_token import inject_user_embedding
from genrec.errors import InvalidRequestError
from genrec.model import ContextKV, Qwen3, load_qwen3
from genrec.model.directory import ModelDirectory
from genrec.model.kv_pool import KVPool
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import USER_TOKEN, check_token_ids, load_tokenizer, semantic_token_ranges
from genrec.staging import fetch, host_side, to_device


@dataclass
class Prefilled:
    """A request's prompt after prefill: its ContextKV and the logits at its last position."""

    ctx: ContextKV
    last_logits: torch.Tensor  # [vocab] float32

    @property
    def prompt_tokens(self) -> int:
        return self.ctx.length


class Engine:
    """Retrieve, score and recommend on one model. One caller at a time (the AsyncEngine serialises)."""

    def __init__(
        self,
        model: Qwen3,
        tokenizer,
        catalog: Catalog,
        projector: SoftTokenProjector | None = None,
        max_candidates: int = 2048,
        score_max_tokens: int = 16384,
        prefill_pack_tokens: int = 8192,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.catalog = catalog
        self.device = model.device
        self.trie = CodeTrie.build(catalog.codes, device=self.device)
        self.projector = projector.to(self.device, model.dtype) if projector is not None else None
        vocab = tokenizer.get_vocab()
        self.placeholder_id = vocab.get(USER_TOKEN)
        self.max_candidates = check_int("max_candidates", max_candidates)
        self.score_max_tokens = check_int("score_max_tokens", score_max_tokens)
        self.prefill_pack_tokens = check_int("prefill_pack_tokens", prefill_pack_tokens)
        # Room for the generated code after the prompt.
        self.max_prompt_tokens = model.config.prompt_room(catalog.levels)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None, **options
    ):
        directory = ModelDirectory(model_dir)
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        tokenizer = load_tokenizer(directory.path)
        check_token_ids(tokenizer, directory.config.vocab_size, directory.path)
        catalog = Catalog.load(directory.catalog_path, semantic_token_ranges(tokenizer))
        model = load_qwen3(directory.path, device=device, dtype=dtype)
        projector = None
        if directory.soft_token_path.exists():
            projector = SoftTokenProjector.load(directory.soft_token_path, model.config.hidden_size)
        return cls(model, tokenizer, catalog, projector, **options)

    # -- batch API -------------------------------------------------------------------------------

    @torch.inference_mode()
    def retrieve(self, requests: list[RetrieveRequest]) -> list[RetrieveResult]:
        prepared = self._prepare_all(requests, "retrieve")
        if not prepared:
            return []
        prefilled = self.prefill_many(prepared)
        return self._run_beams(prepared, prefilled)

    @torch.inference_mode()
    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Each request's candidates in one pass over its single prefill."""
        prepared = self._prepare_all(requests, "score")
        prefilled = self.prefill_many(prepared)
        scores = self.score_many([self.score_job(p, f) for p, f in zip(prepared, prefilled, strict=True)])
        return [self.score_result(p, f, s) for p, f, s in zip(prepared, prefilled, scores, strict=True)]

    @torch.inference_mode()
    def recommend(self, requests: list[RecommendRequest]) -> list[RecommendResult]:
        """Beam search, then score the retrieved items plus the given candidates against the same ContextKV."""
        prepared = self._prepare_all(requests, "recommend")
        if not prepared:
            return []
        prefilled = self.prefill_many(prepared)
        retrieved = self._run_beams(prepared, prefilled)
        jobs = [self.score_job(p, f, r) for p, f, r in zip(prepared, prefilled, retrieved, strict=True)]
        scores = self.score_many(jobs)
        return [self.recommend_result(p, r, s) for p, r, s in zip(prepared, retrieved, scores, strict=True)]

    def _run_beams(self, prepared, prefilled) -> list[RetrieveResult]:
        cohort = self.start_beams(prepared, prefilled)
        while not cohort.done:
            decode_step(self.model, [cohort])
        return self.retrieve_results(prepared, prefilled, cohort)

    def _prepare_all(self, requests, kind: str) -> list[Prepared]:
        """Every request checked (its kind, then its content) before any compute."""
        if not isinstance(requests, list | tuple):
            raise InvalidRequestError("requests", f"expected a list of requests, got {type(requests).__name__}")
        for request in requests:
            check_kind(request, kind)
        return [self.prepare(r) for r in requests]

    # -- pieces ----------------------------------------------------------------------------------

    def prepare(self, req) -> Prepared:
        with host_side():  # request checks on host data, before any device work
            return prepare(self, req)

    @torch.inference_mode()
    def prompt_embeds(self, prepared: Prepared) -> torch.Tensor:
        """Token embeddings of the prompt, with the soft token injected where the request carries one."""
        embeds = self.model.embed(to_device(prepared.token_ids.numpy(), self.device))
        req = prepared.request
        return inject_user_embedding(
            embeds, prepared.token_ids, self.placeholder_id, req.user_embedding, self.projector
        )

    def allocate_context(self, prepared: Prepared) -> ContextKV:
        return ContextKV.allocate(self.model.config, len(prepared.token_ids), self.device, self.model.dtype)

    def new_pool(self, tokens: int) -> KVPool:
        return KVPool(self.model.config, tokens, self.device, self.model.dtype)

    @torch.inference_mode()
    def prefill(self, prepared: Prepared) -> Prefilled:
        ctx = self.allocate_context(prepared)
        logits = self.model.prefill(self.prompt_embeds(prepared), ctx)
        return Prefilled(ctx, logits[0])

    @torch.inference_mode()
    def prefill_many(self, prepared: list[Prepared]) -> list[Prefilled]:
        """Prefill many prompts, packed into passes of at most `prefill_pack_tokens` tokens, into one pool."""
        out: list[Prefilled] = []
        lengths = [len(p.token_ids) for p in prepared]
        pool = self.new_pool(sum(lengths))
        for group in _packs(lengths, self.prefill_pack_tokens):
            segments = [(self.prompt_embeds(prepared[i]), pool.context(lengths[i])) for i in group]
            logits = self.model.prefill_packed(segments)
            out += [Prefilled(ctx, row) for (_, ctx), row in zip(segments, logits, strict=True)]
        return out

    @torch.inference_mode()
    def start_beams(self, prepared: list[Prepared], prefilled: list[Prefilled], slots=None) -> BeamCohort:
        """A cohort of beam requests, with the first level already chosen from their prefill logits.
        `slots`: a KV-pool extent for the cohort's BeamKV (the scheduler's); else the cohort allocates it."""
        exclusions = [np.asarray(p.exclusions, dtype=np.int64) for p in prepared]
        widths = [p.request.beam_width for p in prepared]
        cohort = BeamCohort(self.trie, widths, [f.ctx for f in prefilled], exclusions, self.device, slots)
        cohort.select(torch.log_softmax(torch.stack([f.last_logits for f in prefilled]), dim=-1))
        return cohort

    @torch.inference_mode()
    def score_many(self, jobs: list[ScoreJob]) -> list[LabelScores]:
        """The candidates of many requests, in passes of at most `score_max_tokens` padded tokens."""
        return score_jobs(self.model, jobs, self.score_max_tokens)

    def score_job(self, prepared: Prepared, prefilled: Prefilled, retrieved: RetrieveResult | None = None):
        """Rows to score: the retrieved items (recommend), then the given candidates not among them."""
        if retrieved is None:
            return ScoreJob(prefilled.ctx, prepared.candidates, prepared.labels)
        given = [prepared.candidates[k] for k in _not_retrieved(prepared, retrieved)]
        tokens = [i.semantic_id for i in retrieved.items] + given
        if prepared.request.rank_by != "joint" or not given:
            return ScoreJob(prefilled.ctx, tokens, prepared.labels)
        # Joint ranking needs the given candidates' code logprob (the retrieved ones have theirs from the beam).
        prompt_logprobs = torch.log_softmax(prefilled.last_logits.float(), dim=-1)
        return ScoreJob(prefilled.ctx, tokens, prepared.labels, len(retrieved.items), prompt_logprobs)

    # -- results ---------------------------------------------------------------------------------

    def retrieve_results(self, prepared, prefilled, cohort: BeamCohort, host=None) -> list[RetrieveResult]:
        out = []
        for p, f, beams in zip(prepared, prefilled, cohort.results(host), strict=True):
            _check_finite([s for _, s in beams])
            items = [
                ScoredItem(item_id=self.catalog.item_ids[i], semantic_id=self.catalog.codes[i].tolist(), logprob=s)
                for i, s in beams[: p.request.num_results]
            ]
            out.append(
                RetrieveResult(
                    request_id=p.request.request_id,
                    items=items,
                    prompt_tokens=f.prompt_tokens,
                    unknown_exclusions=p.unknown_exclusions,
                )
            )
        return out

    def score_result(self, prepared: Prepared, prefilled: Prefilled, scores: LabelScores) -> ScoreResult:
        logprobs, probs, _ = _fetch_scores(scores)
        items = [
            CandidateScore(item_id=c.item_id, logprob=lp, prob=pr)
            for c, lp, pr in zip(prepared.request.candidates, logprobs, probs, strict=True)
        ]
        return ScoreResult(request_id=prepared.request.request_id, scores=items, prompt_tokens=prefilled.prompt_tokens)

    def recommend_result(self, prepared: Prepared, retrieved: RetrieveResult, scores: LabelScores) -> RecommendResult:
        offset = len(retrieved.items)
        logprobs, probs, sequence = _fetch_scores(scores)
        # The given rows carry a sequence logprob exactly when the job asked for one (see score_job).
        joint = prepared.request.rank_by == "joint"
        given_code = _check_finite(sequence[offset:]) if joint else [None] * (len(sequence) - offset)
        given_ids = {c.item_id for c in prepared.given if c.item_id is not None}
        items = [
            RecommendedItem(
                item_id=i.item_id,
                semantic_id=i.semantic_id,
                retrieval_logprob=i.logprob,
                code_logprob=i.logprob,
                score_logprob=lp,
                prob=pr,
                source="retrieved+given" if i.item_id in given_ids else "retrieved",
            )
            for i, lp, pr in zip(retrieved.items, logprobs, probs, strict=False)
        ]
        given = [prepared.given[k] for k in _not_retrieved(prepared, retrieved)]
        for cand, lp, pr, code_lp in zip(given, logprobs[offset:], probs[offset:], given_code, strict=True):
            code = self.catalog.codes[self.catalog.index_of(cand.item_id)].tolist() if cand.item_id else None
            items.append(
                RecommendedItem(
                    item_id=cand.item_id,
                    semantic_id=code,
                    code_logprob=code_lp,
                    score_logprob=lp,
                    prob=pr,
                    source="given",
                )
            )
        items.sort(key=_rank_key(prepared.request), reverse=True)
        return RecommendResult(
            request_id=prepared.request.request_id,
            items=items,
            prompt_tokens=retrieved.prompt_tokens,
            unknown_exclusions=retrieved.unknown_exclusions,
        )


def _rank_key(request: RecommendRequest):
    if request.rank_by == "joint":
        weight = request.score_weight
        return lambda item: item.code_logprob + weight * item.score_logprob
    return lambda item: item.score_logprob


def _not_retrieved(prepared: Prepared, retrieved: RetrieveResult) -> list[int]:
    """Indices of the given candidates that beam search did not already find (those are ranked once)."""
    found = {i.item_id for i in retrieved.items}
    return [k for k, c in enumerate(prepared.given) if c.item_id is None or c.item_id not in found]


def _fetch_scores(scores: LabelScores) -> tuple[list[float], list[float], list[float]]:
    """A request's label scores (checked finite) and sequence logprobs (NaN where not asked for: the caller
    checks the rows it asked for) on the host: the end of the request, one named fetch."""
    host = fetch(torch.stack((scores.logprob.double(), scores.prob.double(), scores.sequence.double())))
    return _check_finite(host[0].tolist()), _check_finite(host[1].tolist()), host[2].tolist()


def _check_finite(values: list[float]) -> list[float]:
    """No result carries a NaN or infinite score: the request fails instead (host values: no device sync)."""
    if not all(map(math.isfinite, values)):
        raise InvalidRequestError(
            "request", "the model's scores for this request are not finite (e.g. a user_embedding too large)"
        )
    return values


def _packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices whose lengths sum to at most `budget` (a longer one goes alone)."""
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups
