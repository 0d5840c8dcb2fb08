"""A tiny model directory whose tokenizer has a Qwen3-style chat template (written here: a system turn, user and
assistant turns between `<|im_start|>` / `<|im_end|>`, and the `enable_thinking` switch, which when false opens the
assistant's turn with the empty think block), its control tokens added to a vocabulary padded for them, as real
checkpoints' vocabularies are."""

import json
from dataclasses import replace
from pathlib import Path

from genrec.model.tokenizer import load_tokenizer
from genrec.testing.tiny import ModelSpec, build_tokenizer, write_model_dir

CONTROL_TOKENS = ["<|im_start|>", "<|im_end|>"]  # special: never split, skipped by decode(skip_special_tokens)
THINK_TOKENS = ["<think>", "</think>"]  # added, not special (as in Qwen3)
EMPTY_THINK = "<think>\n\n</think>\n\n"

# Jinja string literals below keep their backslash escapes ('\n' is a newline in the output).
QWEN3_STYLE_TEMPLATE = r"""
{%- if messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- raise_exception('a system message must come first') -}}{%- endif -%}
{%- elif message.role == 'user' or message.role == 'assistant' -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- else -%}
{{- raise_exception('unexpected message role: ' + message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
""".strip()


def write_chat_model_dir(out: Path, spec: ModelSpec, prompt_options: dict | None = None, tokenizer=None) -> Path:
    """The tiny model of `spec` (with `tokenizer`, e.g. an open checkpoint's SID naming; default genrec's) with the
    chat template in tokenizer_config.json's `chat_template` and, when given, `prompt_options` as
    genrec/prompt.json."""
    base = len(tokenizer if tokenizer is not None else build_tokenizer(spec.levels, spec.codebook, seed=spec.seed))
    padded = -(-(base + len(CONTROL_TOKENS) + len(THINK_TOKENS)) // 64) * 64
    write_model_dir(out, replace(spec, vocab_size=padded), tokenizer=tokenizer)
    tokenizer = load_tokenizer(out)
    tokenizer.add_tokens(CONTROL_TOKENS, special_tokens=True)
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN3_STYLE_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    if prompt_options is not None:
        (out / "genrec" / "prompt.json").write_text(json.dumps(prompt_options))
    return out
