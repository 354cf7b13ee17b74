"""The ZMQ link between a node's watchdog and the driver-side coordinator (DESIGN.md, "Agent").

So far: `protocol`, the wire messages (its docstring is the spec; docs/protocol.md), and `keys`,
the CURVE keypairs (`rollout-watchdog keygen`). The node link, the coordinator and `FleetClient`
are issue 6's next parts.
"""
