"""Model I/O: a live (or meta) model and the checkpoint files of :mod:`hf_hybrid_ep.checkpoint` — saving a
parallelized model expert-sharded (:mod:`.save`, :mod:`.stream`), reading only this rank's experts into one
(:mod:`.rank_local`), PEFT adapters (:mod:`.adapters`), the side state (:mod:`.side_state`), the optimizer state
(:mod:`.optimizer_state`) and the newest complete checkpoint of a run (:mod:`.resume`)."""
