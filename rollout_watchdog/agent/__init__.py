"""The transport between the node daemons and the coordinator (DESIGN.md, "Agent").

`link`, the node's side (a participant of the node daemon's loop, on when the config names a
`coordinator`); `hub_socket` and `security`, the coordinator's ROUTER and its CURVE allowlist;
`relay`, `journal` and `fanout`, the delivery of events up and of commands down. The wire messages
are in `rollout_watchdog.common.protocol`. Nothing here imports the refit bridge or the node core.
"""
