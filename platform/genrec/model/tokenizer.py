"""The tokenizer: its conventions (genrec's semantic-ID tokens `<{letter}_{index}>`, a letter per code level; the
`<|user|>` soft-token placeholder; label tokens), its loading and checks, and chat messages rendered by its template
with `genrec/prompt.json`'s options (docs/serving.md, 'Prompts: text, chat messages or token IDs'). Which tokens
form each level of a model is its SID layout (genrec.model.sid_layout).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from genrec.errors import InvalidRequestError, ModelDirectoryError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

USER_TOKEN = "<|user|>"
EOS_TOKEN = "<|endoftext|>"
LABEL_TOKENS = ("yes", "no")
LEVEL_LETTERS = string.ascii_lowercase


def semantic_token(level: int, index: int) -> str:
    return f"<{LEVEL_LETTERS[level]}_{index}>"


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise ModelDirectoryError(model_dir, "no tokenizer files (tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer  # here: a process that only checks a model never imports transformers

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises many types here; report them as one clear error
        raise ModelDirectoryError(model_dir, f"tokenizer does not load ({type(err).__name__}: {err})") from None


def check_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, model_dir: Path) -> None:
    """Every token ID the tokenizer can produce must index the model's embedding (else a device assert later)."""
    vocab = tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= vocab_size:
        name = next(token for token, token_id in vocab.items() if token_id == top)
        raise ModelDirectoryError(
            model_dir, f"the tokenizer has token IDs up to {top} ({name!r}); config.json's vocab_size is {vocab_size}"
        )


PROMPT_FILE = "prompt.json"
PROMPT_VERSION = 1
_KEYS = ("version", "system_prompt", "chat_template_kwargs")
DEFAULT_TEMPLATE_KWARGS = {"enable_thinking": False}
# apply_chat_template's own arguments: a template variable of one of these names would change what it does.
RESERVED_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "return_dict", "tokenizer_kwargs", "sanitize_control_tokens"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """The model's chat options (`genrec/prompt.json`)."""

    system_prompt: str | None = None
    template_kwargs: dict = field(default_factory=lambda: dict(DEFAULT_TEMPLATE_KWARGS))

    @classmethod
    def load(cls, path: Path) -> ChatOptions:
        """The options in `path` (defaults when absent); a bad file is a ModelDirectoryError naming it and the key."""
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ModelDirectoryError(path, f"cannot be read as JSON ({err})") from None
        if not isinstance(raw, dict):
            raise ModelDirectoryError(path, "must be a JSON object")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ModelDirectoryError(path, f"unknown keys {unknown} (known: {', '.join(_KEYS)})")
        if raw.get("version", PROMPT_VERSION) != PROMPT_VERSION:
            raise ModelDirectoryError(
                path, f"version {raw['version']!r} is not one this genrec reads ({PROMPT_VERSION})"
            )
        system = raw.get("system_prompt")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ModelDirectoryError(path, "system_prompt must be a non-empty string (or null)")
        kwargs = raw.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise ModelDirectoryError(path, "chat_template_kwargs must be a JSON object")
        reserved = sorted(RESERVED_KWARGS & set(kwargs))
        if reserved:
            raise ModelDirectoryError(path, f"chat_template_kwargs may not set {reserved} (genrec sets them)")
        return cls(system, DEFAULT_TEMPLATE_KWARGS | kwargs)


class ChatTemplate:
    """Renders chat messages with the tokenizer's template: `render(messages)` is the text the model reads."""

    def __init__(
        self,
        tokenizer,
        options: ChatOptions | None = None,
        source: Path | str = "tokenizer",
        allowed: frozenset[str] = frozenset(),
    ):
        """`allowed`: special tokens a message may hold all the same (the model's semantic-ID tokens and wrappers,
        which histories are written in)."""
        self.tokenizer = tokenizer
        self.options = options or ChatOptions()
        self.available = bool(getattr(tokenizer, "chat_template", None))
        # Control tokens (`<|im_start|>` ...) in a message would open or close turns (e.g. forge a system turn).
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        self.control_tokens = tuple(sorted(special - allowed - {USER_TOKEN}))
        if self.options.system_prompt is not None and not self.available:
            raise ModelDirectoryError(source, "has a system_prompt but the tokenizer has no chat template")

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The messages with the model's system prompt first, unless they open with a system turn of their own."""
        system = self.options.system_prompt
        if system is None or (messages and messages[0]["role"] == "system"):
            return list(messages)
        return [{"role": "system", "content": system}, *messages]

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` ([{role, content}]); InvalidRequestError naming `messages` when the model
        has no chat template or its template refuses them."""
        if not self.available:
            raise InvalidRequestError(
                "messages", "this model has no chat template (tokenizer_config.json chat_template): send 'prompt'"
            )
        self._refuse_control_tokens(messages)
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                self.conversation(messages), tokenize=False, add_generation_prompt=True, **self.options.template_kwargs
            )
        except TemplateError as err:  # raise_exception() in a template, or a template that fails on this input
            raise InvalidRequestError("messages", f"the model's chat template refused them ({err})") from None

    def _refuse_control_tokens(self, messages: list[dict]) -> None:
        for i, message in enumerate(messages):
            for key in ("role", "content"):
                found = next((t for t in self.control_tokens if t in message[key]), None)
                if found is not None:
                    raise InvalidRequestError(
                        f"messages[{i}].{key}", f"holds {found!r}, a control token of the model's chat template"
                    )
