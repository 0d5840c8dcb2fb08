"""The retriever: the Qwen3 semantic-ID decoder as an engine family (retrieve, score, recommend). After the prompt's
prefill, beam search over the catalog trie (genrec.engine.beam), then, for score and a scoring recommend, candidate
rows in bounded passes (genrec.engine.scoring); results built on the host after one fetch (docs/engine.md, 'How a
request runs')."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genrec.api import (
    FAMILY_KINDS,
    MAX_BEAM_WIDTH,
    Candidate,
    Filtered,
    PromptForms,
    PromptResult,
    RecommendResult,
    RetrieveRequest,
    RetrieveResult,
    ScoreRequest,
)
from genrec.catalog import Catalog, CodeTrie
from genrec.engine import results
from genrec.engine.beam import start_cohort
from genrec.engine.job import JobState, Prepared
from genrec.engine.prefill_graphs import PrefillGraphs
from genrec.engine.prefix_cache import Scope, block_keys
from genrec.engine.request_tokens import (
    candidate_token_lists,
    check_user_embedding,
    inject_user_embedding,
    label_token_ids,
    prompt_token_ids,
    render_prompt,
)
from genrec.engine.scoring import LabelScores, Scorer, candidate_rows
from genrec.engine.served_catalog import FILTER_CACHE_BYTES, CatalogVersions, FilterMask, ServedCatalog
from genrec.errors import InvalidRequestError
from genrec.model.ops import PLAIN_OPS, ModelOps
from genrec.model.sid_layout import SidLayout
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import USER_TOKEN, ChatTemplate
from genrec.staging import to_device


@dataclass
class PreparedPrompt(Prepared):
    served: ServedCatalog | None = None  # the catalog version the request runs against, start to end
    candidate_tokens: list[list[int]] | None = None  # the given candidates' token lists (score, recommend)
    given: list[Candidate] | None = None  # the candidates those lists are of (recommend: after exclusions)
    labels: tuple[int, int] | None = None
    exclusions: list[int] | None = None  # catalog indices (retrieve, recommend)
    unknown_exclusions: int = 0
    filter: FilterMask | None = None  # the items its filters allow (None: no filter), from `served`'s cache
    filtered_out: int = 0  # score: given candidates the filter does not allow (left out)

    @property
    def uses_beams(self) -> bool:
        return self.kind in ("retrieve", "recommend")

    @property
    def in_beam_order(self) -> bool:
        """A recommend that scores nothing (rank_by 'beam'): its result is its beams and the given items kept."""
        return self.kind == "recommend" and self.request.rank_by == "beam"


class Retriever:
    name = "qwen3"
    kinds = FAMILY_KINDS["qwen3"]

    def __init__(
        self,
        model,
        tokenizer,
        catalog: Catalog,
        projector: SoftTokenProjector | None = None,
        layout: SidLayout | None = None,
        max_candidates: int = 2048,
        score_max_tokens: int = 16384,
        max_candidate_tokens: int = 65536,
        max_candidate_len: int | None = None,
        ops: ModelOps = PLAIN_OPS,
        chat: ChatTemplate | None = None,
        filter_cache_bytes: int = FILTER_CACHE_BYTES,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.chat = chat if chat is not None else ChatTemplate(tokenizer)  # renders `messages` prompts
        self.device = model.device
        self.projector = projector.to(self.device, model.dtype) if projector is not None else None
        self.max_candidates = max_candidates
        self.score_max_tokens = score_max_tokens  # one scoring pass, in token-equivalents (its estimated cost)
        self.max_candidate_tokens = max_candidate_tokens  # one request's candidates in all
        self.ops = ops  # the engine's execution plan's (genrec.engine.plan)
        self.layout = layout if layout is not None else SidLayout.infer(tokenizer)
        first = ServedCatalog.build(catalog, self.layout, self.device, filter_cache_bytes)
        self.levels = first.trie.levels  # decode steps: the longest code and its ending (what a later catalog may take)
        # A node's children: one per code of the next level, and a pad where a shorter code ended (catalog/trie.py).
        self.max_children = max(max(self.layout.level_sizes, default=0) + 1, *first.trie.max_children)
        self.catalogs = CatalogVersions(first, self.layout, self.device, max_steps=self.levels)
        self.begin = self.layout.begin
        self.placeholder_id = tokenizer.get_vocab().get(USER_TOKEN)
        # Room for the code after the prompt, and for the begin token the engine may append.
        self.max_prompt_tokens = model.config.prompt_room(self.levels + (self.begin is not None))
        self.scorer = Scorer(model, ops)
        self.cost = self.scorer.cost  # what a pass costs: the scheduler bounds prefill chunks with it too
        # One candidate's tokens; by default the longest row one scoring pass holds alone (at least an item's code).
        longest = max(self.cost.longest_row(score_max_tokens), self.levels + (self.begin is not None))
        self.max_candidate_len = longest if max_candidate_len is None else max_candidate_len

    @classmethod
    def from_dir(cls, directory, device, dtype, **limits) -> Retriever:
        """A Qwen3 model directory (`genrec.model.directory.Qwen3Dir`) loaded onto the device."""
        tokenizer = directory.load_tokenizer()
        layout = directory.load_sid_layout(tokenizer)
        catalog = directory.load_catalog(tokenizer, layout)
        model = directory.load_model(device, dtype)
        chat = directory.load_chat(tokenizer)
        return cls(model, tokenizer, catalog, directory.load_projector(), layout, chat=chat, **limits)

    @property
    def catalog(self) -> Catalog:
        """The catalog served now (a request keeps the one it was prepared with: `PreparedPrompt.served`)."""
        return self.catalogs.current.catalog

    @property
    def trie(self) -> CodeTrie:
        return self.catalogs.current.trie

    # -- requests --------------------------------------------------------------------------------

    def prepare(self, req, kind: str) -> PreparedPrompt:
        served = self.catalogs.current  # read once: the request's version from here to its result
        token_ids = prompt_token_ids(req, self.chat, self.model.config.vocab_size, self.max_prompt_tokens)
        check_user_embedding(token_ids, self.placeholder_id, req.user_embedding, self.projector)
        if kind in ("retrieve", "recommend") and not self._begun(token_ids):
            token_ids = torch.cat((token_ids, torch.tensor([self.begin])))  # the code's begin token, forced
        prepared = PreparedPrompt(req, kind, token_ids, served=served)
        catalog = served.catalog
        if isinstance(req, RetrieveRequest):
            self._check_beam_widths(req.beam_widths, catalog)
            known = [i for i in map(catalog.index_of, req.exclude_item_ids) if i is not None]
            prepared.exclusions = sorted(set(known))
            prepared.unknown_exclusions = len(req.exclude_item_ids) - len(known)
        if isinstance(req, Filtered):
            prepared.filter = served.filters.get(req)  # compiled on a miss (InvalidRequestError naming the field)
        if kind in ("score", "recommend"):
            begun = self._begun(token_ids)
            tokens = candidate_token_lists(self, catalog, req.candidates, len(token_ids), begun)  # each one checked
            keep = self._given(catalog, req.candidates, prepared)
            prepared.given = req.candidates if keep is None else [req.candidates[k] for k in keep]
            if not prepared.in_beam_order:  # else no row is scored: the candidates checked and kept only
                prepared.candidate_tokens = tokens if keep is None else [tokens[k] for k in keep]
                prepared.labels = label_token_ids(self.tokenizer, req.labels or self.layout.labels)
        prepared.kv_tokens = self._kv_tokens(prepared)
        return prepared

    @staticmethod
    def _check_beam_widths(widths: list[int] | None, catalog: Catalog) -> None:
        """One width per code level (the layout's ending steps keep the last width, genrec.engine.beam)."""
        if widths is not None and len(widths) != catalog.levels:
            raise InvalidRequestError(
                "beam_widths",
                f"has {len(widths)} widths; this catalog's codes have {catalog.levels} levels (one width each)",
            )

    def render_prompt(self, req: PromptForms) -> PromptResult:
        """The request's prompt as `prepare` runs it (its text and token IDs), checked the same way."""
        if not isinstance(req, PromptForms):
            raise InvalidRequestError("request", f"expected a PromptRequest, got {type(req).__name__}")
        vocab_size = self.model.config.vocab_size
        return render_prompt(req, self.chat, vocab_size, self.max_prompt_tokens, self.placeholder_id, self.begin)

    def _begun(self, token_ids: torch.Tensor) -> bool:
        """Whether a code may follow these tokens as they are: the layout has no begin token, or they end with it."""
        return self.begin is None or int(token_ids[-1]) == self.begin

    def item_row(self, catalog: Catalog, index: int, begun: bool) -> list[int]:
        """Catalog item `index` as a scoring row: its code and ending, as beam search generates them (so its sequence
        log-probability is its beam logprob); after the begin token when the prompt does not end with it."""
        row = [*catalog.code(index), *self.layout.ending]
        return row if begun else [self.begin, *row]

    def _given(self, catalog: Catalog, candidates: list[Candidate], prepared: PreparedPrompt) -> list[int] | None:
        """Indices of the given candidates a score or recommend runs (None: all); with a filter, only catalog items,
        those it does not allow left out (docs/engine.md, 'Filters')."""
        allowed = prepared.filter
        if allowed is not None:
            for k, cand in enumerate(candidates):
                if cand.item_id is None:
                    problem = "with filters, candidates must be catalog items (item_id), not text or tokens"
                    raise InvalidRequestError(f"candidates[{k}]", problem)
        if prepared.kind == "recommend":
            return self._kept(catalog, candidates, prepared.exclusions, allowed)
        if allowed is None:
            return None
        keep = [k for k, cand in enumerate(candidates) if allowed.items[catalog.index_of(cand.item_id)]]
        prepared.filtered_out = len(candidates) - len(keep)
        return keep

    @staticmethod
    def _kept(catalog: Catalog, candidates: list[Candidate], exclusions: list[int], allowed: FilterMask | None):
        """Recommend's given candidates, in order: none excluded or filtered out, each item once. The one rule,
        whatever ranks them next (the label, or a two-stage recommend's ranker, online and nightly)."""
        skip, keep = set(exclusions), []
        for k, cand in enumerate(candidates):
            if cand.item_id is not None:
                index = catalog.index_of(cand.item_id)
                if index in skip or (allowed is not None and not allowed.items[index]):
                    continue
                skip.add(index)
            keep.append(k)
        return keep

    def _kv_tokens(self, prepared: PreparedPrompt) -> int:
        """Token-equivalents of KV the request holds at its peak: prompt, beam suffixes, candidate rows."""
        tokens = len(prepared.token_ids)
        if prepared.uses_beams:
            widest = max(prepared.request.beam_widths or [prepared.request.beam_width])  # the budget follows it
            tokens += widest * self.levels * 2  # BeamKV plus the gathered suffix of a pass
        if prepared.candidate_tokens is not None:
            tokens += sum(map(len, prepared.candidate_tokens))
            if prepared.kind == "recommend":
                tokens += prepared.request.num_results * self.levels  # a row per retrieved code
        return tokens

    def block_keys(self, prepared: PreparedPrompt, salt: bytes) -> list[bytes]:
        """Scoped by the request; a block holding the soft token is keyed with its embedding too."""
        request = prepared.request
        return block_keys(
            prepared.token_ids.numpy(), salt, self.placeholder_id, request.user_embedding, Scope.of(request)
        )

    # -- passes ----------------------------------------------------------------------------------

    def context_embeds(self, prepared: PreparedPrompt, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Prompt tokens [start, stop), the soft token injected where the request has one."""
        ids = prepared.token_ids[start:stop]
        embeds = self.model.embed(to_device(ids.numpy(), self.device))
        vector = prepared.request.user_embedding
        if vector is None:
            return embeds
        return inject_user_embedding(embeds, ids, self.placeholder_id, vector, self.projector)

    def prefill(self, segments: list, graphs=None) -> torch.Tensor:
        """The logits at each segment's last position [segments, vocab]."""
        return self.model.prefill_packed(segments, self.ops, graphs=graphs)

    def capture_prefill(self, session, max_tokens: int, pool) -> PrefillGraphs:
        """The prefill's stages captured per token bucket up to `max_tokens`, writing `pool` (prefill_graphs)."""
        return PrefillGraphs(self.model, self.ops.pieces, max_tokens, session, pool)

    def start(self, job) -> JobState:
        """A beam request starts its cohort (first level from the prompt's last logits); a score goes to its rows."""
        if not job.prepared.uses_beams:
            return JobState.SCORING
        trie = job.prepared.served.device_trie()  # the engine's thread: made here on a version's first use
        job.cohort = start_cohort(trie, [job.prepared], [job.ctx], job.last_logits[None], slots=job.holding.rest)
        return JobState.DECODING

    def decode_forward(self, batch):
        """One decode pass over a filled DecodeBatch: (gains [B, C]: the log-probabilities at its `columns`, new_k,
        new_v [layers, B, 1, KV, D])."""
        model, pool = self.model, batch.pool
        past = (pool.k, pool.v, batch.ancestors) if batch.past else None  # each row's ancestors, read in the pool
        embeds = model.embed(batch.tokens[:, None])
        hidden, new_k, new_v = model.forward_rows(
            embeds, batch.positions[:, None], batch.context, past, mask=batch.mask, ops=self.ops
        )
        return model.column_logprobs(hidden[:, -1], batch.columns, self.ops), new_k, new_v

    def generated(self, job, beams: list[tuple[int, float]]) -> RetrieveResult | RecommendResult | None:
        """A retrieve's result, or a recommend's in beam order; None: a scoring recommend keeps its beams to score."""
        result = results.retrieve_result(job.prepared, beams)
        if job.kind == "retrieve":
            return result
        if job.prepared.in_beam_order:
            return results.beam_order_result(job.prepared, result)
        job.retrieved = result
        return None

    def rows_pass(self, jobs: list, budget: int) -> None:
        """One scoring pass over the jobs' rows, in order, of at most `budget` token-equivalents (engine.pass_cost)."""
        for job in jobs:
            if job.work is None:
                rows, job.row_of_retrieved = self._retrieved_rows(job)
                job.work = candidate_rows(job.prepared, job.ctx, job.last_logits, job.retrieved, rows)
                job.scored = [LabelScores.empty(self.device)]
        views = [job.work.after(job.rows_done) for job in jobs]
        for k, scores in self.scorer.score_pass(views, budget):
            jobs[k].scored.append(scores)
            jobs[k].rows_done += len(scores)
        for job in jobs:
            if job.rows_done == len(job.work.candidates):
                scores = LabelScores.cat(job.scored)
                if job.kind == "score":
                    job.result = results.score_result(job.prepared, scores)
                else:
                    scores = scores.rows(self._row_of_each_item(job, len(scores)))
                    job.result = results.recommend_result(job.prepared, job.retrieved, scores)

    def _retrieved_rows(self, job) -> tuple[list[list[int]] | None, list[int] | None]:
        """A recommend's retrieved items as scoring rows over its context (which ends with the begin token): one row
        per code, as the items of a shared code (adjacent) score alike; and each item's row."""
        if job.retrieved is None:
            return None, None
        rows, row_of_item, items = [], [], job.retrieved.items
        catalog = job.prepared.served.catalog
        for k, item in enumerate(items):
            if not k or item.semantic_id != items[k - 1].semantic_id:
                rows.append(self.item_row(catalog, catalog.index_of(item.item_id), True))
            row_of_item.append(len(rows) - 1)
        return rows, row_of_item

    def _row_of_each_item(self, job, scored: int) -> torch.Tensor:
        """Scored rows -> one per item: each retrieved item's code row, then the given candidates' rows."""
        codes = job.row_of_retrieved[-1] + 1 if job.row_of_retrieved else 0
        return to_device(np.concatenate([job.row_of_retrieved, np.arange(codes, scored)]).astype(np.int64), self.device)

    def warmup_requests(self) -> list:
        """A retrieve and a score at two sizes (prompts shorter than a prefix-cache block: nothing is cached)."""
        token = int(self.tokenizer.encode("warm", add_special_tokens=False)[0])
        items = self.catalog.item_ids.tolist()
        out = []
        for size in (2, 3):
            prompt = [token] * min(4 * size, self.max_prompt_tokens)
            out.append(RetrieveRequest(prompt_token_ids=prompt, beam_width=min(size, len(items))))
            out.append(ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id=i) for i in items[:size]]))
        return out

    def describe(self) -> dict:
        served = self.catalogs.current
        return {
            "architecture": self.model.config.architecture,
            "catalog_items": len(served.catalog),
            **self.catalogs.describe(),
            "max_candidates": self.max_candidates,
            "levels": served.catalog.levels,
            "codes": served.trie.codes,
            "code_ending": self.layout.ending_kind,
            "max_beam_width": MAX_BEAM_WIDTH,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_candidate_len": self.max_candidate_len,
            "user_dim": self.projector.user_dim if self.projector is not None else None,
            "chat_template": self.chat.available,
        }
