"""After a token is sampled: append it, detokenize, check stop conditions, build outputs.

A sequence whose logits were not finite (the sampler's NO_TOKEN) gets no token and finishes
with finish_reason "error" (stop_reason says why).

Stop strings are matched on the detokenized text, so one split across tokens is caught; the
text stream holds back the tail that could still be the start of a stop string, and the stop
string itself never reaches the output.
"""
from __future__ import annotations

from kvserve.engine.request import Request, Sequence
from kvserve.engine.sampler import NO_TOKEN
from kvserve.outputs import CompletionOutput, OutputKind, RequestOutput, TokenLogprob

NON_FINITE = "the model produced NaN or infinite logits; no token could be chosen"


def append_token(
    seq: Sequence, token: int, logprob: TokenLogprob | None, eos_ids: frozenset[int], max_model_len: int,
    now: float,
) -> None:
    """Add a sampled token to seq and decide whether it finishes. Sets seq.finish_reason;
    stamps the request's token times with now."""
    p = seq.params
    if token == NO_TOKEN:
        seq.finish_reason, seq.stop_reason = "error", NON_FINITE
        seq.text += seq.detokenizer.flush()
        return
    m = seq.request.metrics
    if m.first_token_time is None:
        m.first_token_time = now
    m.last_token_time = now
    seq.token_ids.append(token)
    if logprob is not None:
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(logprob)
    n_out = seq.num_output_tokens
    if not p.ignore_eos and token in eos_ids and n_out >= p.min_tokens:
        seq.finish_reason = "stop"
    elif token in p.stop_token_ids and n_out >= p.min_tokens:
        seq.finish_reason, seq.stop_reason = "stop", token
    else:
        seq.text += seq.detokenizer.add([token])
        if p.stop and n_out >= p.min_tokens:
            _check_stop_strings(seq)
            if seq.finish_reason:
                return  # the text ends at the stop string; nothing after it is wanted
        if n_out >= seq.request.max_output_tokens or len(seq.token_ids) >= max_model_len:
            seq.finish_reason = "length"
    if seq.finish_reason:
        seq.text += seq.detokenizer.flush()  # an incomplete character held back at the end


def _check_stop_strings(seq: Sequence) -> None:
    # Only a match that ends inside the newest text can be new.
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, seq.emitted_text_len - longest)
    best = None
    for s in seq.params.stop:
        i = seq.text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        seq.text = seq.text[: best[0]]
        seq.finish_reason, seq.stop_reason = "stop", best[1]


def take_text_delta(seq: Sequence) -> str:
    """The text that may be streamed now: all of it once finished, else all but a tail that
    could still grow into a stop string."""
    end = len(seq.text)
    if not seq.finish_reason and seq.params.stop:
        end = max(seq.emitted_text_len, end - (max(len(s) for s in seq.params.stop) - 1))
    delta = seq.text[seq.emitted_text_len : end]
    seq.emitted_text_len = end
    return delta


def make_output(req: Request, new_tokens: dict[Sequence, int]) -> RequestOutput:
    """A snapshot of req after a step; new_tokens says how many tokens each sequence gained. Under
    OutputKind.DELTA only the final output copies a sequence's whole output; the others cost what
    the step added (see OutputKind)."""
    whole = req.output_kind is OutputKind.CUMULATIVE or req.finished
    outs = []
    for seq in req.seqs:
        k = new_tokens.get(seq, 0)
        delta = take_text_delta(seq)
        lps = seq.logprobs
        n = len(seq.token_ids)
        outs.append(
            CompletionOutput(
                index=seq.index,
                text=seq.text[: seq.emitted_text_len] if whole else "",
                token_ids=seq.output_token_ids if whole else [],
                logprobs=(list(lps) if whole else []) if lps is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                delta_text=delta,
                delta_token_ids=seq.token_ids[n - k :] if k else [],
                delta_logprobs=(lps[len(lps) - k :] if k else []) if lps is not None else None,
            )
        )
    first = req.seqs[0]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=outs,
        finished=req.finished,
        num_cached_tokens=first.num_cached_tokens,
        metrics=req.metrics,
        prompt_logprobs=_prompt_logprobs(req, whole),
        embedding=req.embedding,
    )


def _prompt_logprobs(req: Request, whole: bool) -> list | None:
    """Once the prompt is computed: on every whole output, and on the first delta one (a stream
    that echoes its prompt sends them first)."""
    if req.prompt_logprobs is None or not req.prompt_outputs_done or not (whole or not req.prompt_logprobs_sent):
        return None
    req.prompt_logprobs_sent = True
    return list(req.prompt_logprobs)
