"""Parameter counts of a Qwen3 architecture, for both sides of torchrun (no torch here).

`a` is anything with transformers' Qwen3Config attribute names: the schema's `ArchConfig`
(the plan), or a model's own config (MFU in trainer/perf.py, floors in scripts/bench.py).

    per layer  = q, k, v, o projections + q/k RMSNorm (2 x head_dim) + gate, up, down
                 + two RMSNorms (2 x hidden)
    embedding  = vocab x hidden (once more for an untied lm_head)
    total      = embedding (x2 untied) + layers x per layer + the final norm
    matmul     = layers x (projections + MLP) + vocab x hidden: the weights a token multiplies
                 (the lm_head product; the embedding lookup costs no FLOPs)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    total: int
    per_layer: int
    embedding: int
    matmul: int

    def read_per_token(self, tied: bool) -> int:
        """Weights one decode step reads: all of them, the input embedding only row by row."""
        return self.total - (0 if tied else self.embedding)


def count_params(a) -> ParamCounts:
    h, hd = a.hidden_size, a.head_dim
    projections = h * a.num_attention_heads * hd * 2 + h * a.num_key_value_heads * hd * 2
    mlp = 3 * h * a.intermediate_size
    per_layer = projections + 2 * hd + mlp + 2 * h
    embedding = a.vocab_size * h
    total = embedding * (1 if a.tie_word_embeddings else 2) + a.num_hidden_layers * per_layer + h
    matmul = a.num_hidden_layers * (projections + mlp) + embedding
    return ParamCounts(total, per_layer, embedding, matmul)
