"""An LSTM sequence classifier for IMDB (Swiatkowski et al., 2020, Sec. 2.3: "an embedding and an LSTM
cell, followed by a single unit dense layer").

Input: token ids ``(N, T)`` (long; id 0 = padding, see :mod:`bdl_bench.data.text`); output: the
dense layer applied to the LSTM's last hidden state, ``(N, out_features)`` (1 logit for IMDB).
Sequences are front-padded, so the last step has read the end of every review.

The paper does not print the sizes; its Table 3 parameter counts (2,823k mean-field parameters =
2 × 1,411,713 weights; 1-tied 2,693k) fit ``embedding_dim = hidden_size = 128`` with a 10,000-token
vocabulary (PyTorch's LSTM adds a second bias vector: 512 weights more than Keras').
``conf/model/lstm.yaml`` uses 128/128 and takes the vocabulary size from the data config.
"""

from __future__ import annotations

from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.models import register_model


class LSTMClassifier(nn.Module):
    """Embedding → one-layer LSTM → linear layer on the last hidden state."""

    def __init__(self, *, vocab_size: int, embedding_dim: int, hidden_size: int, out_features: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, out_features)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(N, out_features)`` of token ids ``(N, T)``."""
        embedded = self.embedding(tokens.long())  # (N, T, E)
        _, (h_last, _) = self.lstm(embedded)  # h_last: (1, N, H)
        return self.head(h_last[-1])


@register_model("lstm")
def lstm(
    *, in_features: int, out_features: int, vocab_size: int, embedding_dim: int, hidden_size: int
) -> LSTMClassifier:
    """The IMDB LSTM; ``vocab_size`` counts padding (0) and unknown (1) as ``data.vocab_size`` does;
    ``in_features`` (the sequence length) is ignored."""
    for key, value in (("vocab_size", vocab_size), ("embedding_dim", embedding_dim), ("hidden_size", hidden_size)):
        if int(value) < 1:
            raise ConfigError(f"lstm: {key} must be positive, got {value}")
    return LSTMClassifier(
        vocab_size=int(vocab_size),
        embedding_dim=int(embedding_dim),
        hidden_size=int(hidden_size),
        out_features=out_features,
    )
