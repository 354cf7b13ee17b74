"""The emulator behaves like an SGLang 0.5.23 server, and its faults do what they say.

Every test runs the emulator as a real subprocess (its own session) on a free port and kills it
(and any orphan) afterwards. Waits are polls with deadlines; a "does not happen" check is bounded
by a short join or by a request that itself takes the health-check timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import requests

from rollout_watchdog.common import ports
from rollout_watchdog.emulator import build_parser
from rollout_watchdog.emulator.common import NO_MODEL_ENV
from rollout_watchdog.emulator.testing import (
    emulator_command,
    emulator_info,
    free_port,
    inject_fault,
    pid_alive,
    port_open,
    start_emulator,
    stop_emulator,
    wait_until,
)

FAST_HEALTH = {"SGLANG_HEALTH_CHECK_TIMEOUT": "1"}
PROMPT = "The quick brown fox"


@dataclass
class Emu:
    """A running emulator under test."""

    proc: Any
    port: int
    orphans: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 10.0) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def generate(self, text: str = PROMPT, max_new_tokens: int = 8, **extra: Any) -> Any:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                  "temperature": 0}, **extra}
        resp = self.post("/generate", body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def info(self) -> dict[str, Any]:
        return emulator_info(self.url)


def _start(*args: str, env: dict[str, str] | None = None, wait: str = "health") -> Emu:
    port = free_port()
    return Emu(start_emulator(port, *args, env=env, wait=wait, timeout=60), port)


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Factory for dedicated emulators; all of them (and their orphans) die at teardown. A test
    of the process's life alone passes --no-model (no torch in the scheduler: ~1.5 s of CPU
    less); one that compares what it generates keeps the model."""
    started: list[Emu] = []

    def _spawn(*args: str, env: dict[str, str] | None = None, wait: str = "health") -> Emu:
        emu = _start(*args, env=env, wait=wait)
        started.append(emu)
        return emu

    yield _spawn
    for emu in started:
        stop_emulator(emu.proc, extra_pids=emu.orphans)


@pytest.fixture(scope="module")
def emu() -> Iterator[Emu]:
    """One shared emulator for the tests that leave it healthy."""
    shared = _start("--enable-metrics", "--enable-memory-saver", "--token-latency-ms", "5",
                    env=FAST_HEALTH)
    yield shared
    stop_emulator(shared.proc)


class Background:
    """Runs a blocking call in a thread and keeps its result or exception."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn: Any, args: Any, kwargs: Any) -> None:
        try:
            self.result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not finish in time"
        if self.error is not None:
            raise self.error
        return self.result


def _long_generate(emu: Emu, tokens: int = 3000) -> Background:
    """A generate that runs for seconds; returns once the engine has it in flight."""
    bg = Background(emu.post, "/generate",
                    {"text": "long", "sampling_params": {"max_new_tokens": tokens}}, 60)
    wait_until(lambda: emu.info()["num_inflight"] >= 1, 10, what="request in flight")
    return bg


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


# ---- the shared emulator ------------------------------------------------------------------


def test_cli_parser_is_reusable() -> None:
    args = build_parser().parse_args(["--port", "1234", "--nccl-port", "5678"])
    assert (args.port, args.nccl_port, args.dead_scheduler) == (1234, 5678, "exit")
    assert args.weight_version == "default" and args.model_path == "emulator/tiny"


def test_health_info_and_errors(emu: Emu) -> None:
    assert emu.get("/health").status_code == 200
    assert emu.get("/health_generate").status_code == 200
    assert emu.get("/ready").status_code == 200
    info = emu.get("/model_info").json()
    assert info["model_path"] == "emulator/tiny" and info["is_generation"] is True
    assert info["weight_version"] == "default" and info["tokenizer_path"] == "emulator/tiny"
    assert emu.get("/get_model_info").json() == info
    server_info = emu.get("/server_info").json()
    assert server_info["version"] == "0.5.23" and server_info["port"] == emu.port
    assert emu.get("/get_server_info").status_code == 200
    private = emu.info()
    assert private["pid"] == emu.proc.pid and private["scheduler_pid"] != emu.proc.pid
    assert private["torch_imported"] is False  # torch lives in the scheduler child only
    assert pid_alive(private["scheduler_pid"])
    missing = emu.get("/no_such_path")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    bad = requests.post(emu.url + "/generate", data=b"{not json", timeout=5)
    assert bad.status_code == 400 and "JSON decode error" in bad.json()["message"]
    assert emu.post("/health").status_code == 405
    no_input = emu.post("/generate", {"sampling_params": {}})
    assert no_input.status_code == 400 and "input_ids" in no_input.json()["error"]["message"]


def test_generate_shape_and_determinism(emu: Emu) -> None:
    first = emu.generate(max_new_tokens=12, rid="req-1")
    assert set(first) == {"text", "output_ids", "meta_info"}
    meta = first["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == len(first["output_ids"]) == 12
    assert meta["prompt_tokens"] == len(PROMPT.encode())
    assert meta["weight_version"] == "default" and meta["e2e_latency"] >= 0
    assert isinstance(first["text"], str)
    assert emu.generate(max_new_tokens=12)["output_ids"] == first["output_ids"]
    by_ids = emu.post("/generate", {"input_ids": list(PROMPT.encode()),
                                    "sampling_params": {"max_new_tokens": 12}}).json()
    assert by_ids["output_ids"] == first["output_ids"]
    batch = emu.post("/generate", {"text": [PROMPT, "other"],
                                   "sampling_params": {"max_new_tokens": 3}}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == first["output_ids"][:3]
    default = emu.post("/generate", {"text": PROMPT}).json()
    assert default["meta_info"]["completion_tokens"] == 16  # default max_new_tokens


def test_streaming(emu: Emu) -> None:
    resp = requests.post(emu.url + "/generate", json={
        "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 5}},
        stream=True, timeout=30)
    assert resp.status_code == 200
    events = [line for line in resp.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == 5


def test_metrics_count_generated_tokens(emu: Emu) -> None:
    before = emu.get("/metrics")
    assert before.status_code == 200
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput"):
        _metric(before.text, name)
    tokens = _metric(before.text, "sglang:generation_tokens_total")
    emu.generate(max_new_tokens=7)
    emu.get("/health_generate")  # health probes do not count as generated tokens
    after = _metric(emu.get("/metrics").text, "sglang:generation_tokens_total")
    assert after == tokens + 7


def test_pause_abort_aborts_inflight_request(emu: Emu) -> None:
    bg = _long_generate(emu)
    resp = emu.post("/pause_generation", {"mode": "abort"})
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    try:
        out = bg.join(10)
        assert out.status_code == 200
        meta = out.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < 3000
        assert emu.info()["num_inflight"] == 0  # pause(abort) answered after the drain
        assert emu.get("/ready").status_code == 503
    finally:
        assert emu.post("/continue_generation", {}).status_code == 200
    assert emu.get("/ready").status_code == 200


def test_paused_generate_blocks_until_continue(emu: Emu) -> None:
    assert emu.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        bg = Background(emu.generate, max_new_tokens=4)
        bg.thread.join(0.5)
        assert bg.thread.is_alive(), "a request made while paused must block"
        started = time.monotonic()
        assert emu.get("/health_generate").status_code == 503  # a paused engine fails probes
        assert time.monotonic() - started >= 0.9
    finally:
        assert emu.post("/continue_generation", {}).status_code == 200
    out = bg.join(10)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert emu.get("/health_generate").status_code == 200


def test_pause_needs_a_body(emu: Emu) -> None:
    empty = requests.post(emu.url + "/pause_generation", timeout=5)
    assert empty.status_code == 400 and "message" in empty.json()
    assert emu.post("/pause_generation", {"mode": "nap"}).status_code == 400
    assert emu.get("/ready").status_code == 200  # neither paused the engine


def test_flush_cache_refused_while_busy(emu: Emu) -> None:
    assert emu.post("/flush_cache").status_code == 200
    bg = _long_generate(emu)
    assert emu.post("/flush_cache").status_code == 400
    assert emu.post("/abort_request", {"rid": "", "abort_all": True}).status_code == 200
    assert bg.join(10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert emu.post("/flush_cache").status_code == 200
    bg = Background(emu.generate, max_new_tokens=40)
    wait_until(lambda: emu.info()["num_inflight"] >= 1, 10, what="request in flight")
    assert emu.post("/flush_cache?timeout=20").status_code == 200  # waits for idle
    bg.join(10)


def test_release_and_resume_memory(emu: Emu) -> None:
    reference = emu.generate()["output_ids"]
    resp = emu.post("/release_memory_occupation", {"tags": None})
    assert resp.status_code == 200 and resp.json() is None
    try:
        assert emu.info()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
        assert emu.get("/health_generate").status_code == 503  # the probe is swallowed
    finally:
        resp = emu.post("/resume_memory_occupation", {"tags": None})
        assert resp.status_code == 200 and resp.json() is None
    assert emu.get("/health_generate").status_code == 200
    assert emu.generate()["output_ids"] == reference  # weights are back


def test_update_weight_version(emu: Emu) -> None:
    resp = emu.post("/update_weight_version", {"new_version": "step-7",
                                                "abort_all_requests": True})
    assert resp.status_code == 200 and resp.json()["success"] is True
    try:
        assert emu.get("/model_info").json()["weight_version"] == "step-7"
        assert emu.generate()["meta_info"]["weight_version"] == "step-7"
    finally:
        emu.post("/update_weight_version", {"new_version": "default"})
    assert emu.post("/update_weight_version", {}).status_code == 400


def test_stall_generation(emu: Emu) -> None:
    inject_fault(emu.url, "stall_generation")
    try:
        started = time.monotonic()
        assert emu.get("/health_generate").status_code == 503
        assert time.monotonic() - started >= 0.9  # SGLANG_HEALTH_CHECK_TIMEOUT=1
        assert emu.get("/model_info", timeout=10).status_code == 200  # HTTP loop alive
        with pytest.raises(requests.exceptions.ReadTimeout):
            emu.post("/generate", {"text": "x"}, timeout=0.5)
        assert emu.info()["faults"]["stall_generation"] is True
    finally:
        inject_fault(emu.url, "unstall")
    assert emu.get("/health_generate").status_code == 200


def test_unknown_fault_is_400(emu: Emu) -> None:
    resp = emu.post("/_emulator/fault", {"fault": "meteor"})
    assert resp.status_code == 400 and "unknown fault" in resp.json()["error"]["message"]


# ---- dedicated emulators -----------------------------------------------------------------


def test_exit_code_at_once(spawn: Any) -> None:
    emu = spawn("--exit-code", "3", wait="none")
    assert emu.proc.wait(15) == 3


def test_dead_scheduler_exit_tears_server_down(spawn: Any) -> None:
    emu = spawn("--no-model")
    inject_fault(emu.url, "crash_scheduler")
    code = emu.proc.wait(30)   # (a zombie keeps serving: it would never exit)
    assert code == -signal.SIGKILL  # SGLang kills its own tree, itself last


def test_dead_scheduler_zombie_keeps_http(spawn: Any) -> None:
    emu = spawn("--no-model", "--dead-scheduler", "zombie",
                env={**FAST_HEALTH, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"})
    # Memory saver is off: release/resume are refused.
    assert emu.post("/release_memory_occupation", {"tags": None}).status_code == 400
    assert emu.post("/resume_memory_occupation", {"tags": None}).status_code == 400
    scheduler = emu.info()["scheduler_pid"]
    inject_fault(emu.url, "crash_scheduler")
    wait_until(lambda: not pid_alive(scheduler), 5, what="scheduler death")
    assert emu.get("/health_generate").status_code == 503  # takes the 1 s timeout
    assert emu.get("/health").status_code == 200  # generation-free /health (env)
    assert emu.get("/model_info").status_code == 200
    with pytest.raises(requests.exceptions.ReadTimeout):
        emu.post("/generate", {"text": "x"}, timeout=0.5)
    assert emu.proc.poll() is None  # > 1 s after the death: no teardown in zombie mode


def test_crash_kills_main_and_orphan_survives(spawn: Any) -> None:
    emu = spawn("--no-model", "--orphan")
    # --orphan acts once the server is ready, a moment after its port answers.
    wait_until(lambda: emu.info()["orphan_pids"], 10, what="the orphan spawned")
    info = emu.info()
    emu.orphans.extend(info["orphan_pids"])
    assert len(emu.orphans) == 1 and pid_alive(emu.orphans[0])
    inject_fault(emu.url, "crash")
    assert emu.proc.wait(10) == -signal.SIGKILL
    wait_until(lambda: not pid_alive(info["scheduler_pid"]), 5, what="scheduler PDEATHSIG")
    assert pid_alive(emu.orphans[0])
    assert os.getsid(emu.orphans[0]) == emu.orphans[0]  # its own session


def test_release_while_busy_kills_server(spawn: Any) -> None:
    emu = spawn("--enable-memory-saver", "--token-latency-ms", "5")
    bg = _long_generate(emu)
    with pytest.raises(requests.exceptions.ConnectionError):
        emu.post("/release_memory_occupation", {"tags": None})
    assert emu.proc.wait(10) == -signal.SIGKILL
    with pytest.raises(requests.exceptions.ConnectionError):
        bg.join(10)


def test_ignore_sigterm_then_hang_http(spawn: Any) -> None:
    emu = spawn("--no-model", "--ignore-sigterm", env=FAST_HEALTH)
    scheduler = emu.info()["scheduler_pid"]
    os.killpg(emu.proc.pid, signal.SIGTERM)  # main process and scheduler both get it
    assert emu.get("/health_generate").status_code == 200  # not draining, scheduler alive
    assert emu.proc.poll() is None and pid_alive(scheduler)
    assert emu.info()["faults"]["ignore_sigterm"] is True
    inject_fault(emu.url, "hang_http")
    assert port_open(emu.port)  # connections are still accepted...
    with pytest.raises(requests.exceptions.ReadTimeout):
        emu.get("/model_info", timeout=0.5)  # ...but never answered
    with pytest.raises(requests.exceptions.ReadTimeout):
        emu.get("/_emulator/info", timeout=0.5)


def test_sigterm_drains_then_exits_zero(spawn: Any, emu: Emu) -> None:
    mine = spawn("--token-latency-ms", "5")
    assert mine.generate(max_new_tokens=12)["output_ids"] == \
        emu.generate(max_new_tokens=12)["output_ids"]  # same weights in every process
    bg = Background(mine.post, "/generate",
                    {"text": "drain", "sampling_params": {"max_new_tokens": 300}}, 60)
    wait_until(lambda: mine.info()["num_inflight"] >= 1, 10, what="request in flight")
    os.kill(mine.proc.pid, signal.SIGTERM)
    wait_until(lambda: mine.info()["draining"], 5, what="drain start")
    assert mine.get("/health_generate").status_code == 503
    assert mine.get("/ready").status_code == 503
    out = bg.join(30)
    assert out.status_code == 200
    assert out.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert mine.proc.wait(10) == 0


def test_startup_delay_binds_port_late(spawn: Any) -> None:
    started = time.monotonic()
    emu = spawn("--no-model", "--startup-delay", "1.5", wait="none")
    wait_until(lambda: port_open(emu.port) or emu.proc.poll() is not None, 30, interval=0.05,
               what="port bound")
    assert emu.proc.poll() is None
    assert time.monotonic() - started >= 1.5
    wait_until(lambda: emu.get("/health_generate").status_code == 200, 30, what="healthy")


def test_no_model_starts_without_torch_generates_and_refuses_weight_updates(spawn: Any) -> None:
    """--no-model (the test suite's speed knob): no torch in either process, placeholder text
    by the usual rules (length, determinism), and a weight update refused, naming the flag."""
    emu = spawn("--no-model", "--enable-memory-saver")
    first = emu.generate(max_new_tokens=12)
    assert len(first["output_ids"]) == 12 and first["text"].isprintable()
    assert emu.generate(max_new_tokens=12)["output_ids"] == first["output_ids"]
    assert emu.post("/release_memory_occupation", {"tags": None}).status_code == 200
    assert emu.post("/resume_memory_occupation", {"tags": None}).status_code == 200
    resp = emu.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 2, "backend": "gloo"})
    assert resp.status_code == 400 and "--no-model" in resp.json()["message"], resp.text
    scheduler = psutil.Process(emu.proc.pid).children()
    assert not any("torch" in m.path for p in [emu.proc.pid, *(c.pid for c in scheduler)]
                   for m in psutil.Process(p).memory_maps())


def test_emulator_command_adds_no_model_only_when_the_suite_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NO_MODEL_ENV, raising=False)
    assert "--no-model" not in emulator_command(1)
    monkeypatch.setenv(NO_MODEL_ENV, "1")
    assert emulator_command(1, "--x")[-2:] == ["--no-model", "--x"]


def test_free_ports_are_never_repeated_and_avoid_the_ephemeral_range() -> None:
    """A test starts several servers on ports it picked first: two picks must never be the
    same, nor one that an outgoing connection (ephemeral range) could take meanwhile."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    picked = [free_port() for _ in range(1000)]
    assert len(set(picked)) == len(picked)
    if ephemeral > 20_000:
        assert max(picked) < ephemeral
    # nor a port engines and trainers take by default (SGLang's 30000 + i, torch's 29500): a
    # Ray node's metrics port there made a later engine's launch refused
    assert not [p for p in picked if 29_500 <= p < 29_600 or 30_000 <= p < 31_000]


def test_pytest_xdist_workers_pick_ports_from_slices_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two test workers are two processes: each remembers only its own picks, so each picks
    from a slice of the range that the other never touches."""
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        slices.append(ports._port_range())
        assert all(slices[-1][0] <= free_port() <= slices[-1][1] for _ in range(20))
    (low0, top0), (low1, top1) = slices
    assert low0 <= top0 < low1 <= top1


def test_the_cli_subcommand_runs_the_emulator_with_its_fault_options() -> None:
    """`rollout-watchdog emulator --port P [fault options]` (the contract's way to start one):
    it serves, and a fault option acts (--crash-after: it SIGKILLs itself, its scheduler
    child with it)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "emulator", "--port",
                             str(port), "--no-model", "--crash-after", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{url}/health"), 60, what="the emulator's /health")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no scheduler child"
        assert proc.wait(60) == -signal.SIGKILL
        psutil.wait_procs(children, timeout=10)
        assert not [c for c in children if c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE], "the scheduler outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
