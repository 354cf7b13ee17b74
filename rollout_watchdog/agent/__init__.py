"""The transport between the node daemons and the coordinator (DESIGN.md, "Agent").

`link`, the node's side (a participant of the node daemon's loop, on when the config names a
`coordinator`); `hub`, the coordinator's side: its ROUTER (`hub_socket`, with `security` for the
CURVE allowlist) and loop, served by `hub_thread` and driven over an inproc pipe (`pipe`), its
policy handed in as `hub_policy` types it; `relay`, `journal` and `fanout`, the delivery of events
up and of commands down. The wire messages are in `rollout_watchdog.common.protocol`. Nothing
here imports the refit bridge or the node core.
"""
