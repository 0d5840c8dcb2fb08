"""The Engine: retrieval (constrained beam search) on our Qwen3 forward pass. No Ray in here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from genrec.api import RetrieveRequest, RetrieveResult, ScoredItem
from genrec.catalog import Catalog, CodeTrie
from genrec.engine.beam import BeamCohort
from genrec.engine.prompts import prompt_token_ids
from genrec.errors import InvalidRequestError
from genrec.model import ContextKV, Qwen3, load_qwen3
from genrec.model.directory import ModelDirectory
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import load_tokenizer, semantic_token_ranges


@dataclass
class Prefilled:
    """A request's prompt after prefill: its ContextKV and the logits at its last position."""

    token_ids: torch.Tensor
    ctx: ContextKV
    last_logits: torch.Tensor  # [vocab] float32


class Engine:
    def __init__(self, model: Qwen3, tokenizer, catalog: Catalog, projector: SoftTokenProjector | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.catalog = catalog
        self.device = model.device
        self.trie = CodeTrie.build(catalog.codes, device=self.device)
        self.projector = projector.to(self.device, model.dtype) if projector is not None else None
        # Room for the generated code after the prompt.
        self.max_prompt_tokens = model.config.max_position_embeddings - catalog.levels

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None):
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
        return cls(model, tokenizer, catalog, projector)

    # -- prompts ---------------------------------------------------------------------------------

    def encode(self, req) -> torch.Tensor:
        return prompt_token_ids(req, self.tokenizer, self.model.config.vocab_size, self.max_prompt_tokens)

    def prompt_embeds(self, req, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_ids.to(self.device))

    @torch.inference_mode()
    def prefill(self, req) -> Prefilled:
        token_ids = self.encode(req)
        ctx = ContextKV.allocate(self.model.config, len(token_ids), self.device, self.model.dtype)
        logits = self.model.prefill(self.prompt_embeds(req, token_ids), ctx)
        return Prefilled(token_ids, ctx, logits[0])

    # -- retrieval -------------------------------------------------------------------------------

    @torch.inference_mode()
    def retrieve(self, requests: list[RetrieveRequest]) -> list[RetrieveResult]:
        if not requests:
            return []
        prefilled = [self.prefill(req) for req in requests]
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


def require(condition: bool, field: str, problem: str) -> None:
    if not condition:
        raise InvalidRequestError(field, problem)
