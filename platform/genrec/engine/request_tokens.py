"""The Qwen3 decoder's request inputs (prompt, candidates, labels, soft token) as token IDs, checked against the
model before any compute; a problem is an InvalidRequestError naming the field (docs/engine.md, 'Prompt forms')."""

from __future__ import annotations

import torch

from genrec.api import Candidate, PromptForms, PromptResult
from genrec.errors import InvalidRequestError
from genrec.model.soft_token import SoftTokenProjector
from genrec.model.tokenizer import ChatTemplate
from genrec.staging import to_device

# No token of a real tokenizer spans more characters than this: text longer than limit x this cannot fit,
# and is refused before tokenizing it (tokenizing megabytes would stall every other request).
MAX_CHARS_PER_TOKEN = 64


def check_text_fits(field: str, text: str, max_tokens: int) -> None:
    if len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise InvalidRequestError(
            field, f"{len(text)} characters cannot fit in the {max_tokens} tokens left for it (refused untokenized)"
        )


def prompt_text(req: PromptForms, chat: ChatTemplate, max_len: int) -> str | None:
    """The text a `prompt` or `messages` request's prompt is (None for token IDs), refused untokenized when it
    cannot fit: the messages' contents before they are rendered, the rendered text after."""
    if req.prompt is not None:
        check_text_fits("prompt", req.prompt, max_len)
        return req.prompt
    if req.messages is None:
        return None
    if len(req.messages) > max_len:  # every template spends a token or more on each message
        raise InvalidRequestError("messages", f"{len(req.messages)} messages cannot fit in {max_len} tokens")
    check_text_fits("messages", "".join(m.content for m in req.messages), max_len)
    text = chat.render([m.model_dump() for m in req.messages])
    check_text_fits("messages", text, max_len)
    return text


def prompt_token_ids(req: PromptForms, chat: ChatTemplate, vocab_size: int, max_len: int) -> torch.Tensor:
    return rendered_prompt(req, chat, vocab_size, max_len)[1]


def rendered_prompt(
    req: PromptForms, chat: ChatTemplate, vocab_size: int, max_len: int
) -> tuple[str | None, torch.Tensor]:
    """(the prompt's text, None for token IDs; its token IDs): messages rendered by the chat template, then
    tokenized as transformers' apply_chat_template does."""
    field = req.prompt_form
    text = prompt_text(req, chat, max_len)
    if text is not None:
        ids = chat.tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = req.prompt_token_ids
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(field, f"token IDs {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if not ids:
        raise InvalidRequestError(field, "the prompt has no tokens")
    if len(ids) > max_len:
        raise InvalidRequestError(field, f"the prompt has {len(ids)} tokens; this model serves at most {max_len}")
    return text, torch.tensor(ids, dtype=torch.int64)


def render_prompt(
    req: PromptForms, chat: ChatTemplate, vocab_size: int, max_len: int, placeholder_id: int | None, begin: int | None
) -> PromptResult:
    """The prompt as the engine runs it, checked as `prepare` checks it (`begin`: the layout's begin token or None)."""
    text, token_ids = rendered_prompt(req, chat, vocab_size, max_len)
    ids = token_ids.tolist()
    return PromptResult(
        request_id=getattr(req, "request_id", None),
        form=req.prompt_form,
        text=text if text is not None else chat.tokenizer.decode(ids, skip_special_tokens=False),
        token_ids=ids,
        prompt_tokens=len(ids),
        user_placeholders=ids.count(placeholder_id) if placeholder_id is not None else 0,
        begin_token_appended=begin is not None and ids[-1] != begin,
    )


def candidate_token_lists(
    decoder, catalog, candidates: list[Candidate], prompt_tokens: int, begun: bool
) -> list[list[int]]:
    """Each candidate's row; an item's is its code in `catalog` (the request's version) as the decode generates it
    (`Retriever.item_row`; `begun`: the prompt ends with the layout's begin token, or it has none)."""
    if len(candidates) > decoder.max_candidates:
        raise InvalidRequestError(
            "candidates", f"{len(candidates)} candidates exceed this engine's limit of {decoder.max_candidates}"
        )
    vocab = decoder.model.config.vocab_size
    room = decoder.model.config.max_position_embeddings - prompt_tokens
    longest = decoder.max_candidate_len  # one candidate's row: what one bounded scoring pass holds
    lists, total = [], 0
    for i, cand in enumerate(candidates):
        field = f"candidates[{i}]"
        if cand.item_id is not None:
            index = catalog.index_of(cand.item_id)
            if index is None:
                raise InvalidRequestError(f"{field}.item_id", f"unknown item {cand.item_id!r}")
            tokens = decoder.item_row(catalog, index, begun)
        elif cand.text is not None:
            check_text_fits(f"{field}.text", cand.text, min(room, longest))
            tokens = decoder.tokenizer(cand.text, add_special_tokens=False)["input_ids"]
            if not tokens:
                raise InvalidRequestError(f"{field}.text", "tokenizes to no tokens")
        else:
            tokens = cand.token_ids
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{field}.token_ids", f"token IDs {bad[:5]} are outside the vocabulary")
        if cand.item_id is None and decoder.placeholder_id in tokens:  # candidate rows take no user embedding
            raise InvalidRequestError(
                f"{field}.{'text' if cand.text is not None else 'token_ids'}",
                "holds the <|user|> placeholder: a user embedding goes in the prompt, a candidate is an item's tokens",
            )
        if len(tokens) > room:
            raise InvalidRequestError(
                field, f"prompt plus candidate exceed the model's {room + prompt_tokens} positions"
            )
        if len(tokens) > longest:
            raise InvalidRequestError(
                field, f"{len(tokens)} tokens exceed this engine's limit of {longest} tokens per candidate"
            )
        total += len(tokens)
        if total > decoder.max_candidate_tokens:  # checked as it goes: the rest is never tokenized
            raise InvalidRequestError(
                "candidates", f"more than this engine's limit of {decoder.max_candidate_tokens} candidate tokens in all"
            )
        lists.append(tokens)
    return lists


def label_token_ids(tokenizer, labels: tuple[str, str]) -> tuple[int, int]:
    ids = []
    for i, label in enumerate(labels):
        tokens = tokenizer(label, add_special_tokens=False)["input_ids"] if label else []
        if len(tokens) != 1:
            raise InvalidRequestError(
                f"labels[{i}]", f"{label!r} is not a single token in the vocabulary (it tokenizes to {tokens})"
            )
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise InvalidRequestError("labels", "the positive and negative labels are the same token")
    return ids[0], ids[1]


def check_user_embedding(
    token_ids: torch.Tensor,
    placeholder_id: int | None,
    user_embedding: list[float] | None,
    projector: SoftTokenProjector | None,
) -> None:
    has_placeholder = placeholder_id is not None and bool((token_ids == placeholder_id).any())
    if user_embedding is None:
        if has_placeholder:
            raise InvalidRequestError("user_embedding", "the prompt has a <|user|> placeholder but no user_embedding")
        return
    if projector is None:
        raise InvalidRequestError(
            "user_embedding", "this model has no soft-token projector (genrec/soft_token.safetensors)"
        )
    if len(user_embedding) != projector.user_dim:
        raise InvalidRequestError(
            "user_embedding", f"has {len(user_embedding)} values; this model's projector expects {projector.user_dim}"
        )
    if not has_placeholder:
        raise InvalidRequestError("user_embedding", "was given but the prompt has no <|user|> placeholder token")
    dtype = projector.weight.dtype
    limit = torch.finfo(dtype).max / 2  # margin for rounding in the device's sums
    if max(map(abs, user_embedding)) > limit or projector.largest_partial_sum(user_embedding) > limit:
        raise InvalidRequestError(
            "user_embedding", f"values are too large for this model: projecting them would overflow {dtype}"
        )


def inject_user_embedding(
    embeds: torch.Tensor, token_ids: torch.Tensor, placeholder_id: int, user_embedding: list[float], projector
) -> torch.Tensor:
    """embeds [T, hidden] of token_ids [T] (a whole prompt or a chunk of it, already checked by
    `check_user_embedding`): placeholder rows replaced by one projected vector for all."""
    vector = to_device(user_embedding, projector.weight.device, torch.float32).to(projector.weight.dtype)
    projected = projector(vector).to(embeds.dtype)
    mask = to_device(token_ids.numpy() == placeholder_id, embeds.device, torch.bool)
    return torch.where(mask[:, None], projected[None, :], embeds)
