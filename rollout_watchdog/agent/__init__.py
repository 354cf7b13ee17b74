"""The ZMQ link between a node's watchdog and the driver-side coordinator (DESIGN.md, "Agent").

Not built yet: the node daemon runs alone until this package lands (see the open issues).
"""
