"""Synthetic click-through data with a hidden segment structure (the generator is fixed in advance).

16 hidden user segments; each example draws a segment s, a user of that segment (10,000 user ids,
assigned to segments at random, so the segment is learnable from the id), an item (5,000 ids in 50
categories) and 4 context features (3 categorical with 10 values each, 1 uniform real). The click
probability is ``sigmoid(b + u_s · e_cat(item) + v_s · c)`` with segment vectors ``u_s`` (dim 8),
item-category embeddings ``e`` (dim 8, drawn once), ``v_s`` over the one-hot context plus the real
feature ``c`` (dim 31), and ``b`` set so the base click rate is about 10%.
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset

N_SEGMENTS, N_USERS, N_ITEMS, N_CATEGORIES = 16, 10_000, 5_000, 50
N_CONTEXT, CONTEXT_VALUES, DIM = 3, 10, 8
WORLD_SEED = 2026  # the hidden world (segments, embeddings, bias) is the same for every split


class ClickWorld:
    """The fixed hidden parameters of the generator."""

    def __init__(self) -> None:
        rng = np.random.default_rng(WORLD_SEED)
        self.user_segment = rng.integers(0, N_SEGMENTS, N_USERS)
        self.users_of = [np.flatnonzero(self.user_segment == s) for s in range(N_SEGMENTS)]
        self.item_category = rng.integers(0, N_CATEGORIES, N_ITEMS)
        self.u = rng.normal(0, 1, (N_SEGMENTS, DIM))
        self.e = rng.normal(0, 1, (N_CATEGORIES, DIM)) / np.sqrt(DIM)
        self.v = rng.normal(0, 1, (N_SEGMENTS, N_CONTEXT * CONTEXT_VALUES + 1))
        self.b = 0.0
        self.b = self._calibrate(rng)

    def _logits(self, segment, item, context, real):
        onehot = np.zeros((len(segment), N_CONTEXT * CONTEXT_VALUES + 1))
        for j in range(N_CONTEXT):
            onehot[np.arange(len(segment)), j * CONTEXT_VALUES + context[:, j]] = 1.0
        onehot[:, -1] = real
        return (self.b + np.einsum("nd,nd->n", self.u[segment], self.e[self.item_category[item]])
                + np.einsum("nd,nd->n", self.v[segment], onehot))

    def _calibrate(self, rng) -> float:
        seg, item, ctx, real = self._draw(rng, 50_000)
        logits = self._logits(seg, item, ctx, real)
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection on the mean click rate
            mid = (lo + hi) / 2
            rate = (1 / (1 + np.exp(-(logits + mid)))).mean()
            lo, hi = (mid, hi) if rate < 0.10 else (lo, mid)
        return (lo + hi) / 2

    def _draw(self, rng, n):
        segment = rng.integers(0, N_SEGMENTS, n)
        item = rng.integers(0, N_ITEMS, n)
        context = rng.integers(0, CONTEXT_VALUES, (n, N_CONTEXT))
        real = rng.uniform(0, 1, n)
        return segment, item, context, real

    def sample(self, n: int, seed: int) -> Dataset:
        rng = np.random.default_rng(seed)
        segment, item, context, real = self._draw(rng, n)
        user = self._users(rng, segment)
        prob = 1 / (1 + np.exp(-self._logits(segment, item, context, real)))
        click = (rng.uniform(0, 1, n) < prob).astype(np.float32)
        return Dataset.from_dict({
            "user": user.astype(np.int64), "item": item.astype(np.int64),
            "category": self.item_category[item].astype(np.int64),
            "ctx": context.astype(np.int64), "real": real.astype(np.float32), "click": click,
            "prob": prob.astype(np.float32),  # the true click probability: for the oracle AUC only, not a feature
        })

    def _users(self, rng, segment):
        """A uniformly drawn user of each example's segment (vectorised over a sorted user table)."""
        order = np.argsort(self.user_segment, kind="stable")
        starts = np.searchsorted(self.user_segment[order], np.arange(N_SEGMENTS))
        counts = np.bincount(self.user_segment, minlength=N_SEGMENTS)
        pick = (rng.uniform(0, 1, len(segment)) * counts[segment]).astype(np.int64)
        return order[starts[segment] + pick]
