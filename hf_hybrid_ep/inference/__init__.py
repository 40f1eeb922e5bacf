"""Inference with experts offloaded: a bounded cache of resident experts per layer (eviction policies),
expert stores (memory, a safetensors checkpoint), and the offloaded model built on them.
"""
