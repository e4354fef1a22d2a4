"""Operations routes: /health, /health_generate, model and server info, /v1/stats, /get_load, /flush_cache,
/metrics.

Info routes answer in SGLang's and crane-oai's shapes; /metrics in Prometheus text format.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from crane_mp import __version__
from crane_mp.frontend.serving.choices import collect, open_choices
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError, EngineDeadError, engine_answer
from crane_mp.frontend.web.http import json_response
from crane_mp.frontend.web.routing import RouteTable
from crane_mp.protocol import EngineStats, SamplingParams

api = RouteTable()


# Open without a key: liveness probes and load balancers must not need the secret.
@api.add("get", "/health", open=True, errors=("503",), summary="Liveness and readiness")
async def health(request: web.Request) -> web.Response:
    """Liveness and readiness: 200 once the whole pipeline is ready, 503 while starting or draining."""
    state = request.app[STATE]
    if state.ready:
        return json_response({"status": "ok"})
    status = "draining" if state.draining else ("engine_dead" if state.client and state.client.dead else "starting")
    return json_response({"status": status}, status=503)


async def _stats(state: FrontendState) -> EngineStats:
    with engine_answer():
        return await state.client.control("stats", timeout=5.0)


@api.add("get", "/v1/stats", requires=FrontendState.require_ready, errors=("503",), summary="Engine counters")
async def stats(request: web.Request) -> web.Response:
    """Engine counters from the scheduler: running/waiting sequences, KV blocks, totals, decode rate."""
    snapshot = await _stats(request.app[STATE])
    return json_response({f: getattr(snapshot, f) for f in snapshot.__struct_fields__ if f != "token"})


@api.add("get", "/get_load", requires=FrontendState.require_ready, errors=("503",), summary="Load, SGLang's shape")
async def get_load(request: web.Request) -> web.Response:
    """SGLang's load report (one entry per data-parallel rank: here one), which sglang-router's
    power-of-two policy reads: `num_tokens`, the KV tokens running requests hold, is what it compares."""
    state = request.app[STATE]
    snapshot = await _stats(state)
    held = (snapshot.num_total_blocks - snapshot.num_free_blocks) * state.engine_info.block_size
    return json_response([{"dp_rank": 0, "num_reqs": snapshot.num_running + snapshot.num_waiting,
                           "num_waiting_reqs": snapshot.num_waiting, "num_tokens": held}])


@api.add("post", "/flush_cache", requires=FrontendState.require_ready, admin=True, summary="Drop cached prefixes")
async def flush_cache(request: web.Request) -> web.Response:
    """Drop the prefix cache. Refused with 400 while requests are queued or running, as SGLang does."""
    with engine_answer():
        reply = await request.app[STATE].client.control("flush_cache", timeout=5.0)
    if not reply.ok:
        return json_response({"success": False, "message": f"Cache not flushed: {reply.message}."}, status=400)
    return json_response({"success": True, "message": "Cache flushed."})


def _model_info(state: FrontendState) -> dict[str, Any]:
    info = state.engine_info
    return {
        "model_path": state.config.engine.model_path,
        "tokenizer_path": state.config.engine.model_path,
        "model_name": state.model_name,
        "model_type": (info.hf_model_type if info.model_impl == "transformers" else info.arch) if info else None,
        "model_impl": info.model_impl if info else None,
        "is_generation": state.config.engine.task == "generate",  # the others refuse the generation routes
        "device": info.device if info else None,
        "dtype": info.dtype if info else None,
        "max_context_length": info.max_model_len if info else None,
        "vocab_size": info.vocab_size if info else None,
    }


@api.add("get", "/model_info", summary="Model metadata")
@api.add("get", "/get_model_info")
async def model_info(request: web.Request) -> web.Response:
    return json_response(_model_info(request.app[STATE]))


def _server_args(state: FrontendState) -> dict[str, Any]:
    cfg, engine = state.config, state.config.engine
    limit = engine.memory_limit
    return {
        "model_path": engine.model_path, "model_name": cfg.model_name, "model_type": engine.model_type,
        "model_impl_requested": engine.model_impl,
        "host": cfg.host, "port": cfg.port, "cpu": engine.force_cpu, "dtype": engine.dtype,
        "max_concurrent": engine.max_num_seqs, "prefix_cache": engine.enable_prefix_caching,
        "overlap_schedule": engine.overlap_schedule,
        "tp_size": engine.parallel.tensor_parallel_size, "dist_init_addr": engine.parallel.dist_init_addr,
        "max_seq_len": engine.max_model_len, "max_total_tokens": engine.max_total_tokens,
        "max_num_batched_tokens": engine.max_num_batched_tokens, "block_size": engine.block_size,
        "gpu_memory_limit": None if limit is None else (limit.num_bytes or limit.fraction),
        "shutdown_grace": cfg.shutdown_grace, "api_key_set": bool(cfg.api_key),
        "max_queue": cfg.max_queue, "request_timeout": cfg.request_timeout, "num_frontends": cfg.num_frontends,
        # Every crane-launch setting, with where its value came from (default, file, env or cli).
        "settings": cfg.settings,
    }


@api.add("get", "/server_info", requires=FrontendState.require_ready, errors=("503",),
         summary="Server arguments and live engine stats")
@api.add("get", "/get_server_info", requires=FrontendState.require_ready)
async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = await _stats(state)
    info = state.engine_info
    return json_response({
        "version": __version__,
        **_server_args(state),
        "isa": info.isa,
        "kernel_isa": info.kernel_isa,
        # "transformers": transformers' modeling code runs the model on our engine, slower than native.
        "model_impl": info.model_impl,
        "model_format": info.model_format,
        "weight_types": info.weight_types,
        "weights_bytes": info.weights_bytes,
        "weights_file_bytes": info.weights_file_bytes,
        # The worker ranks the model is split over (tensor parallelism), each with its own weights.
        "tensor_parallel_size": info.tensor_parallel_size,
        "nnodes": info.nnodes,
        "ranks": [{"rank": r.rank, "node": r.node, "device": r.device, "weights_bytes": r.weights_bytes}
                  for r in info.ranks],
        # What a token keeps at long context (past sliding windows), and within them; 0 in kv_windows: the
        # KV groups whose layers attend to every earlier key.
        "kv_bytes_per_token": info.kv_bytes_per_long_token or info.kv_bytes_per_token,
        "kv_bytes_per_token_in_window": info.kv_bytes_per_token * len(info.kv_windows),
        "kv_windows": info.kv_windows,
        "kv_cache_dtype": info.kv_cache_dtype,
        "quantized_activations": info.quantized_activations,
        "kv_budget_bytes": info.kv_budget_bytes,
        "activation_bytes": info.activation_bytes,
        # A hybrid model's state pool: the sequences it holds recurrent state for (at most this many run at
        # once) and one sequence's state over every linear-attention layer; 0 for attention-only models.
        "state_slots": info.state_slots,
        "state_bytes_per_seq": info.state_bytes_per_seq,
        "state_pool_bytes": info.state_slots * info.state_bytes_per_seq,
        # Sleep (0: awake; 1: KV cache freed; 2: weights too) and the weights served now
        # (/update_weights_from_disk may have replaced the start-up ones).
        "sleep_level": state.sleep_level,
        "weights_path": state.weights_path,
        "stats": {
            "total_requests": stats.total_requests,
            "completed_requests": stats.completed_requests,
            "avg_decode_tokens_per_sec": stats.avg_decode_tokens_per_sec,
            "active_sequences": stats.num_running,
            "waiting_sequences": stats.num_waiting,
            "kv_blocks_used": stats.num_total_blocks - stats.num_free_blocks,
            "kv_blocks_total": stats.num_total_blocks,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        },
    })


@api.add("get", "/health_generate", requires=FrontendState.require_ready, errors=("503",),
         summary="Deep health check: one generated token")
async def health_generate(request: web.Request) -> web.Response:
    """Deep check: one generated token through frontend, scheduler and worker within
    --health-generate-timeout seconds (30), else 503."""
    state = request.app[STATE]
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    async with open_choices(state, [[0]], 1, params, [1], [], True) as gens:
        try:
            outs = await asyncio.wait_for(collect(gens), state.config.health_generate_timeout)
        except (TimeoutError, ApiError) as err:
            raise ApiError(503, f"health check generation failed: {err or 'no token within the timeout'}") from err
    return json_response({"status": "ok", "tokens": len(outs[0].token_ids)})


@api.add("get", "/metrics", summary="Prometheus metrics")
async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = None
    if state.ready:
        try:
            stats = await state.client.control("stats", timeout=5.0)
        except (TimeoutError, EngineDeadError):
            stats = None  # request-level series still render; the gauges keep their last values
    body = state.metrics.render(stats)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
