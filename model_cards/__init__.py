"""The model-card templates: the repository's ``model_cards/``, installed as the package ``hf_hybrid_ep.model_cards``."""
