"""The emulator's weight-update endpoints, against a real trainer (rank 0) in this process.

Engines are real emulator processes; the trainer builds its side of the gloo group with the same
init_custom_process_group while the engines' HTTP calls are in flight (SGLANG.md: send the calls
concurrently, run the trainer's side, then await the answers).
"""

from __future__ import annotations

import datetime
import functools
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from rollout_watchdog.common.torch_group import (
    destroy_process_group,
    init_custom_process_group,
)
from rollout_watchdog.emulator.testing import (
    emulator_info,
    free_port,
    http_request,
    inject_fault,
    start_emulator,
    stop_emulator,
    wait_until,
)

torch = pytest.importorskip("torch")
from rollout_watchdog.emulator.model import build_model  # noqa: E402 - needs torch

PROMPT = "The quick brown fox"
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
CALL_TIMEOUT = 60.0
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache.")
NO_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
              "end_weight_update()")


def healthy(url: str) -> bool:
    return http_request(url + "/health_generate")[0] == 200


class Engines:
    """Emulators under test, and a thread pool for their concurrent HTTP calls."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.pool = ThreadPoolExecutor(8)

    def start(self, *argsets: tuple[str, ...]) -> list[str]:
        """Start emulators (concurrently: each loads torch); their base URLs."""
        ports = [free_port() for _ in argsets]
        procs = [start_emulator(p, *a, wait="none") for p, a in zip(ports, argsets, strict=True)]
        self.procs += procs
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_until(functools.partial(healthy, url), 60, interval=0.1,
                       what=f"{url} healthy")
        return urls

    def call(self, urls: list[str], path: str, body: Any) -> list[Future[tuple[int | None, Any]]]:
        """POST to every engine at once; futures of (status, json)."""
        def one(url: str) -> tuple[int | None, Any]:
            status, raw = http_request(url + path, "POST", body, timeout=CALL_TIMEOUT)
            return status, json.loads(raw) if raw else None
        return [self.pool.submit(one, url) for url in urls]

    def close(self) -> None:
        for proc in self.procs:
            stop_emulator(proc)
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    e = Engines()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def fleet(engines: Engines) -> list[str]:
    """Two 0.5.23 engines and one 0.5.12 engine, started together."""
    return engines.start((), (), ("--sglang-version", "0.5.12"))


def results(futures: list[Future[tuple[int | None, Any]]]) -> list[tuple[int | None, Any]]:
    return [f.result(timeout=CALL_TIMEOUT + 5) for f in futures]


def post(url: str, path: str, body: Any) -> tuple[int | None, Any]:
    status, raw = http_request(url + path, "POST", body, timeout=CALL_TIMEOUT)
    return status, json.loads(raw) if raw else None


def generate(url: str) -> dict[str, Any]:
    status, raw = http_request(url + "/generate", "POST", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        timeout=CALL_TIMEOUT)
    assert status == 200, raw
    return dict(json.loads(raw))


def weights(seed: int) -> list[tuple[str, Any]]:
    """A full set of TinyLM parameters, different per seed, in named_parameters order."""
    return [(n, p.detach().clone()) for n, p in build_model(seed).named_parameters()]


def meta(named: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def build_group(engines: Engines, urls: list[str], name: str = "weight_update_group") -> Any:
    """The engines' init calls in flight, then the trainer joins as rank 0; all must succeed."""
    port = free_port()
    calls = [engines.call([url], "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1 + i,
        "world_size": 1 + len(urls), "group_name": name, "backend": "gloo"})[0]
        for i, url in enumerate(urls)]
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", GROUP_TIMEOUT,
                                   1 + len(urls), 0, name)
    for status, answer in results(calls):
        assert (status, answer) == (200, {
            "success": True, "message": "Succeeded to initialize custom process group."})
    return pg


def update(engines: Engines, urls: list[str], pg: Any, body: dict[str, Any],
           send: Callable[[], None]) -> list[tuple[int | None, Any]]:
    """One update: the engines' calls in flight, then the trainer's broadcasts, then answers."""
    calls = engines.call(urls, "/update_weights_from_distributed", body)
    send()
    return results(calls)


def broadcast_each(pg: Any, named: list[tuple[str, Any]]) -> Callable[[], None]:
    def send() -> None:
        for _, tensor in named:
            torch.distributed.broadcast(tensor, src=0, group=pg)
    return send


def broadcast_flat(pg: Any, named: list[tuple[str, Any]]) -> Callable[[], None]:
    """SGLang's flattened bucket: every tensor's bytes back to back, in names order."""
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
    return lambda: torch.distributed.broadcast(flat, src=0, group=pg)


def test_refit_changes_outputs_identically_on_every_engine(
    engines: Engines, fleet: list[str]
) -> None:
    urls = fleet[:2]
    before = [generate(u) for u in urls]
    assert before[0]["output_ids"] == before[1]["output_ids"]
    assert before[0]["meta_info"]["weight_version"] == "default"
    pg = build_group(engines, urls)
    try:
        for url in urls:
            assert post(url, "/begin_weight_update", {}) == (
                200, {"success": True, "message": "Success"})
        v1 = weights(1)
        answers = update(engines, urls, pg, {**meta(v1), "weight_version": "v1"},
                         broadcast_each(pg, v1))
        assert answers == [(200, {"success": True, "message": (
            "Succeeded to update parameter online. Weight version updated to v1.")})] * 2
        for url in urls:
            assert post(url, "/end_weight_update", {}) == (
                200, {"success": True, "message": "Success"})
        after = [generate(u) for u in urls]
        assert after[0]["output_ids"] == after[1]["output_ids"] != before[0]["output_ids"]
        assert [a["meta_info"]["weight_version"] for a in after] == ["v1", "v1"]
        assert not emulator_info(urls[0])["torch_imported"]  # the main process stays light
        for url in urls:
            status, raw = http_request(url + "/model_info")
            assert status == 200 and json.loads(raw)["weight_version"] == "v1"

        # The same group again, one flattened bucket carrying every tensor.
        for url in urls:
            assert post(url, "/begin_weight_update", {})[0] == 200
        v2 = weights(2)
        answers = update(engines, urls, pg, {**meta(v2), "weight_version": "v2",
                                             "load_format": "flattened_bucket"},
                         broadcast_flat(pg, v2))
        assert [a[0] for a in answers] == [200, 200], answers
        outs = [generate(u)["output_ids"] for u in urls]
        assert outs[0] == outs[1] != after[0]["output_ids"]

        # Without a name the model has, the tensor is received, then refused (partial load).
        bogus = [("no_such.weight", torch.ones(3))]
        answers = update(engines, urls, pg, meta(bogus), broadcast_each(pg, bogus))
        for status, answer in answers:
            assert status == 400 and answer["success"] is False
            assert answer["message"].startswith("Failed to update parameter online: "
                                                "'no_such.weight'")
        for url in urls:
            assert post(url, "/end_weight_update", {})[0] == 200

        # Outside a session an update is refused without joining: no broadcast is pending,
        # so a later bracketed update still lines up with the trainer's broadcasts.
        assert post(urls[0], "/update_weights_from_distributed", meta(v1)) == (
            400, {"success": False, "message": NO_SESSION})
        for url in urls:
            assert post(url, "/begin_weight_update", {})[0] == 200
        answers = update(engines, urls, pg, {**meta(v1), "weight_version": "v1b"},
                         broadcast_each(pg, v1))
        assert [a[0] for a in answers] == [200, 200], answers
        assert generate(urls[0])["output_ids"] == after[0]["output_ids"]  # v1's weights again
        for url in urls:
            assert post(url, "/end_weight_update", {})[0] == 200
    finally:
        for url in urls:
            status, answer = post(url, "/destroy_weights_update_group",
                                  {"group_name": "weight_update_group"})
            assert (status, answer) == (200, {
                "success": True, "message": "Succeeded to destroy custom process group."})
        destroy_process_group(pg)


def test_misuse_answers_400_with_sglang_messages(fleet: list[str]) -> None:
    url = fleet[0]
    assert post(url, "/destroy_weights_update_group", {"group_name": "nope"}) == (
        400, {"success": False, "message": "The group to be destroyed does not exist."})
    assert post(url, "/end_weight_update", {}) == (400, {"success": False, "message": (
        "no weight-update session is open; call begin_weight_update() first")})
    assert post(url, "/begin_weight_update", {})[0] == 200
    try:
        assert post(url, "/begin_weight_update", {}) == (400, {"success": False, "message": (
            "a weight-update session is already open; call end_weight_update() first")})
        status, answer = post(url, "/update_weights_from_distributed",
                              {"names": ["mlp.bias"], "dtypes": ["float32"], "shapes": [[64]],
                               "group_name": "nope"})
        assert status == 400 and answer == {"success": False, "message": (
            "Failed to receive weights: Group nope not in []. "
            "Please call `init_weights_update_group` first.")}
    finally:
        assert post(url, "/end_weight_update", {})[0] == 200
    status, answer = post(url, "/update_weights_from_distributed", {"names": ["mlp.bias"]})
    assert status == 400 and "'dtypes'" in answer["message"] and "Field required" in (
        answer["message"])
    status, answer = post(url, "/update_weights_from_distributed",
                          {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]})
    assert status == 400 and "same length (got 2, 1, 1)" in answer["error"]["message"]


def test_update_while_paused_in_place_cannot_flush(engines: Engines, fleet: list[str]) -> None:
    """0.5.22+: the weights load, but the flush a running request prevents fails the call."""
    url = fleet[0]
    (long_request,) = engines.call([url], "/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    wait_until(lambda: emulator_info(url)["num_inflight"] == 1, 30, what="request running")
    assert post(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    pg = build_group(engines, [url], "flush_group")
    try:
        assert post(url, "/begin_weight_update", {})[0] == 200
        v5 = weights(5)
        answers = update(engines, [url], pg, {**meta(v5), "group_name": "flush_group",
                                              "weight_version": "v5"}, broadcast_each(pg, v5))
        assert answers == [(400, {"success": False, "message": FLUSH_REFUSED})]
        assert post(url, "/end_weight_update", {})[0] == 200
        assert post(url, "/continue_generation", {})[0] == 200
        status, answer = long_request.result(timeout=CALL_TIMEOUT)
        assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length"
        assert generate(url)["meta_info"]["weight_version"] != "v5"  # the call failed
    finally:
        assert post(url, "/destroy_weights_update_group", {"group_name": "flush_group"})[0] == 200
        destroy_process_group(pg)


def test_old_version_has_no_session(engines: Engines, fleet: list[str]) -> None:
    url = fleet[2]
    status, raw = http_request(url + "/server_info")
    assert status == 200 and json.loads(raw)["version"] == "0.5.12"
    assert post(url, "/begin_weight_update", {}) == (404, {"detail": "Not Found"})
    pg = build_group(engines, [url], "old_group")
    try:
        v3 = weights(3)
        answers = update(engines, [url], pg, {**meta(v3), "group_name": "old_group",
                                              "weight_version": "v3"}, broadcast_each(pg, v3))
        assert [a[0] for a in answers] == [200], answers
        assert generate(url)["meta_info"]["weight_version"] == "v3"
    finally:
        assert post(url, "/destroy_weights_update_group", {"group_name": "old_group"})[0] == 200
        destroy_process_group(pg)


def test_hang_fault_wedges_the_update_while_health_passes(
    engines: Engines, fleet: list[str]
) -> None:
    """Last in this module: the engine stays wedged until the module's engines are killed."""
    url = fleet[2]
    assert inject_fault(url, "hang_weight_update")["stage"] == "join"
    assert emulator_info(url)["faults"]["hang_weight_update"] == "join"
    pg = build_group(engines, [url], "wedged_group")
    try:
        (call,) = engines.call([url], "/update_weights_from_distributed",
                               {**meta(weights(4)), "group_name": "wedged_group"})
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        # Bounded "does not happen" check: while /health keeps passing, no answer comes.
        for _ in range(3):
            assert http_request(url + "/health")[0] == 200
            assert http_request(url + "/health_generate")[0] == 200
            assert not done.wait(0.5)
    finally:
        destroy_process_group(pg)  # nothing was broadcast: the trainer's side is not stuck


def test_hang_fault_after_receiving(engines: Engines, fleet: list[str]) -> None:
    """Stage finish: the engine takes part in the broadcast (rank 0 completes), never answers."""
    url = fleet[1]
    inject_fault(url, "hang_weight_update", stage="finish")
    pg = build_group(engines, [url], "finish_group")
    try:
        assert post(url, "/begin_weight_update", {})[0] == 200
        v6 = weights(6)
        (call,) = engines.call([url], "/update_weights_from_distributed",
                               {**meta(v6), "group_name": "finish_group"})
        broadcast_each(pg, v6)()  # returns: the engine received every tensor
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        for _ in range(2):
            assert http_request(url + "/health")[0] == 200
            assert not done.wait(0.5)
        # Control calls queue behind the wedged one: a destroy never answers either.
        status, _ = http_request(url + "/destroy_weights_update_group", "POST",
                                 {"group_name": "finish_group"}, timeout=1.0)
        assert status is None
    finally:
        destroy_process_group(pg)
