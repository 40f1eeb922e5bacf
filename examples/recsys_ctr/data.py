"""A synthetic multi-domain click-through world (the generator is fixed in advance; its hash is in
docs/moe_layer.md).

Every example happens in one of 16 *domains* (surfaces × markets of a recommender: home feed, search,
e-mail, … in each country), observed as a feature. A user belongs to one of 20 observable user groups
(age × region × device buckets), an item to one of 20 categories; there are 3 categorical context
features with 10 values each and one real feature. Every value has a hidden vector (dim 4) shared by
all domains: ``a_g`` (user group), ``c_cat`` (category), ``q_{j,v}`` (context feature j = v). The click
logit is

    b + s · (a_gᵀ M_d c_cat + u_dᵀ Σ_j q_{j,ctx_j} + r_d · real)

with a **per-domain interaction matrix** ``M_d`` (4 × 4), per-domain context and real-feature weights
``u_d`` and ``r_d``, a scale ``s`` and a bias ``b`` that sets the base click rate to about 10%. Which
user groups like which categories differs per domain: the signal is a three-way interaction domain ×
user group × category, every cell of which (6,400) is seen about 30 times in a 200k-example run while
every group, category and domain is seen thousands of times. A model that picks a sub-network per
domain (a mixture of experts routed on the domain) represents it with one bilinear map per domain; a
single dense MLP must build the three-way product out of its width. That is the structure this world
favours, on purpose.

Version 4. Version 3 had 32 domains, 50 groups and 30 categories (48,000 cells); version 2 had 200
groups, 50 categories, full-rank per-domain one-hot context weights and 2,000 item ids with their own
bias. The neural models did not learn either in a few minutes; see docs/moe_layer.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from datasets import Dataset

N_DOMAINS, N_GROUPS, N_CATEGORIES = 16, 20, 20
N_CONTEXT, CONTEXT_VALUES, RANK = 3, 10, 4
SCALE, BASE_RATE = 0.7, 0.10
WORLD_SEED = 2026  # the hidden world (vectors, matrices, bias) is the same for every split
FEATURES = ("domain", "group", "category", "ctx", "real")


def generator_hash() -> str:
    """sha256 of this file: the generator the recorded figures were measured with."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class ClickWorld:
    """The fixed hidden parameters of the generator."""

    def __init__(self) -> None:
        rng = np.random.default_rng(WORLD_SEED)
        self.a = rng.normal(0, 1, (N_GROUPS, RANK))
        self.c = rng.normal(0, 1, (N_CATEGORIES, RANK))
        self.q = rng.normal(0, 1, (N_CONTEXT, CONTEXT_VALUES, RANK)) / N_CONTEXT**0.5
        self.m = rng.normal(0, 1 / RANK**0.5, (N_DOMAINS, RANK, RANK))
        self.u = rng.normal(0, 1 / RANK**0.5, (N_DOMAINS, RANK))
        self.r = rng.normal(0, 1, N_DOMAINS)
        self.b = 0.0
        self.b = self._calibrate(rng)

    def _logits(self, domain, group, category, context, real):
        interaction = np.einsum("nr,nrs,ns->n", self.a[group], self.m[domain], self.c[category])
        ctx = self.q[np.arange(N_CONTEXT), context].sum(1)  # [n, RANK]
        linear = np.einsum("nr,nr->n", self.u[domain], ctx) + self.r[domain] * real
        return self.b + SCALE * (interaction + linear)

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
        category = rng.integers(0, N_CATEGORIES, n)
        context = rng.integers(0, CONTEXT_VALUES, (n, N_CONTEXT))
        real = rng.uniform(0, 1, n)
        return domain, group, category, context, real

    def sample(self, n: int, seed: int) -> Dataset:
        rng = np.random.default_rng(seed)
        domain, group, category, context, real = self._draw(rng, n)
        prob = 1 / (1 + np.exp(-self._logits(domain, group, category, context, real)))
        click = (rng.uniform(0, 1, n) < prob).astype(np.float32)
        return Dataset.from_dict({
            "domain": domain.astype(np.int64), "group": group.astype(np.int64),
            "category": category.astype(np.int64), "ctx": context.astype(np.int64),
            "real": real.astype(np.float32), "click": click,
            "prob": prob.astype(np.float32),  # the true click probability: for the oracle AUC only, not a feature
        })
