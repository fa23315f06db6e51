"""HTTP layer over the Engine: OpenAI-compatible and SGLang-native routes, SSE streaming, Prometheus metrics.

Requests are validated and handed to the scheduler before any response byte is sent, so every bad input is a
clean 4xx; a client that goes away mid-stream has its requests aborted so their KV pages return at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from starlette.background import BackgroundTask

from treepage.core import LogprobParams, Req, SamplingParamError, TokenLogprob
from treepage.entrypoints.api_fields import UnsupportedField
from treepage.entrypoints.engine import CumulativeOutput, asyncio_sink
from treepage.entrypoints.logprob_output import add_native_logprobs, chat_logprobs, completion_logprobs
from treepage.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    _Body,
    format_validation_error,
    openai_finish_reason,
    usage,
    validation_error_param,
)
from treepage.managers.scheduler import QueueFullError
from treepage.managers.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from treepage.entrypoints.engine import Engine
    from treepage.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_SSE_DONE = "data: [DONE]\n\n"


class ApiError(Exception):
    """An error with its HTTP status; rendered as OpenAI's flat error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, str(self.status))
        return {
            "object": "error",
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status,
        }


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---- requests in flight -----------------------------------------------------------------------------------------
class _Submitted:
    """One request already queued in the scheduler; its output deltas arrive on the event loop."""

    def __init__(self, engine: Engine, req: Req, q: asyncio.Queue[dict]) -> None:
        self.engine = engine
        self.queue = q
        self.output = CumulativeOutput()
        self.finished = False
        self.req = req

    async def next(self) -> dict:
        """The cumulative snapshot after every delta that has arrived."""
        self.output.add(await self.queue.get())
        while not self.output.finished and not self.queue.empty():
            self.output.add(self.queue.get_nowait())
        self.finished = self.output.finished
        return self.output.snapshot()

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.req.rid)


def _submit(
    engine: Engine,
    items: list[tuple[list[int], dict, str | None]],
    logprobs: list[LogprobParams | None] | None = None,
    n: int = 1,
) -> list[_Submitted]:
    """Validate every item first (so a bad one queues nothing), then queue them together; with n > 1 each item
    is n samples sharing its prompt (docs/design.md, "Parallel sampling"), listed prompt-major."""
    checked = []
    lps = logprobs or [None] * len(items)
    for (ids, params, rid), lp in zip(items, lps):
        try:
            sp = engine.make_sampling_params(params)
        except TypeError as e:  # a value of the wrong type that slipped past the schema
            raise ApiError(400, f"invalid sampling parameters: {e}") from None
        engine.check_prompt(ids, sp)
        bad = lp.invalid_field(engine.vocab_size, len(ids)) if lp is not None else None
        if bad is not None:
            raise ApiError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
        checked.append((ids, sp, rid, lp))
    loop = asyncio.get_running_loop()
    subs: list[_Submitted] = []
    try:
        for ids, sp, rid, lp in checked:
            queues: list[asyncio.Queue[dict]] = [asyncio.Queue() for _ in range(n)]
            reqs = engine.submit_samples(ids, sp, [asyncio_sink(loop, q) for q in queues], rid, lp)
            subs += [_Submitted(engine, r, q) for r, q in zip(reqs, queues)]
    except BaseException:
        _abort_all(subs)
        raise
    return subs


def _abort_all(subs: list[_Submitted]) -> None:
    for s in subs:
        s.abort()


async def _merged(subs: list[_Submitted]) -> AsyncIterator[tuple[int, dict]]:
    """(index, snapshot) from all requests as they come; closing or cancelling it aborts the unfinished."""
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(subs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out["finished"]:
                    pending[asyncio.ensure_future(subs[i].next())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        _abort_all(subs)


async def _collect(subs: list[_Submitted]) -> list[dict]:
    finals: list[dict] = [{} for _ in subs]
    async for i, out in _merged(subs):
        if out["finished"]:
            finals[i] = out
    return finals


async def _until_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message is the disconnect (sent when the client goes away).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(subs: list[_Submitted], request: Request) -> list[dict]:
    """Final snapshots; if the client disconnects first, the requests are aborted instead of run to the end."""
    work = asyncio.ensure_future(_collect(subs))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # _merged's cleanup aborts the requests
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ApiError(400, "the client disconnected")  # nobody reads this; it ends the handler
    return work.result()


def _abort_error(out: dict) -> ApiError | None:
    """An engine-side abort as an HTTP error: 500 when the scheduler failed, 503 otherwise (e.g. out of KV)."""
    fr = out["meta_info"].get("finish_reason")
    if not fr or fr["type"] != "abort":
        return None
    message = fr.get("message") or "aborted"
    return ApiError(500 if message == "internal error" else 503, f"the request was aborted: {message}")


def _raise_on_abort(finals: list[dict]) -> None:
    for out in finals:
        err = _abort_error(out)
        if err is not None:
            raise err


def _sse_response(events: AsyncIterator[str], subs: list[_Submitted]) -> StreamingResponse:
    # The background task runs after the stream ends, also when a client disconnect cancelled it.
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(_abort_all, subs),
    )


# ---- helpers shared by the routes -------------------------------------------------------------------------------
async def _parse(request: Request, model: type[_Body]) -> Any:
    """The validated body; an unknown field, a wrong type, or a feature treepage lacks is a 400."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
        body.check_inert()
    except ValidationError as e:
        raise ApiError(400, format_validation_error(e), param=validation_error_param(e)) from None
    except UnsupportedField as e:
        raise ApiError(400, str(e), param=e.field) from None
    return body


def _encode(engine: Engine, prompt: str | list[int]) -> list[int]:
    if not prompt:
        raise ApiError(400, "Prompt cannot be empty")
    return list(engine.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)


def _check_model(engine: Engine, name: str | None) -> None:
    if name not in (None, "", "default", engine.model_name):
        raise ApiError(404, f"The model '{name}' does not exist", param="model")




def _rids(base: str, n: int) -> list[str]:
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def _total_usage(finals: list[dict], n: int = 1) -> dict[str, int]:
    """Each prompt counted once (its first sample's numbers), the completion tokens of every choice."""
    return usage(
        sum(f["meta_info"]["prompt_tokens"] for f in finals[::n]),
        sum(f["meta_info"]["completion_tokens"] for f in finals),
        sum(f["meta_info"]["cached_tokens"] for f in finals[::n]),
    )


async def _openai_events(
    subs: list[_Submitted],
    chunk: Callable[[int, str, str | None, Any, list[TokenLogprob]], dict],
    head: dict,
    include_usage: bool,
    prelude: list[dict] | None = None,
    n: int = 1,
) -> AsyncIterator[str]:
    """OpenAI SSE: text deltas per choice (with the logprob entries of the tokens new since the last chunk), a
    finish chunk, an optional usage chunk (each prompt counted once, every choice's completion), then [DONE]."""
    for obj in prelude or []:
        yield _sse(obj)
    sent = [""] * len(subs)
    sent_lps = [0] * len(subs)
    totals = [(0, 0, 0)] * len(subs)
    async for i, out in _merged(subs):
        err = _abort_error(out)
        if err is not None:
            yield _sse({"error": err.body()})
            yield _SSE_DONE
            return
        text, meta = out["text"], out["meta_info"]
        totals[i] = (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])
        delta = text[len(sent[i]) :]  # the scheduler streams only final text (never part of a stop string)
        sent[i] = text
        entries = out["output_logprobs"][sent_lps[i] :]
        sent_lps[i] += len(entries)
        finish, matched = openai_finish_reason(meta) if out["finished"] else (None, None)
        if delta or finish or entries:
            yield _sse({**head, "choices": [chunk(i, delta, finish, matched, entries)]})
    if include_usage:
        prompt, cached = sum(t[0] for t in totals[::n]), sum(t[2] for t in totals[::n])
        yield _sse({**head, "choices": [], "usage": usage(prompt, sum(t[1] for t in totals), cached)})
    yield _SSE_DONE


def _native(out: dict) -> dict:
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": out["meta_info"]}


# ---- metrics ----------------------------------------------------------------------------------------------------
class _EngineCollector:
    """Reads the engine's counters at scrape time, so /metrics is never stale."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.engine.scheduler.stats
        mem = self.engine.memory_report()
        gauges = {
            "num_running_reqs": ("Requests in the running batch.", st.num_running),
            "num_queue_reqs": ("Requests waiting to be admitted.", st.num_waiting),
            "gen_throughput": ("Generated tokens per second (recent window).", st.gen_throughput),
            "token_usage": ("Fraction of KV pages in use.", mem["used_pages"] / max(mem["total_pages"], 1)),
            "avg_spec_accept_length": (
                "Mean tokens emitted per verify forward.",
                self.engine.avg_spec_accept_length(),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"treepage:{name}", doc, value=float(value))
        yield CounterMetricFamily(
            "treepage:prompt_tokens", "Prompt tokens prefilled.", value=st.prompt_tokens_total
        )
        yield CounterMetricFamily(
            "treepage:generation_tokens", "Tokens generated.", value=st.gen_tokens_total
        )
        yield CounterMetricFamily(
            "treepage:cache_hit_tokens", "Admitted positions not prefilled (prefix-cache hits, shared sample prompts).", value=st.cache_hit_tokens
        )
        yield CounterMetricFamily(
            "treepage:cache_query_tokens", "Positions admitted (the hit rate's denominator).", value=st.cache_query_tokens
        )
        yield GaugeMetricFamily(
            "treepage:cache_hit_rate",
            "Prefix-cache hit rate over the server's lifetime.",
            value=st.cache_hit_tokens / max(st.cache_query_tokens, 1),
        )
        yield from self._adaptive()

    def _adaptive(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Adaptive speculation: rounds per shape (and off), accept estimates, the calibration table."""
        rep = self.engine.adaptive_report()
        if rep is None:
            return
        rounds = CounterMetricFamily(
            "treepage:spec_adaptive_rounds", "Decode rounds run with each tree shape.", labels=["shape"]
        )
        for shape, n in rep["rounds"].items():
            rounds.add_metric([shape], n)
        yield rounds
        if "accept_estimate" not in rep:
            return
        accept = GaugeMetricFamily(
            "treepage:spec_adaptive_accept_estimate", "Tokens per request-round expected.", labels=["shape"]
        )
        for shape, a in rep["accept_estimate"].items():
            accept.add_metric([shape], a)
        yield accept
        cost = GaugeMetricFamily(
            "treepage:spec_adaptive_round_seconds", "Calibrated seconds per round.", labels=["shape", "batch"]
        )
        for shape, by_batch in rep["calibration"]["round_seconds"].items():
            for batch, t in by_batch.items():
                cost.add_metric([shape, str(batch)], t)
        yield cost



# ---- server info -------------------------------------------------------------------------------------------------
def _server_info(engine: Engine) -> dict[str, Any]:
    """treepage's own report plus the keys SGLang's tools read: sglang-router registers a worker from
    `model_path`, `served_model_name`, `dp_size`, `max_*` and `version`; bench_serving prints
    `internal_states[0].avg_spec_accept_length`."""
    args = engine.args
    return {
        **engine.get_server_info(),
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "dp_size": 1,
        "tp_size": 1,
        "max_total_tokens": args.max_total_tokens,
        "max_prefill_tokens": args.max_prefill_tokens,
        "max_context_length": engine.context_len,
        "host": args.host,
        "port": args.port,
        "internal_states": engine.get_internal_states(),
    }


# ---- the app ----------------------------------------------------------------------------------------------------
def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="treepage", docs_url=None, redoc_url=None)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        param = exc.param if isinstance(exc, SamplingParamError) else None
        return JSONResponse(ApiError(400, str(exc), param=param).body(), status_code=400)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return JSONResponse(ApiError(503, str(exc)).body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        body = ApiError(500, f"Internal server error: {type(exc).__name__}: {exc}").body()
        return JSONResponse(body, status_code=500)

    # ---- OpenAI ------------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await _parse(request, CompletionRequest)
        _check_model(engine, body.model)
        raw_prompts = body.prompts()
        prompts = [_encode(engine, p) for p in raw_prompts]
        if not prompts:
            raise ApiError(400, "Prompt cannot be empty")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        cid = f"cmpl-{uuid.uuid4().hex}"
        rids = _rids(body.rid or cid, len(prompts))
        lp = body.logprob_params()
        n = body.num_samples()
        items: list[tuple[list[int], dict, str | None]] = [
            (ids, body.sampling_params(max_tokens), r) for ids, r in zip(prompts, rids)
        ]
        subs = _submit(engine, items, [lp] * len(items), n)
        head = {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
        }
        # echo: the prompt's text (and, with logprobs, its entries) go first, in a stream with the first chunk
        # choice i is sample i % n of prompt i // n
        echo_pending = set(range(len(subs))) if body.echo else set()
        offsets = [0] * len(subs)  # characters of each choice's text so far (logprobs' text_offset)

        def choice(i: int, text: str, finish: str | None, matched: Any, entries: list[TokenLogprob]) -> dict:
            if i in echo_pending:
                echo_pending.discard(i)
                p = raw_prompts[i // n]
                text = (p if isinstance(p, str) else str(engine.tokenizer.decode(p))) + text
                entries = subs[i].output.input_logprobs + entries
            logprobs = None
            if lp is not None:
                logprobs = completion_logprobs(entries, engine.tokenizer, lp.top_n, offsets[i])
            offsets[i] += len(text)
            return {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "matched_stop": matched,
            }

        if body.stream:
            events = _openai_events(subs, choice, head, body.include_usage, n=n)
            return _sse_response(events, subs)
        finals = await _collect_unless_gone(subs, request)
        _raise_on_abort(finals)
        choices = [
            choice(i, f["text"], *openai_finish_reason(f["meta_info"]), f["output_logprobs"])
            for i, f in enumerate(finals)
        ]
        return JSONResponse({**head, "choices": choices, "usage": _total_usage(finals, n)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        _check_model(engine, body.model)
        if not body.messages:
            raise ApiError(400, "Messages cannot be empty.")
        try:
            ids = apply_chat_template(engine.tokenizer, [m.to_template() for m in body.messages])
        except Exception as e:  # template errors (jinja raise_exception, bad roles) are the client's input
            raise ApiError(400, f"could not apply the chat template: {e}") from None
        if not ids:
            raise ApiError(400, "the chat template produced an empty prompt")
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = max(engine.context_len - len(ids), 0)  # up to the context, as OpenAI does
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        lp = body.logprob_params()
        n = body.num_samples()
        subs = _submit(engine, [(ids, body.sampling_params(max_tokens), body.rid or cid)], [lp], n)
        created = int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}

        def logprobs_of(entries: list[TokenLogprob]) -> dict | None:
            return chat_logprobs(entries, engine.tokenizer, lp.top_n) if lp is not None else None

        def chunk(i: int, text: str, finish: str | None, matched: Any, entries: list[TokenLogprob]) -> dict:
            delta = {"content": text} if text else {}
            return {
                "index": i,
                "delta": delta,
                "logprobs": logprobs_of(entries) if entries else None,
                "finish_reason": finish,
                "matched_stop": matched,
            }

        if body.stream:
            roles = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                           "finish_reason": None}]} for i in range(n)]  # fmt: skip
            events = _openai_events(subs, chunk, head, body.include_usage, prelude=roles, n=n)
            return _sse_response(events, subs)
        finals = await _collect_unless_gone(subs, request)
        _raise_on_abort(finals)
        choices = []
        for i, out in enumerate(finals):
            finish, matched = openai_finish_reason(out["meta_info"])
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out["text"]},
                    "logprobs": logprobs_of(out["output_logprobs"]),
                    "finish_reason": finish,
                    "matched_stop": matched,
                }
            )
        result = {**head, "object": "chat.completion", "choices": choices, "usage": _total_usage(finals, n)}
        return JSONResponse(result)

    def model_card() -> dict:
        return {
            "id": engine.model_name,
            "object": "model",
            "created": int(engine.start_time),
            "owned_by": "treepage",
            "root": engine.args.model_path,
            "max_model_len": engine.context_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != engine.model_name:
            raise ApiError(404, f"The model '{model}' does not exist", param="model")
        return model_card()

    # ---- native --------------------------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body: GenerateRequest = await _parse(request, GenerateRequest)
        _check_model(engine, body.model)
        single, prompts = body.batch()
        if not prompts:
            raise ApiError(400, "Prompt cannot be empty")
        params, rids = body.per_item(len(prompts))
        lps = body.logprob_params(len(prompts))
        n = body.num_samples()  # n > 1: a list of n results per prompt, prompt-major, as SGLang returns
        ids = [_encode(engine, p) for p in prompts]
        subs = _submit(engine, [(i, sp, r) for i, sp, r in zip(ids, params, rids)], lps, n)
        with_text = bool(body.return_text_in_logprobs)
        single = single and n == 1

        def native(i: int, out: dict) -> dict:
            lp = lps[i // n]
            if lp is not None:
                add_native_logprobs(out, lp, engine.tokenizer, with_text)
            res = _native(out)
            if body.return_prompt_token_ids:
                res["prompt_token_ids"] = ids[i // n]
            return res if single else {**res, "index": i}

        if body.stream:

            async def events() -> AsyncIterator[str]:
                async for i, out in _merged(subs):
                    err = _abort_error(out)
                    if err is not None:
                        yield _sse({"error": err.body()})
                        break
                    yield _sse(native(i, out))
                yield _SSE_DONE

            return _sse_response(events(), subs)
        finals = await _collect_unless_gone(subs, request)
        _raise_on_abort(finals)
        outs = [native(i, f) for i, f in enumerate(finals)]
        return JSONResponse(outs[0] if single else outs)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            rid = json.loads(await request.body())["rid"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(400, 'expected a JSON body {"rid": "<request id>"}') from None
        engine.abort(str(rid))
        return Response(status_code=200)

    def scheduler_alive() -> bool:
        return engine.is_alive()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if scheduler_alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not scheduler_alive():
            return Response(status_code=503)
        subs = _submit(
            engine, [([0], {"max_new_tokens": 1, "temperature": 0.0}, f"health-{uuid.uuid4().hex}")]
        )
        try:
            finals = await asyncio.wait_for(_collect(subs), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:  # an alias of TimeoutError only from Python 3.11 on  # noqa: UP041
            return Response(status_code=503)
        return Response(status_code=503 if _abort_error(finals[0]) else 200)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return _server_info(engine)

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        return engine.get_load()

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        args = engine.args
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": engine.model_name,
            "is_generation": True,
            "model_type": engine.model_config.hf_config.get("model_type", "llama"),
            "architectures": [engine.model_config.architecture],
            "context_length": engine.context_len,
            "vocab_size": engine.vocab_size,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.to_thread(engine.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are in flight.\n", status_code=400)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/memory")
    async def debug_memory() -> dict:
        return engine.memory_report()

    return app


def serve(args: ServerArgs, engine: Engine | None = None) -> None:
    """Run the HTTP server until interrupted; the engine is built from args unless given."""
    import uvicorn

    if engine is None:
        from treepage.entrypoints.engine import Engine

        engine = Engine(args)
    try:
        uvicorn.run(
            create_app(engine),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.log_level == "debug",
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.shutdown()
