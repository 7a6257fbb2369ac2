"""meshcomm.planners: layouts -> transfer graph -> schedule (imported as meshcomm.planners).

The planner never imports a backend. Plans are plain data (`Plan`, `Transfer`).
"""
from .boxes import Box, box_size, row_major_range
from .schedule import Plan, Transfer, KINDS
from .topology import Topology, PRESETS
from .resharding import plan_reshard, pieces, transfer_graph
from .verify import verify, PlanError, check_deadlock_free

__all__ = ["Box", "box_size", "row_major_range", "Plan", "Transfer", "KINDS", "Topology",
           "PRESETS", "plan_reshard", "pieces", "transfer_graph", "verify", "PlanError",
           "check_deadlock_free"]
