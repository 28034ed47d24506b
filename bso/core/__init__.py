"""The decision core: pure functions from frozen job snapshots to decisions.

Nothing in this package talks to Redis or a database; the service layer loads a
:class:`~bso.core.state.JobSnapshot`, asks a policy, and persists the outcome.
"""

from bso.core.bso_policy import BsoPolicy
from bso.core.policy import Assignment, Policy, Verdict, ZeusPolicy
from bso.core.state import JobSnapshot, TrialSnapshot

POLICIES: dict[str, Policy] = {p.name: p for p in (BsoPolicy(), ZeusPolicy())}


def policy_for(snapshot: JobSnapshot) -> Policy:
    """The policy the job's spec asks for."""
    return POLICIES[snapshot.spec.policy]


__all__ = [
    "POLICIES",
    "Assignment",
    "BsoPolicy",
    "JobSnapshot",
    "Policy",
    "TrialSnapshot",
    "Verdict",
    "ZeusPolicy",
    "policy_for",
]
