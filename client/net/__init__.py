"""The client's side of the network: one connection to a server (``connection``: bounds from ``deadlines``, failures
in ``failures``, reached through an ``endpoint``), the remote verifier over it (``remote``), the API baseline
(``api``), the heartbeat and the link monitor (``link``)."""
