"""Online rebalancing: the policy that decides when and where experts move (:mod:`.policy`) and the move itself
(:mod:`.moves`)."""

from .moves import apply_tables, unwrap_optimizer
from .policy import RebalanceEvent, Rebalancer, refit

__all__ = ["RebalanceEvent", "Rebalancer", "apply_tables", "refit", "unwrap_optimizer"]
