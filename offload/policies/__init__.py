"""Placement policies: the `Policy` the executor runs (and, later, the cost model and search)."""

from offload.policies.policy import Placement, Policy

__all__ = ["Placement", "Policy"]
