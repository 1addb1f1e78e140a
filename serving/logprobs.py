"""Logprobs in OpenAI's shapes: a completion's tokens, a prompt's tokens (echo), a chat message's.

Token texts are decoded one token at a time; logprobs of impossible tokens (-inf, which JSON
cannot carry) are reported as MIN_LOGPROB, as vLLM does.
"""

import itertools

from jpaged.core.detokenizer import token_bytes_fn
from jpaged.outputs import CompletionOutput, RequestOutput

# Logprobs of impossible tokens are -inf, which JSON cannot carry: report them as vLLM does.
MIN_LOGPROB = -9999.0


def _json_logprob(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN fails the test too


class LogprobFormatter:
    """The `logprobs` of completions and chat choices, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes_fn(tokenizer)  # logprobs' `bytes`: a token's own, even half a character

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, c: CompletionOutput, tokens: range, offset: int) -> dict:
        texts = [self._token_text(c.token_ids[t]) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [_json_logprob(c.logprobs[t][c.token_ids[t]]) for t in tokens],
                "top_logprobs": [self._top_logprobs(c.logprobs[t], c.token_ids[t]) for t in tokens],
                "text_offset": offsets}

    def _top_logprobs(self, logprobs: dict[int, float], chosen: int, top: int | None = None) -> dict[str, float]:
        """A completions `top_logprobs` entry, {token text: logprob}: the `top` likeliest of
        `logprobs` (None: all) and the `chosen` token, likeliest first. Distinct tokens can decode
        to the same text (each byte of a multi-byte character decodes alone to "\ufffd"); a text
        already taken keys its token as "token_id:N" (vLLM's --return-tokens-as-token-ids form),
        so no entry is lost and the chosen token keeps its own text, the one in `tokens`."""
        ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:top]
        if chosen not in dict(ranked):
            ranked.append((chosen, logprobs[chosen]))
        keys = {chosen: self._token_text(chosen)}
        taken = set(keys.values())
        for token_id, _ in ranked:
            if token_id not in keys:
                text = self._token_text(token_id)
                keys[token_id] = text if text not in taken else f"token_id:{token_id}"
                taken.add(keys[token_id])
        return {keys[token_id]: _json_logprob(logprob) for token_id, logprob in ranked}

    def prompt(self, out: RequestOutput, top: int) -> dict:
        """OpenAI's completion logprobs of the prompt's tokens (echo): the first has none."""
        texts = [self._token_text(t) for t in out.prompt_token_ids]
        offsets = [0, *itertools.accumulate(map(len, texts[:-1]))]
        entries = out.prompt_logprobs or [None] * len(texts)
        return {"tokens": texts,
                "token_logprobs": [None if e is None else _json_logprob(e[t]) for e, t in zip(entries, out.prompt_token_ids)],
                "top_logprobs": [None if e is None else self._top_logprobs(e, t, max(top, 1))
                                 for e, t in zip(entries, out.prompt_token_ids)],
                "text_offset": offsets}

    def chat(self, c: CompletionOutput, tokens: range, top: int) -> dict:
        def entry(token_id, logprob):
            text = self._token_text(token_id)
            return {"token": text, "logprob": _json_logprob(logprob), "bytes": list(self.token_bytes(token_id))}

        content = []
        for t in tokens:
            ranked = sorted(c.logprobs[t].items(), key=lambda kv: kv[1], reverse=True)[:top]
            content.append({**entry(c.token_ids[t], c.logprobs[t][c.token_ids[t]]),
                            "top_logprobs": [entry(k, v) for k, v in ranked]})
        return {"content": content}
