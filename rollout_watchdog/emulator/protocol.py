"""SGLang's HTTP request and answer formats, as pure functions of their inputs.

Parsing raises :class:`BadRequest` with SGLang's (or FastAPI's) error message; building returns
the JSON-ready answer. Nothing here touches the server's state, so the route handlers stay thin.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.emulator.common import CONTEXT_LENGTH, VOCAB_SIZE, decode, encode

STARTING, UP, UNHEALTHY = "Starting", "Up", "UnHealthy"
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
DEFAULT_MAX_NEW_TOKENS = 16
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class BadRequest(Exception):
    """A client error answered with 400.

    ``validation`` selects FastAPI's validation-error body (``{"object": "error", ...}``);
    otherwise SGLang's ``{"error": {"message"}}`` body for errors raised by the handler.
    """

    def __init__(self, message: str, validation: bool = False, code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.validation = validation
        self.code = code


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in flight."""


@dataclass
class ReqState:
    """A request known to the main process (SGLang's rid_to_state entry)."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    is_health: bool = False
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    e2e_latency: float = 0.0
    submitted: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    updated: threading.Event = field(default_factory=threading.Event)


# ---- request parsing ------------------------------------------------------------------------


def json_body(body: bytes) -> dict[str, Any]:
    """Parse the body like FastAPI for a model argument: an empty body is a 400."""
    if not body.strip():
        raise BadRequest(
            "[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required', "
            "'input': None}]",
            validation=True,
        )
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(
            f"[{{'type': 'json_invalid', 'loc': ('body',), 'msg': 'JSON decode error', "
            f"'ctx': {{'error': {str(exc)!r}}}}}]",
            validation=True,
        ) from None
    if not isinstance(obj, dict):
        raise BadRequest(
            "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be "
            "a valid dictionary or object to extract fields from'}]",
            validation=True,
        )
    return obj


def parse_pause_mode(obj: dict[str, Any]) -> str:
    """The ``mode`` of /pause_generation (default abort)."""
    mode = obj.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(
            f"[{{'type': 'literal_error', 'loc': ('body', 'mode'), 'msg': \"Input should be "
            f"'abort', 'retract' or 'in_place'\", 'input': {mode!r}}}]",
            validation=True,
        )
    return str(mode)


def parse_memory_tags(obj: dict[str, Any]) -> list[str] | None:
    """The ``tags`` of /release_memory_occupation and /resume_memory_occupation."""
    tags = obj.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags)
    ):
        raise BadRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}", True)
    return tags


def parse_flush_timeout(query: dict[str, list[str]]) -> float:
    """The ``?timeout=s`` of /flush_cache (0.5.23): how long to retry a refused flush."""
    if "timeout" not in query:
        return 0.0
    try:
        return max(0.0, float(query["timeout"][0]))
    except ValueError:
        raise BadRequest("timeout must be a number", True) from None


def parse_abort(obj: dict[str, Any]) -> tuple[str, bool]:
    """(rid, abort_all) of /abort_request."""
    rid = obj.get("rid", "")
    if rid is None:
        rid = ""
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string", True)
    return rid, bool(obj.get("abort_all", False))


def parse_weight_version(obj: dict[str, Any]) -> tuple[str, bool]:
    """(new_version, abort_all_requests) of /update_weight_version."""
    version = obj.get("new_version")
    if not isinstance(version, str):
        raise BadRequest("new_version is required and must be a string", True)
    return version, bool(obj.get("abort_all_requests", True))


def parse_generate(obj: dict[str, Any]) -> tuple[list[ReqState], bool]:
    """Validate a /generate body into request states; returns (states, is_batch)."""
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is None and input_ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None and input_ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    prompts: list[list[int]]
    if text is not None:
        if isinstance(text, str):
            prompts, is_batch = [encode(text)], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = [encode(t) for t in text], True
        else:
            raise BadRequest("text must be a string or a non-empty list of strings", True)
    elif isinstance(input_ids, list) and _is_id_list(input_ids):
        prompts, is_batch = [list(input_ids)], False
    elif isinstance(input_ids, list) and input_ids and all(_is_id_list(x) for x in input_ids):
        prompts, is_batch = [list(x) for x in input_ids], True
    else:
        raise BadRequest("input_ids must be a list of ints or a list of lists of ints", True)
    for ids in prompts:
        for tok in ids:
            if not 0 <= tok < VOCAB_SIZE:
                raise BadRequest(f"Token id {tok} is out of the vocabulary [0, {VOCAB_SIZE}).")
    raw_sampling = obj.get("sampling_params")
    if isinstance(raw_sampling, list):
        if len(raw_sampling) != len(prompts):
            raise BadRequest("sampling_params list length does not match the batch size")
        samplings = [_parse_sampling(s) for s in raw_sampling]
    else:
        samplings = [_parse_sampling(raw_sampling)] * len(prompts)
    rid = obj.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif not is_batch and isinstance(rid, str):
        rids = [rid]
    elif is_batch and isinstance(rid, list) and len(rid) == len(prompts) and all(
        isinstance(r, str) for r in rid
    ):
        rids = list(rid)
    else:
        raise BadRequest("rid must be a string (a list of strings for a batch)", True)
    states = []
    for ids, sampling, r in zip(prompts, samplings, rids, strict=True):
        total = len(ids) + sampling["max_new_tokens"]
        if total > CONTEXT_LENGTH:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of "
                f"{CONTEXT_LENGTH} tokens. You requested a total of {total} tokens: "
                f"{len(ids)} tokens from the input messages and "
                f"{sampling['max_new_tokens']} tokens for the completion."
            )
        states.append(ReqState(rid=r, input_ids=ids, sampling=sampling))
    return states, is_batch


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def _parse_sampling(raw: Any) -> dict[str, Any]:
    """Validate sampling_params (unknown keys are ignored)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object", True)
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
    temperature = raw.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or (
        temperature < 0
    ):
        raise BadRequest(f"temperature must be a non-negative number, got {temperature!r}")
    stop = raw.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", True)
    stop_ids = raw.get("stop_token_ids") or []
    if not _is_id_list(stop_ids):
        raise BadRequest("stop_token_ids must be a list of ints", True)
    return {
        "max_new_tokens": max_new,
        "temperature": float(temperature),
        "stop": stop,
        "stop_token_ids": stop_ids,
        "ignore_eos": bool(raw.get("ignore_eos", False)),
    }


# ---- answers --------------------------------------------------------------------------------


def generate_output(
    rid: str,
    prompt_tokens: int,
    output_ids: list[int],
    reason: dict[str, Any] | None,
    latency: float,
    weight_version: str,
) -> dict[str, Any]:
    """The /generate answer for one request (a stop string is cut from the text)."""
    text = decode(output_ids)
    if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": prompt_tokens,
            "weight_version": weight_version,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
        },
    }


def model_info(args: argparse.Namespace, weight_version: str) -> dict[str, Any]:
    """GET /model_info."""
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "emulator",
        "architectures": ["TinyLM"],
    }


def models_list(served_model_name: str) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": 0, "owned_by": "sglang",
        "root": served_model_name, "max_model_len": CONTEXT_LENGTH,
    }]}


def server_args(
    args: argparse.Namespace,
    *,
    served_model_name: str,
    port: int,
    weight_version: str,
    token_latency_ms: float,
    health_check_timeout: float,
) -> dict[str, Any]:
    """Server args as /server_info reports them (SGLang names where they exist)."""
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": served_model_name,
        "host": args.host,
        "port": port,
        "nccl_port": args.nccl_port,
        "weight_version": weight_version,
        "enable_metrics": bool(args.enable_metrics),
        "enable_memory_saver": bool(args.enable_memory_saver),
        "context_length": CONTEXT_LENGTH,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "random_seed": 0,
        "watchdog_timeout": 300,
        "skip_server_warmup": False,
        "emulator": {
            "dead_scheduler": args.dead_scheduler,
            "token_latency_ms": token_latency_ms,
            "health_check_timeout": health_check_timeout,
        },
    }


def metrics_text(
    served_model_name: str,
    gauges: tuple[float, float, float],
    counters: tuple[int, int, int],
) -> str:
    """Prometheus text like SGLang's /metrics.

    ``gauges``: running requests, queued requests, generation throughput (the scheduler's);
    ``counters``: generation tokens, prompt tokens, requests (the tokenizer manager's).
    """
    name = served_model_name.replace("\\", "\\\\").replace('"', '\\"')
    glabels = f'{{model_name="{name}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
    clabels = f'{{model_name="{name}"}}'
    gauge_help = (
        ("num_running_reqs", "The number of running requests."),
        ("num_queue_reqs", "The number of requests in the waiting queue."),
        ("gen_throughput", "The generation throughput (token/s)."),
    )
    counter_help = (
        ("generation_tokens", "Number of generation tokens processed."),
        ("prompt_tokens", "Number of prefill tokens processed."),
        ("num_requests", "Number of requests processed."),
    )
    lines = []
    for (metric, help_text), value in zip(gauge_help, gauges, strict=True):
        lines += [
            f"# HELP sglang:{metric} {help_text}",
            f"# TYPE sglang:{metric} gauge",
            f"sglang:{metric}{glabels} {float(value)}",
        ]
    for (metric, help_text), count in zip(counter_help, counters, strict=True):
        lines += [
            f"# HELP sglang:{metric}_total {help_text}",
            f"# TYPE sglang:{metric}_total counter",
            f"sglang:{metric}_total{clabels} {float(count)}",
        ]
    return "\n".join(lines) + "\n"
