"""The decision core: pure functions from frozen job snapshots to decisions.

Nothing in this package talks to Redis or a database; the service layer loads a
:class:`~bso.core.state.JobSnapshot`, asks a policy (:mod:`bso.core.policies`),
and persists the outcome.  Importing the package imports none of its modules:
the wire imports :mod:`bso.core.vocabulary` without pulling in numpy.
"""
