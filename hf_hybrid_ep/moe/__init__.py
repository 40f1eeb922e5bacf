"""The MoE side of a model: finding transformers' fused experts modules, the expert-parallel layer that
replaces their forward, router controls and load accounting, hot-expert shadowing, freezing, online
rebalancing, and a reusable MoE layer for models outside transformers (:mod:`.standalone`).
"""
