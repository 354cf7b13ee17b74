"""A training loop on the refit bridge, runnable on one CPU machine (docs/refit.md, section 2).

    python examples/train_loop.py [--steps 5] [--kill-at 2]

It starts what a cluster would run, all on this machine and all as real processes:

- the coordinator (embedded in this process, as a driver embeds it), with CURVE keys made by
  `rollout-watchdog keygen` in a temporary directory;
- the real `sglang-router`, whose membership the coordinator owns;
- 2 node daemons (`rollout-watchdog run --config ...`), each with 2 emulated SGLang engines
  that take this loop's own model (`--weight-spec FILE`, written by `write_weight_spec`).

Then it trains a small torch model for a few steps. Each step generates rollouts through the
router, trains, and refits every engine with `fleet.refit()` over a gloo weight-update group
(the CPU backend; use "nccl" on GPUs), in the retry loop the guide documents. At step
`--kill-at`, an engine is SIGKILLed while the rollouts are being generated: its watchdog
relaunches it, the router drops it at once, and a later refit brings it back.

Needs `pip install 'rollout-watchdog[emulator,router]'` (torch and sglang-router; no GPU, and
not the `sglang` extra, which installs SGLang itself).
Everything it starts is stopped at the end, and its files are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout_watchdog import (
    Coordinator,
    EngineLost,
    EngineView,
    FleetClient,
    LeaseLost,
    NoMembers,
)
from rollout_watchdog.emulator import write_weight_spec

NODES, ENGINES_PER_NODE = ("node-a", "node-b"), 2
PROMPTS = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
log = logging.getLogger("train")


class Policy(nn.Module):
    """The model being trained: parameter names of its own (not the emulator's)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


def train(model: Policy, optimizer: torch.optim.Optimizer, rollouts: list[dict[str, Any]]
          ) -> float:
    """One optimizer step on a toy objective (a real loop computes it from the rollouts)."""
    x = torch.randn(len(rollouts), 16)
    target = torch.full((len(rollouts), 4), float(len(rollouts[0]["text"]) % 7))
    loss = nn.functional.mse_loss(model(x), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


# ---------------------------------------------------------------------------------- rollouts

def generate_one(router_url: str, prompt: str, attempts: int = 10) -> dict[str, Any]:
    """One rollout through the router, retried when it fails: the router retries a request
    whose engine died on another one itself, but gives up after a few tries."""
    body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 256,
                                                           "temperature": 0}}).encode()
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(f"{router_url}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                out: dict[str, Any] = json.loads(answer.read())
            out["attempts"] = attempt
            return out
        except urllib.error.HTTPError as exc:
            log.info("rollout %r, attempt %d: HTTP %s %s", prompt, attempt, exc.code,
                     exc.read()[:200].decode(errors="replace"))
        except OSError as exc:   # (URLError included) no answer from the router
            log.info("rollout %r, attempt %d: %s", prompt, attempt, exc)
        time.sleep(min(0.2 * attempt, 1.0))
    raise RuntimeError(f"rollout {prompt!r} failed {attempts} times")


def generate_through_router(router_url: str, prompts: list[str],
                            during: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every prompt through the router, 4 at a time; `during()` runs while they are sent."""
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate_one, router_url, p) for p in prompts]
        if during is not None:
            during()
        return [f.result() for f in futures]


def running_requests(url: str) -> int:
    """How many requests the engine is generating (SGLang's /server_info)."""
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as answer:
            states = json.loads(answer.read()).get("internal_states") or [{}]
    except (OSError, ValueError):
        return 0
    return int(states[0].get("num_running_reqs") or 0)


def sigkill_one_engine(fleet: FleetClient, timeout_s: float = 30.0) -> Callable[[], None]:
    """`during` for generate_through_router: SIGKILL the main process of a serving engine
    that is generating a rollout (the router's answer for that request is an error)."""
    def kill() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for engine in fleet.engines():
                if engine.serving and engine.pid and engine.url \
                        and running_requests(engine.url) > 0:
                    os.kill(engine.pid, signal.SIGKILL)
                    print(f"  SIGKILL to {engine.name} (pid {engine.pid}) during generation",
                          flush=True)
                    return
            time.sleep(0.01)
        raise TimeoutError(f"no engine was generating within {timeout_s:g} s")
    return kill


# ---------------------------------------------------------------------------------- the loop

def run_loop(fleet: FleetClient, router_url: str, steps: int, kill_at: int) -> None:
    model = Policy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    # --8<-- [start:loop]
    def refit(version: str, named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
              attempts: int = 3) -> None:
        """named_tensors() returns a fresh iterable of (name, tensor) for each attempt."""
        for attempt in range(1, attempts + 1):
            try:
                with fleet.refit(version, lease_s=30.0, timeout_s=120.0, backend="gloo",
                                 master_address="127.0.0.1") as r:   # "nccl" on GPUs
                    r.update_weights(named_tensors())
                return                                   # committed; new incarnations routed
            except EngineLost as exc:                    # died or wedged; retry without it
                log.warning("refit %s, attempt %d, lost %s", version, attempt, exc.lost)
            except LeaseLost as exc:                     # we stalled past the lease: retake it
                log.warning("refit %s, attempt %d: %s", version, attempt, exc)
            except NoMembers as exc:                     # no healthy engine: wait for one
                log.warning("refit %s, attempt %d: %s", version, attempt, exc)
                fleet.wait_until(lambda view: any(e.state == "healthy" and e.reachable
                                                  for e in view), timeout_s=600.0)
        raise RuntimeError(f"refit {version} failed {attempts} times")

    def named_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, p.detach()) for name, p in model.named_parameters())

    for step in range(1, steps + 1):
        fleet.prepare_for_generation()                   # deep probes resume (engines awake)
        fleet.wait_router_synced(timeout_s=30)           # the router lists what the view routes
        rollouts = generate_through_router(              # requests go to the router
            router_url, PROMPTS, during=sigkill_one_engine(fleet) if step == kill_at else None)
        fleet.finish_generation(deadline_s=600, timeout_s=40)   # probes pause fleet-wide
        loss = train(model, optimizer, rollouts)
        refit(str(step), named_tensors)
        report(step, rollouts, loss)
    # --8<-- [end:loop]

    # A relaunched engine joins the first refit after it is healthy again. If the SIGKILLed one
    # came back after the last refit, one more refit of the same weights catches it up.
    fleet.prepare_for_generation()
    view = fleet.wait_until(lambda v: len(v) == 4 and all(e.state == "healthy" for e in v), 120)
    if not all(e.serving for e in view):
        refit(str(steps), named_tensors)
        print(f"catch-up refit {steps}: the relaunched engine got the current weights",
              flush=True)
    final = fleet.wait_until(lambda v: all(e.serving and e.weight_version == str(steps)
                                           for e in v), 60)
    listed = fleet.wait_router_synced(timeout_s=30)
    rollouts = generate_through_router(router_url, PROMPTS)
    assert {r["meta_info"]["weight_version"] for r in rollouts} == {str(steps)}, rollouts
    print(f"done: {steps} steps; {describe(final)}; the router lists {len(listed)} engines; "
          f"every rollout at version {steps}", flush=True)


def report(step: int, rollouts: list[dict[str, Any]], loss: float) -> None:
    versions = sorted({r["meta_info"]["weight_version"] for r in rollouts})
    retried = sum(r["attempts"] > 1 for r in rollouts)
    print(f"step {step}: {len(rollouts)} rollouts at {versions} ({retried} retried), "
          f"loss {loss:.3f}, refit {step} committed", flush=True)


def describe(view: list[EngineView]) -> str:
    """`NODE/ENGINE#INCARNATION at VERSION`, with the last failure of an engine relaunched."""
    return ", ".join(
        f"{e.name}#{e.incarnation} at {e.weight_version or 'its disk weights'}" + (
            f" (last failure: {e.last_failure.get('cause')}: {e.last_failure.get('detail')})"
            if e.last_failure else "") for e in view)


# ---------------------------------------------------------------------------------- the fleet

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rollout_watchdog(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollout_watchdog", *args]


def make_keys(keys: Path) -> None:
    """The coordinator's keypair, one per node and one for the trainer; public keys of the
    nodes and the trainer let in under authorized/ (as an operator does with keygen)."""
    (keys / "authorized").mkdir(parents=True)
    for name in ("coordinator", *NODES, "trainer"):
        subprocess.run(rollout_watchdog("keygen", str(keys), name), check=True,
                       stdout=subprocess.DEVNULL)
        if name != "coordinator":
            shutil.copy(keys / f"{name}.key", keys / "authorized" / f"{name}.key")


def node_config(workdir: Path, node: str, endpoint: str, spec: Path) -> Path:
    """examples/emulator-node.toml's settings, in this run's own directory and ports."""
    engines = ""
    for i in range(ENGINES_PER_NODE):
        port = free_port()
        command = [sys.executable, "-m", "rollout_watchdog.emulator", "--port", str(port),
                   "--weight-spec", str(spec)]
        engines += (f'\n[[engine]]\nid = "e{i}"\nurl = "http://127.0.0.1:{port}"\n'
                    f"command = {json.dumps(command)}\n")
    keys = workdir / "keys"
    path = workdir / f"{node}.toml"
    path.write_text(f"""node_id = "{node}"
coordinator = "{endpoint}"
key = "{keys / f'{node}.key_secret'}"
coordinator_key = "{keys / 'coordinator.key'}"
control = "ipc://{workdir / node / 'control'}"
state_dir = "{workdir / node}"
gpu_check = "none"
engine_log = "file"

[probe]
health_interval_s = 1.0
health_timeout_s = 10.0
startup_timeout_s = 120.0

[restart]
grace_s = 5.0
backoff_initial_s = 0.5
{engines}""")
    return path


@contextlib.contextmanager
def process(argv: list[str], log_file: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own session, SIGTERMed (then SIGKILLed) with all it started at the end."""
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.1)


def router_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=2):
            return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=2, help="the step whose generation "
                        "sees an engine SIGKILLed (0: none)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)   # this loop's own retries

    workdir = Path(tempfile.mkdtemp(prefix="rw-loop-"))
    try:
        keys = workdir / "keys"
        make_keys(keys)
        spec = workdir / "policy-spec.json"   # the engines accept exactly Policy's parameters
        write_weight_spec(str(spec), Policy().named_parameters())
        router_url = f"http://127.0.0.1:{free_port()}"
        with contextlib.ExitStack() as stack:
            # The router, with its own health checks off: the coordinator owns its membership.
            stack.enter_context(process(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                 "--port", router_url.rsplit(":", 1)[1], "--prometheus-port", str(free_port()),
                 "--policy", "round_robin", "--disable-health-check",
                 "--worker-startup-timeout-secs", "10", "--log-level", "warn"],
                workdir / "router.log"))
            wait_for(lambda: router_up(router_url), 60, "sglang-router up")
            coordinator = stack.enter_context(Coordinator(
                bind="tcp://127.0.0.1:0", keys=str(keys), router_url=router_url))
            for node in NODES:
                config = node_config(workdir, node, coordinator.endpoint, spec)
                stack.enter_context(process(rollout_watchdog("run", "--config", str(config)),
                                            workdir / f"{node}.log"))
            fleet = FleetClient(coordinator.endpoint, key=str(keys / "trainer.key_secret"),
                                coordinator_key=str(keys / "coordinator.key"))
            view = fleet.wait_until(
                lambda v: len(v) == 4 and all(e.state == "healthy" for e in v), 180)
            print(f"fleet up: {describe(view)}; router {router_url}", flush=True)
            run_loop(fleet, router_url, args.steps, args.kill_at)
        return 0
    finally:
        if args.keep:
            print(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
