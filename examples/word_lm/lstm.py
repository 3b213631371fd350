"""word_language_model's LSTM (its ``RNNModel`` with ``--model LSTM``) for csframework's carried-state
contract: ``initial_state`` gives the zero hidden state a pass starts from, ``forward(batch, state)`` returns
the loss and the new state, and the loop detaches it between batches (word_language_model's
``repackage_hidden``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WordLSTM(nn.Module):
    """Embedding -> dropout -> ``layers``-layer LSTM -> dropout -> a linear layer over the vocabulary; with
    ``tied`` the output layer shares the embedding's weights (which needs ``embed == hidden``)."""

    def __init__(self, vocab_size: int, embed: int = 200, hidden: int = 200, layers: int = 2,
                 dropout: float = 0.2, tied: bool = False):
        super().__init__()
        if tied and embed != hidden:
            raise ValueError(f"tied=true needs embed == hidden, got embed={embed} and hidden={hidden}")
        self.layers, self.hidden = layers, hidden
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab_size)
        if tied:
            self.decoder.weight = self.encoder.weight
        # word_language_model's init_weights: uniform in [-0.1, 0.1], a zero output bias
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def initial_state(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero ``(h, c)`` for the batch's streams (a batch is ``[bptt, streams]``)."""
        tokens, _ = batch
        zeros = torch.zeros(self.layers, tokens.shape[1], self.hidden, device=tokens.device)
        return zeros, zeros.clone()

    def forward(self, batch, state):
        """The mean cross-entropy of the next words, the logits and targets (for ``metrics:``), and the new
        ``(h, c)``."""
        tokens, targets = batch
        out, state = self.lstm(self.drop(self.encoder(tokens)), state)
        logits = self.decoder(self.drop(out))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss, "logits": logits, "target": targets}, state
