"""The Engine: retrieval (constrained beam search) on our Qwen3 forward pass. No Ray in here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
from genrec.engine.candidates import candidate_token_lists, label_token_ids
from genrec.engine.prompts import prompt_token_ids
from genrec.engine.scoring import ScoreJob, score_jobs
from genrec.engine.soft_token import inject_user_embedding
from genrec.model import ContextKV, Qwen3, load_qwen3
from genrec.model.directory import ModelDirectory
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import USER_TOKEN, load_tokenizer, semantic_token_ranges


@dataclass
class Prefilled:
    """A request's prompt after prefill: its ContextKV and the logits at its last position."""

    token_ids: torch.Tensor
    ctx: ContextKV
    last_logits: torch.Tensor  # [vocab] float32


class Engine:
    """Retrieve, score and recommend on one model. Thread-compatible, not thread-safe: one caller at a time."""

    def __init__(
        self,
        model: Qwen3,
        tokenizer,
        catalog: Catalog,
        projector: SoftTokenProjector | None = None,
        max_candidates: int = 2048,
        score_max_tokens: int = 16384,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.catalog = catalog
        self.device = model.device
        self.trie = CodeTrie.build(catalog.codes, device=self.device)
        self.projector = projector.to(self.device, model.dtype) if projector is not None else None
        self.placeholder_id = (
            tokenizer.convert_tokens_to_ids(USER_TOKEN) if USER_TOKEN in tokenizer.get_vocab() else None
        )
        self.max_candidates = max_candidates
        self.score_max_tokens = score_max_tokens
        # Room for the generated code after the prompt.
        self.max_prompt_tokens = model.config.max_position_embeddings - catalog.levels

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
        catalog = Catalog.load(directory.catalog_path, semantic_token_ranges(tokenizer))
        model = load_qwen3(directory.path, device=device, dtype=dtype)
        projector = None
        if directory.soft_token_path.exists():
            projector = SoftTokenProjector.load(directory.soft_token_path, model.config.hidden_size)
        return cls(model, tokenizer, catalog, projector, **options)

    # -- prompts ---------------------------------------------------------------------------------

    def encode(self, req) -> torch.Tensor:
        return prompt_token_ids(req, self.tokenizer, self.model.config.vocab_size, self.max_prompt_tokens)

    @torch.inference_mode()
    def prompt_embeds(self, req, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of the prompt, with the soft token injected where the request carries one."""
        embeds = self.model.embed(token_ids.to(self.device))
        return inject_user_embedding(embeds, token_ids, self.placeholder_id, req.user_embedding, self.projector)

    @torch.inference_mode()
    def prefill(self, req, token_ids: torch.Tensor | None = None) -> Prefilled:
        token_ids = self.encode(req) if token_ids is None else token_ids
        embeds = self.prompt_embeds(req, token_ids)
        ctx = ContextKV.allocate(self.model.config, len(token_ids), self.device, self.model.dtype)
        logits = self.model.prefill(embeds, ctx)
        return Prefilled(token_ids, ctx, logits[0])

    # -- retrieval -------------------------------------------------------------------------------

    @torch.inference_mode()
    def retrieve(self, requests: list[RetrieveRequest]) -> list[RetrieveResult]:
        if not requests:
            return []
        token_ids = [self.encode(req) for req in requests]  # validate every request before any compute
        prefilled = [self.prefill(req, t) for req, t in zip(requests, token_ids, strict=True)]
        return self.retrieve_prefilled(requests, prefilled)

    @torch.inference_mode()
    def retrieve_prefilled(self, requests: list[RetrieveRequest], prefilled: list[Prefilled]):
        exclusions, unknown = zip(*(self._exclusions(req) for req in requests), strict=True)
        cohort = BeamCohort(
            self.trie, [r.beam_width for r in requests], [p.ctx for p in prefilled], list(exclusions), self.device
        )
        cohort.select(torch.log_softmax(torch.stack([p.last_logits for p in prefilled]), dim=-1))
        while not cohort.done:
            self.decode_pass(cohort)
        return [
            self._retrieve_result(req, beams, len(p.token_ids), n_unknown)
            for req, beams, p, n_unknown in zip(requests, cohort.results(), prefilled, unknown, strict=True)
        ]

    def decode_pass(self, cohort: BeamCohort) -> None:
        tokens, positions, groups, past_k, past_v = cohort.decode_inputs()
        hidden, new_k, new_v = self.model.forward_rows(self.model.embed(tokens), positions, groups, past_k, past_v)
        cohort.record_kv(new_k, new_v)
        cohort.select(torch.log_softmax(self.model.logits(hidden[:, -1]), dim=-1))

    # -- scoring ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Each request's candidates in one pass over its single prefill (validated before any compute)."""
        token_ids = [self.encode(req) for req in requests]
        jobs_inputs = [self._score_inputs(req, len(t)) for req, t in zip(requests, token_ids, strict=True)]
        prefilled = [self.prefill(req, t) for req, t in zip(requests, token_ids, strict=True)]
        jobs = [ScoreJob(p.ctx, cands, labels) for p, (cands, labels) in zip(prefilled, jobs_inputs, strict=True)]
        results = []
        for req, p, scores in zip(
            requests, prefilled, score_jobs(self.model, jobs, self.score_max_tokens), strict=True
        ):
            logprobs, probs = scores.logprob.tolist(), scores.prob.tolist()
            items = [
                CandidateScore(item_id=c.item_id, logprob=lp, prob=pr)
                for c, lp, pr in zip(req.candidates, logprobs, probs, strict=True)
            ]
            results.append(ScoreResult(request_id=req.request_id, scores=items, prompt_tokens=len(p.token_ids)))
        return results

    def _score_inputs(self, req, prompt_tokens: int):
        return candidate_token_lists(self, req.candidates, prompt_tokens), label_token_ids(self.tokenizer, req.labels)

    # -- retrieve, then rank on the same prefill --------------------------------------------------

    @torch.inference_mode()
    def recommend(self, requests: list[RecommendRequest]) -> list[RecommendResult]:
        """Beam search, then score the retrieved items plus the given candidates against the same ContextKV."""
        token_ids = [self.encode(req) for req in requests]
        given = [self._score_inputs(req, len(t)) for req, t in zip(requests, token_ids, strict=True)]
        prefilled = [self.prefill(req, t) for req, t in zip(requests, token_ids, strict=True)]
        retrieved = self.retrieve_prefilled(requests, prefilled)
        jobs = [
            ScoreJob(p.ctx, [i.semantic_id for i in r.items] + cands, labels)
            for p, r, (cands, labels) in zip(prefilled, retrieved, given, strict=True)
        ]
        scored = score_jobs(self.model, jobs, self.score_max_tokens)
        return [self._recommend_result(req, r, s) for req, r, s in zip(requests, retrieved, scored, strict=True)]

    def _recommend_result(self, req: RecommendRequest, retrieved: RetrieveResult, scores) -> RecommendResult:
        logprobs, probs = scores.logprob.tolist(), scores.prob.tolist()
        items = [
            RecommendedItem(
                item_id=i.item_id,
                semantic_id=i.semantic_id,
                retrieval_logprob=i.logprob,
                score_logprob=lp,
                prob=pr,
                source="retrieved",
            )
            for i, lp, pr in zip(retrieved.items, logprobs, probs, strict=False)
        ]
        offset = len(retrieved.items)
        for cand, lp, pr in zip(req.candidates, logprobs[offset:], probs[offset:], strict=True):
            code = self.catalog.codes[self.catalog.index_of(cand.item_id)].tolist() if cand.item_id else None
            items.append(
                RecommendedItem(item_id=cand.item_id, semantic_id=code, score_logprob=lp, prob=pr, source="given")
            )
        items.sort(key=lambda item: item.score_logprob, reverse=True)
        return RecommendResult(
            request_id=req.request_id,
            items=items,
            prompt_tokens=retrieved.prompt_tokens,
            unknown_exclusions=retrieved.unknown_exclusions,
        )

    def _exclusions(self, req: RetrieveRequest) -> tuple[torch.Tensor, int]:
        known = [i for i in map(self.catalog.index_of, req.exclude_item_ids) if i is not None]
        unknown = len(req.exclude_item_ids) - len(known)
        return torch.tensor(sorted(set(known)), dtype=torch.int64, device=self.device), unknown

    def _retrieve_result(self, req, beams, prompt_tokens, unknown) -> RetrieveResult:
        items = [
            ScoredItem(item_id=self.catalog.item_ids[i], semantic_id=self.catalog.codes[i].tolist(), logprob=score)
            for i, score in beams[: req.num_results]
        ]
        return RetrieveResult(
            request_id=req.request_id, items=items, prompt_tokens=prompt_tokens, unknown_exclusions=unknown
        )
