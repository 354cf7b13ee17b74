"""The emulator's tiny language model: byte-level, deterministic, CPU-only.

Imported only by the scheduler child (it imports torch); the main HTTP process never imports
this module, so that it stays light like SGLang's tokenizer-manager process.

The model is deliberately trivial (an embedding, one hidden layer and an LM head, ~40k
parameters) but it is a real ``torch.nn.Module`` with named parameters, so weights can later be
received over a weight-update group exactly like a real engine's.
"""

from __future__ import annotations

import torch
from torch import nn

from rollout_watchdog.emulator.common import EOS_TOKEN_ID, VOCAB_SIZE

HIDDEN_SIZE = 64
CONTEXT_WINDOW = 8  # tokens averaged into the "context" part of the hidden state
MODEL_SEED = 0


def _allowed_token_mask() -> torch.Tensor:
    """Tokens the model may emit: printable ASCII, newline and EOS (readable outputs)."""
    mask = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    mask[32:127] = True
    mask[10] = True
    mask[EOS_TOKEN_ID] = True
    return mask


class TinyLM(nn.Module):
    """Next token = f(embedding of the last token, mean embedding of a short context window)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden_size: int = HIDDEN_SIZE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.mlp = nn.Linear(2 * hidden_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size)
        self.register_buffer("allowed", _allowed_token_mask(), persistent=False)

    def forward(self, last_ids: torch.Tensor, window_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, vocab]`` for last tokens ``[batch]`` and windows ``[batch, W]``."""
        last = self.embed_tokens(last_ids)
        ctx = self.embed_tokens(window_ids).mean(dim=1)
        hidden = torch.tanh(self.mlp(torch.cat([last, ctx], dim=-1)))
        logits: torch.Tensor = self.lm_head(hidden)
        allowed: torch.Tensor = self.allowed  # type: ignore[assignment]
        return logits.masked_fill(~allowed, float("-inf"))


def build_model(seed: int = MODEL_SEED, hidden_size: int = HIDDEN_SIZE) -> TinyLM:
    """Build the model with fixed weights: the same seed gives the same outputs everywhere."""
    torch.manual_seed(seed)
    model = TinyLM(hidden_size=hidden_size)
    with torch.no_grad():
        # Make EOS rare so that default requests usually finish by length, as tests expect.
        model.lm_head.bias[EOS_TOKEN_ID] -= 4.0
    model.eval()
    return model


@torch.no_grad()
def next_tokens(
    model: TinyLM, contexts: list[list[int]], temperatures: list[float]
) -> list[int]:
    """One decode step for a batch: greedy argmax, or sampling where temperature > 0."""
    if not contexts:
        return []
    last = torch.tensor([c[-1] if c else 0 for c in contexts], dtype=torch.long)
    windows = []
    for ctx in contexts:
        tail = ctx[-CONTEXT_WINDOW:] if ctx else [0]
        windows.append([tail[0]] * (CONTEXT_WINDOW - len(tail)) + tail)
    logits = model(last, torch.tensor(windows, dtype=torch.long))
    out: list[int] = logits.argmax(dim=-1).tolist()
    for i, temp in enumerate(temperatures):
        if temp > 1e-6:
            probs = torch.softmax(logits[i] / temp, dim=-1)
            out[i] = int(torch.multinomial(probs, 1).item())
    return out


def backup_weights(model: TinyLM) -> dict[str, torch.Tensor]:
    """Copy of every parameter, kept while weights are 'released' (memory saver)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def zero_weights(model: TinyLM) -> None:
    """Stand-in for releasing weight memory: the weights become garbage until resumed."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def restore_weights(model: TinyLM, backup: dict[str, torch.Tensor]) -> None:
    """Put back the weights saved by :func:`backup_weights`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(backup[name])


def named_weights(seed: int, hidden_size: int = HIDDEN_SIZE) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters as a trainer holds them after a step (what a refit sends): the
    same seed, the same weights, and the same greedy outputs on every engine that got them."""
    return [(name, p.detach()) for name, p in
            build_model(seed, hidden_size=hidden_size).named_parameters()]
