"""A synthetic multi-domain click-through world (the generator is fixed in advance; its hash is in
docs/moe_layer.md).

Every example happens in one of 32 *domains* (surfaces × markets of a recommender: home feed, search,
e-mail, … in each country), observed as a feature. A user belongs to one of 200 observable user
groups (age × region × device buckets), an item to one of 50 categories; there are 2,000 item ids, 3
categorical context features with 10 values each and one real feature. The click logit is

    b + s · (a_gᵀ M_d c_cat + w_dᵀ x_ctx + β_i)

with hidden user-group vectors ``a_g`` and category vectors ``c_cat`` (dim 6, shared by all domains),
a **per-domain interaction matrix** ``M_d`` (6 × 6), per-domain context weights ``w_d`` over the one-hot
context plus the real feature, a small item bias ``β_i``, a scale ``s`` and a bias ``b`` that sets the
base click rate to about 10%. Which user groups like which categories differs per domain: the signal
is a three-way interaction domain × user group × category, every value of which is seen thousands of
times in a 200k-example run. A model that picks a sub-network per domain (a mixture of experts routed
on the domain) represents it with one bilinear map per domain; a single dense MLP must build the
three-way product out of its width. That is the structure this world favours, on purpose.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from datasets import Dataset

N_DOMAINS, N_GROUPS, N_ITEMS, N_CATEGORIES = 32, 200, 2_000, 50
N_CONTEXT, CONTEXT_VALUES, RANK = 3, 10, 6
SCALE, ITEM_BIAS_STD, BASE_RATE = 1.6, 0.3, 0.10
WORLD_SEED = 2026  # the hidden world (vectors, matrices, bias) is the same for every split
FEATURES = ("domain", "group", "item", "category", "ctx", "real")


def generator_hash() -> str:
    """sha256 of this file: the generator the recorded figures were measured with."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class ClickWorld:
    """The fixed hidden parameters of the generator."""

    def __init__(self) -> None:
        rng = np.random.default_rng(WORLD_SEED)
        self.item_category = rng.integers(0, N_CATEGORIES, N_ITEMS)
        self.a = rng.normal(0, 1, (N_GROUPS, RANK))
        self.c = rng.normal(0, 1, (N_CATEGORIES, RANK))
        self.m = rng.normal(0, 1 / RANK, (N_DOMAINS, RANK, RANK))
        self.w = rng.normal(0, 0.5, (N_DOMAINS, N_CONTEXT * CONTEXT_VALUES + 1))
        self.item_bias = rng.normal(0, ITEM_BIAS_STD, N_ITEMS)
        self.b = 0.0
        self.b = self._calibrate(rng)

    def _logits(self, domain, group, item, context, real):
        onehot = np.zeros((len(domain), N_CONTEXT * CONTEXT_VALUES + 1))
        for j in range(N_CONTEXT):
            onehot[np.arange(len(domain)), j * CONTEXT_VALUES + context[:, j]] = 1.0
        onehot[:, -1] = real
        cat = self.item_category[item]
        interaction = np.einsum("nr,nrs,ns->n", self.a[group], self.m[domain], self.c[cat])
        linear = np.einsum("nf,nf->n", self.w[domain], onehot)
        return self.b + SCALE * (interaction + linear + self.item_bias[item])

    def _calibrate(self, rng) -> float:
        logits = self._logits(*self._draw(rng, 50_000))
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection on the mean click rate
            mid = (lo + hi) / 2
            rate = (1 / (1 + np.exp(-(logits + mid)))).mean()
            lo, hi = (mid, hi) if rate < BASE_RATE else (lo, mid)
        return (lo + hi) / 2

    def _draw(self, rng, n):
        domain = rng.integers(0, N_DOMAINS, n)
        group = rng.integers(0, N_GROUPS, n)
        item = rng.integers(0, N_ITEMS, n)
        context = rng.integers(0, CONTEXT_VALUES, (n, N_CONTEXT))
        real = rng.uniform(0, 1, n)
        return domain, group, item, context, real

    def sample(self, n: int, seed: int) -> Dataset:
        rng = np.random.default_rng(seed)
        domain, group, item, context, real = self._draw(rng, n)
        prob = 1 / (1 + np.exp(-self._logits(domain, group, item, context, real)))
        click = (rng.uniform(0, 1, n) < prob).astype(np.float32)
        return Dataset.from_dict({
            "domain": domain.astype(np.int64), "group": group.astype(np.int64), "item": item.astype(np.int64),
            "category": self.item_category[item].astype(np.int64), "ctx": context.astype(np.int64),
            "real": real.astype(np.float32), "click": click,
            "prob": prob.astype(np.float32),  # the true click probability: for the oracle AUC only, not a feature
        })
