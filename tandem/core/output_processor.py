"""Engine outputs -> RequestOutputs: detokenization and stop strings.

The engine's step ends a request on what it can decide from token ids alone
(EOS, stop token ids, ``max_tokens``, the context window) and hands back one
``EngineCoreOutput`` per scheduled request. Turning ids into text and finding
stop strings is the rest; ``AsyncEngine`` does it on the caller's event loop,
one batch per step, so it overlaps the next forward pass instead of
lengthening the step (``LLMEngine.step`` does it in-line for offline use).

A stop string found here ends the request a step or so after the engine
produced the token: the caller's stream finishes at once, the engine is told
to stop the request (its blocks freed at the next step boundary), and any
tokens it produced meanwhile are dropped here. This is vLLM V1's split too.

Functions, not a class with state: a request's detokenizer lives on the
request, so requests served from different event loops share nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.request import FINISH_REASONS, Request, RequestStatus
from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step, as the engine thread saw it.

    The snapshot fields (status, counts) are copied because the engine keeps
    changing the request while this output is being processed elsewhere.
    """

    request: Request
    new_token_ids: list[int]  # empty for an abort
    logprobs: dict[int, float] | None
    status: RequestStatus | None  # set when this step finished the request
    stop_reason: int | None  # the stop token id that finished it, if one did
    num_output_tokens: int
    time: float
    new_token_is_text: bool = True  # False for the EOS or stop id that ended it


def process_output(out: EngineCoreOutput) -> tuple[RequestOutput | None, bool]:
    """(the RequestOutput to stream, whether a stop string ended the request here).

    None once a stop string has ended the request: later tokens are dropped.
    """
    req, status, stop_reason = out.request, out.status, out.stop_reason
    detok = req.detokenizer
    stopped_by_string = False
    delta = ""
    if detok is not None and status is not RequestStatus.FINISHED_ABORTED:
        if detok.stop_reason is not None:
            return None, False
        if out.new_token_ids and out.new_token_is_text:
            matched = detok.add_token(out.new_token_ids[0])  # honours min_tokens itself
            if matched is not None:
                status, stop_reason, stopped_by_string = (
                    RequestStatus.FINISHED_STOPPED, matched, True)
        delta = detok.take_delta(finished=status is not None)
    ro = RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        new_token_ids=out.new_token_ids,
        delta_text=delta,
        finished=status is not None,
        time=out.time,
        new_logprobs=None if out.logprobs is None else [out.logprobs],
        prompt=req.prompt,
    )
    if req.sampling_params.prompt_logprobs is not None and (
            status is not None or out.num_output_tokens == 1):
        ro.prompt_logprobs = [None, *req.prompt_logprobs]
    if status is not None:
        ro.outputs = [_completion(req, status, stop_reason, out.num_output_tokens)]
        ro.metrics = _metrics(req, out.num_output_tokens, out.time)
    return ro, stopped_by_string


def _completion(req: Request, status: RequestStatus, stop_reason: int | str | None,
                n: int) -> CompletionOutput:
    ids = req.output_token_ids[:n]
    logprobs = cumulative = None
    if req.sampling_params.logprobs is not None:
        logprobs = req.logprobs[:n]
        cumulative = sum(lp[t] for lp, t in zip(logprobs, ids))
    return CompletionOutput(
        text=req.detokenizer.text if req.detokenizer else "",
        token_ids=ids,
        finish_reason=FINISH_REASONS[status],
        stop_reason=stop_reason,
        logprobs=logprobs,
        cumulative_logprob=cumulative,
    )


def _metrics(req: Request, n: int, finished: float) -> RequestMetrics:
    t = req.times
    return RequestMetrics(
        arrival_time=t.arrival,
        first_scheduled_time=t.first_scheduled,
        first_token_time=t.first_token,
        finished_time=finished,
        queued_s=t.queued_s,
        prefill_s=t.prefill_s,
        decode_s=0.0 if t.first_token is None else finished - t.first_token,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_output_tokens=n,
        num_preemptions=req.num_preemptions,
    )
