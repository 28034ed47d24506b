"""The policies a job can ask for, by the name its spec gives."""

from __future__ import annotations

from bso.core.bso_policy import BsoPolicy
from bso.core.policy import Policy
from bso.core.state import JobSnapshot
from bso.core.zeus_policy import ZeusPolicy

POLICIES: dict[str, Policy] = {p.name: p for p in (BsoPolicy(), ZeusPolicy())}


def policy_for(snapshot: JobSnapshot) -> Policy:
    """The policy the job's spec asks for."""
    return POLICIES[snapshot.spec.policy]
