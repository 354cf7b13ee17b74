"""Human-readable views of status and events."""

from __future__ import annotations

import json
import time
from typing import Any


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    seconds = max(0.0, now - ts)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def status_table(status: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    fleet = any("serving" in e for e in status["engines"])   # the coordinator's view
    header = ("ENGINE", "STATE", "PROBES", "PID", "INC", "RESTARTS", "SINCE",
              *(("WEIGHTS",) if fleet else ()), "LAST FAILURE")
    rows: list[tuple[str, ...]] = [header]
    for e in status["engines"]:
        state = e["state"]
        if e.get("deferred_waiting"):
            state += " (deferred)"
        elif e.get("next_launch"):
            state += f" ({max(0.0, e['next_launch'] - now):.1f}s)"
        failure = e.get("last_failure")
        failure_text = (f"{failure['cause']}: {failure['detail']} ({_ago(failure['ts'], now)})"
                        if failure else "-")
        probes = "paused" if e["paused"] else "active" if e["pid"] else "-"
        name = e["id"] + (" (ext)" if e.get("external") else "") + (
            " (launched)" if e.get("origin") == "launched" else "")
        rows.append((name, state, probes,
                     str(e["pid"] or "-"), str(e["incarnation"]), str(e["restarts"]),
                     _ago(e.get("since"), now), *((_weights(e),) if fleet else ()),
                     failure_text))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = [f"node {status['node_id']}: {len(status['engines'])} engine(s)"]
    for row in rows:
        cells = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
        lines.append(f"{cells}  {row[-1]}")
    return "\n".join(lines)


def _weights(engine: dict[str, Any]) -> str:
    """What the refit bridge knows of an engine's weights: the version its incarnation holds
    and whether it serves (in the router), or pending for an incarnation no refit reached."""
    version = engine.get("weight_version")
    if version is None:
        return "from disk" if engine.get("serving") else "pending"
    return f"{version}" + ("" if engine.get("serving") else " (out)")


def event_line(event: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    stamp += f".{int((event['ts'] % 1) * 1000):03d}"
    who = event.get("engine") or "-"
    if event.get("incarnation") is not None:
        who += f"#{event['incarnation']}"
    what = f"{event['from']} -> {event['to']}" if event["kind"] == "state" else event["kind"]
    cause = f" [{event['cause']}]" if event.get("cause") else ""
    detail = f" {event['detail']}" if event.get("detail") else ""
    return f"{stamp} {event['node_id']} {who:<10} {what}{cause}{detail}"


def result_line(result: Any) -> str:
    """One readable line for a control command's result."""
    if isinstance(result, dict) and "action" in result:
        return f"{result['engine']}: {result['action']}"
    if isinstance(result, dict) and "paused" in result:
        until = time.strftime("%H:%M:%S", time.localtime(result["deadline"]))
        return f"deep probes paused until {until}: {', '.join(result['paused']) or 'no engine'}"
    if isinstance(result, dict) and "resumed" in result:
        return f"deep probes resumed: {', '.join(result['resumed']) or 'none were paused'}"
    return json.dumps(result)


def fleet_table(fleet: dict[str, Any], now: float | None = None) -> str:
    """The coordinator's fleet view: each node's engine table under a line on its link."""
    now = time.time() if now is None else now
    blocks = []
    for node in fleet["nodes"]:
        lines = status_table(node, now).splitlines()
        seen = _ago(node.get("last_seen"), now)
        lines[0] += (f", reachable (heard {seen})" if node["reachable"]
                     else f", UNREACHABLE (last heard {seen}; states as last heard)")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "no nodes have joined the coordinator"
