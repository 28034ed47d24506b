"""The ``bso`` sub-commands, one module each, on top of everything else.

Each module has ``configure_parser(parser)`` and ``run(args) -> int``;
:mod:`bso.cli` imports the one in use.  They are the only modules that import
both the workers (``bso_workers``) and the training-side client
(``bso_client``): ``bso demo`` and ``bso status`` drive the live service
through the client, ``bso up`` runs the workers' stack.
"""
