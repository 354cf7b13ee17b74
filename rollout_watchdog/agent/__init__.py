"""The ZMQ link between a node's watchdog and the driver-side coordinator (DESIGN.md, "Agent").

So far: `keys`, the CURVE keypairs (`rollout-watchdog keygen`). The link itself, the
coordinator and `FleetClient` are issue 6's next parts.
"""
