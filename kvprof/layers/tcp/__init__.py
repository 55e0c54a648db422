"""The tcp layer: the traced processes' TCP bytes, per peer."""
from __future__ import annotations

from kvprof.layers.layer import Layer

LAYER = Layer(
    "tcp", 3, device=False,
    help="the traced processes' TCP bytes, per peer",
    tracepoints=("sock/sock_send_length", "sock/sock_recv_length", "sock/inet_sock_set_state"),
)
