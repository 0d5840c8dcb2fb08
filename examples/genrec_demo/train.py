"""Train the demo's Qwen3 (transformers' Qwen3ForCausalLM, autograd) and its soft-token projector.

Quality within a few CPU minutes is bound by epochs, so the budget is CPU seconds of one torch thread (the
machine may be shared: wall time is noise), and the learning rate anneals against the share of it spent.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm

from genrec.model.soft_token import SoftTokenProjector
from genrec_demo.batches import IGNORE, Batch, NegativeSampler, Vocab, epoch_windows, make_batch
from genrec_demo.config import DemoConfig
from genrec_demo.streams import initialise

WARMUP = 0.03  # share of the budget


@dataclass
class Trained:
    model: transformers.Qwen3ForCausalLM
    projector: SoftTokenProjector
    stats: dict


def hf_config(cfg: DemoConfig, tokenizer) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


class Budget:
    """Progress in [0, 1]: steps against max_steps when given (the run is then reproducible bit for bit),
    else CPU seconds of this process against the budget (the step count then depends on the machine)."""

    def __init__(self, cpu_s: float, max_steps: int | None):
        self.cpu_s, self.max_steps, self.steps = cpu_s, max_steps, 0
        self.start_cpu, self.start_wall = time.process_time(), time.perf_counter()

    @property
    def used_cpu_s(self) -> float:
        return time.process_time() - self.start_cpu

    @property
    def progress(self) -> float:
        return min(1.0, self.steps / self.max_steps if self.max_steps else self.used_cpu_s / self.cpu_s)

    def stats(self, seed: int, epochs: float, losses: dict) -> dict:
        """The training figures kept with a model."""
        return {
            "seed": seed,
            "steps": self.steps,
            "epochs": round(epochs, 2),
            "cpu_s": round(self.used_cpu_s, 1),
            "wall_s": round(time.perf_counter() - self.start_wall, 1),
            "final_loss": losses,
        }

    def lr_scale(self) -> float:
        """Linear warm-up, then cosine annealing to zero at the end of the budget."""
        p = self.progress
        return p / WARMUP if p < WARMUP else 0.5 * (1 + math.cos(math.pi * (p - WARMUP) / (1 - WARMUP)))


@contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(
    histories: list[np.ndarray],
    user_vectors: np.ndarray,
    vocab: Vocab,
    tokenizer,
    cfg: DemoConfig,
    near: np.ndarray | None = None,
    progress: bool = True,
) -> Trained:
    """histories: each user's training items (time order); user_vectors [users, dim] for the soft token;
    near [users, k]: items each user's negatives are partly drawn from (see NegativeSampler)."""
    with one_thread():
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        model, projector = new_models(cfg, tokenizer, user_vectors.shape[1])
        params = [*model.parameters(), *projector.parameters()]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
        users = torch.as_tensor(user_vectors, dtype=torch.float32)
        counts = np.bincount(np.concatenate(histories), minlength=len(vocab.codes))
        sampler = NegativeSampler(counts, cfg.negative_power, near, cfg.near_weight)
        budget, epochs, losses = Budget(cfg.budget_cpu_s, cfg.max_steps), 0.0, {}
        bar = tqdm(total=100, desc="training", unit="%", disable=not progress, bar_format="{l_bar}{bar}| {postfix}")
        while budget.progress < 1.0:
            rows = epoch_windows(histories, cfg.history, rng)
            for start in range(0, len(rows), cfg.batch):
                chunk = rows[start : start + cfg.batch]
                users_of = np.array([u for u, _ in chunk])
                targets = np.array([histories[u][end] for u, end in chunk])
                negatives = sampler.sample(users_of, targets, cfg.negatives, rng)
                batch = make_batch(chunk, histories, vocab, cfg.history, negatives)
                for group in optimizer.param_groups:
                    group["lr"] = cfg.lr * budget.lr_scale()
                log_mq = sampler.log_q(batch.users, batch.candidates) + math.log(cfg.negatives)
                loss, losses = _loss(model, projector, batch, users, vocab, log_mq)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                budget.steps += 1
                epochs += len(chunk) / len(rows)
                shown = {"step": budget.steps, "epoch": f"{epochs:.1f}", "cpu_s": f"{budget.used_cpu_s:.0f}"}
                bar.set_postfix(shown | losses, refresh=False)  # drawn with the bar's next percent
                bar.update(round(100 * budget.progress) - bar.n)
                if budget.progress >= 1.0:
                    break
        bar.close()
    return Trained(model.eval(), projector.eval(), budget.stats(cfg.seed, epochs, losses))


def new_models(cfg: DemoConfig, tokenizer, user_dim: int) -> tuple[transformers.Qwen3ForCausalLM, SoftTokenProjector]:
    """The Qwen3 and its soft-token projector, each drawn from its named streams (`genrec_demo.streams`): the
    Qwen3 as transformers initialises one (N(0, initializer_range), norms 1), the projector as torch does."""
    config = hf_config(cfg, tokenizer)
    model = transformers.Qwen3ForCausalLM(config).train()
    initialise(model, cfg.seed, "retriever", config.initializer_range, config.initializer_range)
    projector = SoftTokenProjector(user_dim, cfg.hidden)
    initialise(projector, cfg.seed, "projector", config.initializer_range)
    return model, projector.train()


def forward_logits(model, projector, batch: Batch, users: torch.Tensor, user_token: int) -> torch.Tensor:
    """[B, T, vocab]: each row's user factor, projected, replaces its <|user|> embeddings (as the engine does)."""
    embeds = model.get_input_embeddings()(batch.input_ids)
    soft = projector(users[batch.users])
    embeds = torch.where((batch.input_ids == user_token)[..., None], soft[:, None, :], embeds)
    return model(inputs_embeds=embeds, attention_mask=batch.mask, position_ids=batch.positions).logits


def _loss(model, projector, batch: Batch, users: torch.Tensor, vocab: Vocab, log_mq: torch.Tensor):
    """Cross-entropy on the code tokens, plus the labels' loss at each candidate's last token.

    log_mq [B, candidates]: log(negatives * q(candidate)) under the noise q the negatives were drawn from.
    Labels: `yes`/`no` must hold the probability mass there (scoring reads the full-vocabulary log-softmax of
    `yes`), and their margin is a noise-contrastive classifier of target against negatives: offset by
    log(m q), it learns log p(item | user) whatever q is, so the score ranks like the user's true preference.
    """
    logits = forward_logits(model, projector, batch, users, vocab.user)
    codes = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE)
    at = logits[torch.arange(len(logits))[:, None], batch.candidate_last]  # [B, candidates, vocab]
    yes, no = at[..., vocab.yes], at[..., vocab.no]
    mass = (at.logsumexp(dim=-1) - torch.logaddexp(yes, no)).mean()
    is_target = torch.zeros_like(yes)
    is_target[:, 0] = 1.0  # the target is each row's first candidate
    nce = F.binary_cross_entropy_with_logits(yes - no - log_mq, is_target)
    losses = {"codes": f"{codes.item():.3f}", "mass": f"{mass.item():.3f}", "nce": f"{nce.item():.3f}"}
    return codes + mass + nce, losses
