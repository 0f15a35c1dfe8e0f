"""Placement: the `Policy` the executor runs, its memory plan and caps, the hardware profile,
the cost model and the search that chooses a policy."""

from offload.policies.policy import Placement, Policy

__all__ = ["Placement", "Policy"]
