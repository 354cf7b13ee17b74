"""The ZMQ link between a node's watchdog and the driver-side coordinator (DESIGN.md, "Agent").

`protocol`, the wire messages (its docstring is the spec; docs/protocol.md); `keys`, the CURVE
keypairs (`rollout-watchdog keygen`); `link`, the node's side (a participant of the node
daemon's loop, on when the config names a `coordinator`); `coordinator` (with `fleet`, `relay`,
`fanout`, `security`, `journal`), the hub; `client` (with `stream` and `views`), the driver's side:
`FleetClient`, which the package root exports.
"""
