"""The wire contract: everything both sides of the queue must agree on.

* :mod:`bso.wire.events`: the events a caller sends and the replies it gets;
* :mod:`bso.wire.status_query`: the read-only status query and its reply;
* :mod:`bso.wire.keys`: every Redis key, queue name, task name and TTL;
* :mod:`bso.wire.message`: the message format on the queue;
* :mod:`bso.wire.replies`: where a worker leaves a reply and how a caller waits for it;
* :mod:`bso.wire.connection`: the Redis connection both keep, and what its errors mean.

The training-side client (``bso_client``) and the workers (``bso_workers``)
both import this package and never each other.  Importing it connects to
nothing.
"""
