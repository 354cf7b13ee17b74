"""``--weight-spec``: the emulator takes a user's own model (any names and shapes), learned from
the first refit or read from a file, and then refuses unknown names and wrong shapes as SGLang
does. Real emulator processes, a real gloo group with this process as the trainer (rank 0)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_emulator_weights import (
    Engines,
    broadcast_each,
    build_group,
    generate,
    meta,
    post,
    update,
)

from rollout_watchdog.emulator import build_parser, write_weight_spec
from rollout_watchdog.emulator.weight_spec import ENV, SpecError, load_spec_file

torch = pytest.importorskip("torch")
from rollout_watchdog.common.torch_group import destroy_process_group  # noqa: E402
from rollout_watchdog.emulator.weight_sync import HeldWeights  # noqa: E402


class Policy(torch.nn.Module):  # type: ignore[misc]
    """A user's model: names the emulator's tiny model does not have."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4, bias=False)


def named(seed: int) -> list[tuple[str, Any]]:
    return [(n, p.detach().clone()) for n, p in Policy(seed).named_parameters()]


def ok(version: str | None = None) -> tuple[int, dict[str, Any]]:
    message = "Succeeded to update parameter online."
    if version is not None:
        message += f" Weight version updated to {version}."
    return 200, {"success": True, "message": message}


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "policy.json"
    write_weight_spec(str(path), Policy(0).named_parameters())
    return path


@pytest.fixture(scope="module")
def engines(spec_file: Path) -> Iterator[tuple[Engines, list[str]]]:
    """One engine in ``learn`` mode, one with the spec file."""
    e = Engines()
    try:
        yield e, e.start(("--weight-spec", "learn"), ("--weight-spec", str(spec_file)))
    finally:
        e.close()


def session(urls: list[str], path: str) -> None:
    for url in urls:
        assert post(url, path, {}) == (200, {"success": True, "message": "Success"})


def test_a_user_module_is_refit_then_unknown_names_and_shapes_fail(
    engines: tuple[Engines, list[str]]
) -> None:
    e, urls = engines
    pg = build_group(e, urls)
    try:
        # The first refit, in two buckets: `learn` takes every name until the versioned one.
        v1 = named(1)
        session(urls, "/begin_weight_update")
        assert update(e, urls, pg, meta(v1[:1]), broadcast_each(pg, v1[:1])) == [ok()] * 2
        assert update(e, urls, pg, {**meta(v1[1:]), "weight_version": "v1"},
                      broadcast_each(pg, v1[1:])) == [ok("v1")] * 2
        session(urls, "/end_weight_update")
        for url in urls:  # the tiny model still generates, at the new version
            assert generate(url)["meta_info"]["weight_version"] == "v1"

        # A second refit of the same module, in one bucket.
        v2 = named(2)
        session(urls, "/begin_weight_update")
        assert update(e, urls, pg, {**meta(v2), "weight_version": "v2"},
                      broadcast_each(pg, v2)) == [ok("v2")] * 2

        # A name the model does not have: received, then refused with SGLang's message.
        extra = [("l3.weight", torch.ones(2, 2))]
        for status, answer in update(e, urls, pg, meta(extra), broadcast_each(pg, extra)):
            assert status == 400 and answer["success"] is False
            assert answer["message"].startswith(
                "Failed to update parameter online: 'l3.weight'"), answer
        # A known name with another shape.
        wrong = [("l1.weight", torch.ones(8, 16))]
        for status, answer in update(e, urls, pg, meta(wrong), broadcast_each(pg, wrong)):
            assert status == 400 and "shape mismatch for l1.weight: received [8, 16], the " \
                "parameter is [16, 8]" in answer["message"], answer
        session(urls, "/end_weight_update")
    finally:
        for url in urls:
            post(url, "/destroy_weights_update_group", {"group_name": "weight_update_group"})
        destroy_process_group(pg)


def test_held_weights_learn_until_a_versioned_update_then_hold_the_spec() -> None:
    held = HeldWeights(None)
    held.target("a", torch.zeros(2))
    held.loaded(sets_version=False)
    held.target("b", torch.zeros(3))  # still learning: a later bucket of the first refit
    held.loaded(sets_version=True)
    assert held.spec == {"a": [2], "b": [3]} and not held.learning
    with pytest.raises(KeyError):
        held.target("c", torch.zeros(1))
    assert HeldWeights({"x": [1]}).learning is False


def test_spec_files_and_the_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "spec.json"
    write_weight_spec(str(path), named(0))
    assert load_spec_file(str(path)) == {"l1.weight": [16, 8], "l1.bias": [16],
                                         "l2.weight": [4, 16]}
    assert build_parser().parse_args(["--port", "0"]).weight_spec == "tiny"
    assert build_parser().parse_args(["--port", "0", "--weight-spec", str(path)]).weight_spec \
        == load_spec_file(str(path))
    monkeypatch.setenv(ENV, "learn")
    assert build_parser().parse_args(["--port", "0"]).weight_spec == "learn"
    for text, problem in [('{"a": [1, -2]}', "'a': the shape must be a list of non-negative"),
                          ("[]", "expected a non-empty JSON object"),
                          ("{", "not JSON")]:
        path.write_text(text)
        with pytest.raises(SpecError, match=problem):
            load_spec_file(str(path))
    with pytest.raises(SpecError, match="No such file"):
        load_spec_file(str(tmp_path / "missing.json"))
