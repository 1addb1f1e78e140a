"""Incremental detokenization and stop strings (vLLM semantics).

Detokenizing token by token
---------------------------
Decoding each new token on its own is wrong in two ways:
  * byte-level tokens (GPT-2 style BPE, the `tiny` byte tokenizer, SentencePiece byte fallback
    `<0xE2>`) can hold part of a UTF-8 character; decoding them alone gives U+FFFD;
  * SentencePiece-style decoders (Metaspace, Strip) drop the leading space of the *first* token
    they are given, and BPE pieces only make sense next to their neighbours.
So, like vLLM, every sequence keeps its token strings in `seq.tokens` and two offsets into them:
text up to `read_offset` has been emitted; `tokens[prefix_offset:read_offset]` is a short window
of already-emitted tokens used only as context. Each new token is appended and we decode
    prefix_text = decode(tokens[prefix_offset:read_offset])
    new_text    = decode(tokens[prefix_offset:])
If new_text is longer than prefix_text and does not end in U+FFFD, the delta
new_text[len(prefix_text):] is emitted and the window slides (prefix_offset = read_offset,
read_offset = len(tokens)). Otherwise nothing is emitted and the tokens wait for the next step:
a trailing U+FFFD is taken to be an unfinished character (a U+FFFD in the middle is emitted: the
bytes really were invalid).

State on the Sequence (jpaged/core/sequence.py):
  seq.tokens         None until the first call; then one token string per token id from
                     max(prompt_len - PROMPT_TAIL_TOKENS, 0) on ("" for skipped special tokens
                     and ids outside the vocabulary), so the number of ids already detokenized
                     is always max(prompt_len - PROMPT_TAIL_TOKENS, 0) + len(seq.tokens).
  seq.prefix_offset, seq.read_offset   indices into seq.tokens, as above.
  seq.output_text    concatenation of all deltas (then truncated by a stop string, if any).
Nothing else is needed: a forked sequence (deepcopy) carries its own copy. Never reset
seq.tokens to None on a live sequence: the next call would detokenize every output token again.

Fast (Rust-backed) tokenizers take the same steps inside the tokenizers library instead
(`tokenizers.decoders.DecodeStream`, as vLLM v1 does): one call per token instead of two
Python-side decodes, about 1 us instead of 4-5. The stream is primed with the same prompt tail
(without leading tokens that start inside a character) and kept in `seq.decode_stream`;
`seq.read_offset` then counts the output tokens fed to it. It holds back an unfinished character
the same way.

What the deltas add up to. For the prompt ids P and output ids O, with D = tokenizer.decode
(same skip_special_tokens), the concatenation of the deltas is D(P + O)[len(D(P)):] -- the text the
output adds to the prompt -- whenever D(P + O) starts with D(P) and the text is valid UTF-8.
For byte-level tokenizers (and whenever the prompt ends in a special token that is skipped) that
is D(O) itself. For SentencePiece-style tokenizers after a text prompt it keeps the leading space
of the first output word (" world"), which D(O) alone drops ("world"): that is what a completion
is, and what vLLM returns. Known limits, as in vLLM: text held back at the very end (an unfinished
character, or a genuine trailing U+FFFD) is never emitted; `clean_up_tokenization_spaces` is not
applied (jpaged's and most modern tokenizers have it off; transformers 5 ignores it for BPE);
invalid byte sequences are emitted as U+FFFD but their count can differ from D's.

Stop strings
------------
`check_stop_strings` is run after each detokenization step on seq.output_text. Only the tail
that can hold a new match is searched: a match must end inside the new characters, so for a stop
string s the search starts at len(text) - new_char_count - len(s) + 1. Among the stop strings that
match, the earliest match wins (ties: the first in `stop`). The text is cut at the start of the
match: the stop string and everything after it are excluded from the output (jpaged has no
include_stop_str_in_output). The output token ids are not cut (vLLM neither).

Streaming with stop strings: a text that ends with a proper prefix of a stop string might still
become a match, and then that tail is cut. So while a sequence is unfinished a streamer must hold
back the trailing characters that could start a match. vLLM holds back a fixed
max(len(s) for s in stop) - 1 characters (`max_stop_string_holdback`); `held_back_chars` gives
the exact number (the longest suffix of the text that is a proper prefix of a stop string: never
more than that bound), and `streamable_text` the prefix that is safe to send. Both rules only move
forward as the text grows or is cut at a stop string (use one rule per stream). When the sequence
finishes, everything in output_text is final.

Per engine step, for each sequence that got a new token (vLLM's order; one token per call, so
that a stop is found on the token that makes it):
    delta = detokenizer.decode_sequence_incrementally(seq, skip_special_tokens)
    if seq.get_output_len() >= params.min_tokens:             # stop checks only after min_tokens
        if (not params.ignore_eos and token == eos) or token in params.stop_token_ids:
            detokenizer.remove_last_delta(seq)                # the stop token's text is not output
            -> FINISHED_STOPPED (stop_reason = token id)
        elif params.stop and (s := detokenizer.check_stop_strings(seq, params.stop)) is not None:
            -> FINISHED_STOPPED (stop_reason = s)             # output_text already cut
    if not finished and (output_len >= max_tokens or len >= max_model_len):
        -> FINISHED_LENGTH_CAPPED
The Detokenizer methods check_stop_strings / remove_last_delta take the number of new characters
from the last decode_sequence_incrementally call on that sequence (or an explicit
new_char_count=len(delta)); the module functions of the same names take it explicitly.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence as SequenceType

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context kept before the first new token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
# Prompt tokens converted to strings on the first call: the context window plus a little slack.
PROMPT_TAIL_TOKENS = INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2

# Characters added by the last decode_sequence_incrementally call, stored on the sequence so that
# check_stop_strings / remove_last_delta work without being told.
_NEW_CHARS_ATTR = "_detok_new_char_count"


class Detokenizer:
    """Incremental detokenizer around a Hugging Face tokenizer (fast or slow)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.seconds = 0.0  # spent in decode_sequence_incrementally
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._is_fast = backend is not None
        self._backend = backend
        self._vocab_size = len(tokenizer)
        # Every id's token string, looked up once (a per-token tokenizer call costs a microsecond
        # per sampled token, at every step).
        self._id_tokens = tokenizer.convert_ids_to_tokens(list(range(self._vocab_size)))
        # The ids that tokenizer.decode(..., skip_special_tokens=True) drops. Fast tokenizers drop
        # the added tokens flagged special in the backend; slow ones drop all_special_ids.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        if self._is_fast:
            self._special_ids = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        else:
            self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._added_tokens = {getattr(tok, "content", str(tok)) for tok in added.values()}

    # ------------------------------------------------------------------ whole texts
    def decode_prompt(self, prompt_token_ids: SequenceType[int], skip_special_tokens: bool = True) -> str:
        """The prompt's text (for requests given as token ids)."""
        return self.tokenizer.decode(list(prompt_token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ incremental
    def decode_sequence_incrementally(self, seq: Any, skip_special_tokens: bool = True) -> str:
        """_decode_incrementally, its time added to `seconds` (the engine's step clock reads it)."""
        start = time.perf_counter()
        try:
            return self._decode_incrementally(seq, skip_special_tokens)
        finally:
            self.seconds += time.perf_counter() - start

    def decode_new_tokens(self, view: Any) -> str:
        """_decode_incrementally off the engine thread (pending_output.py: a TextView), not
        counted in `seconds` (the engine thread's clock reads it)."""
        return self._decode_incrementally(view)

    def _decode_incrementally(self, seq: Any, skip_special_tokens: bool = True) -> str:
        """Detokenizes the output tokens of `seq` not detokenized yet (normally the one appended
        this step; several are fine) and returns the new text, also appended to seq.output_text.
        Updates seq.tokens / prefix_offset / read_offset. Returns "" while a character is
        unfinished; the held text comes out with the token that completes it."""
        if self._is_fast:
            stream, output_ids = seq.decode_stream, seq.output_token_ids
            if stream is not None and seq.read_offset == len(output_ids) - 1:
                # One new token, the common case (_stream's loop without its lists): once per
                # sampled token.
                seq.read_offset += 1
                token_id = output_ids[-1]
                if not 0 <= token_id < self._vocab_size:
                    delta = ""  # an id the tokenizer does not know (a padded vocabulary): no text
                else:
                    try:
                        delta = stream.step(self._backend, token_id) or ""
                    except Exception:
                        delta = self._restart_stream(seq, token_id, skip_special_tokens) or ""
            else:
                delta = self._stream(seq, skip_special_tokens)
        else:
            if seq.tokens is None:
                self._init_from_prompt(seq, skip_special_tokens)
            prompt_len = len(seq.prompt_token_ids)
            done = max(prompt_len - PROMPT_TAIL_TOKENS, 0) + len(seq.tokens)
            delta = "".join([self._step(seq, t, skip_special_tokens) for t in seq.output_token_ids[done - prompt_len:]])
        if delta:
            seq.output_text += delta
        seq._detok_new_char_count = len(delta)  # (_NEW_CHARS_ATTR)
        return delta

    def check_stop_strings(self, seq: Any, stop: Iterable[str], new_char_count: int | None = None) -> str | None:
        """`check_stop_strings` below; new_char_count defaults to the length of the last delta
        that decode_sequence_incrementally returned for this sequence."""
        if new_char_count is None:
            new_char_count = getattr(seq, _NEW_CHARS_ATTR, None)
        return check_stop_strings(seq, new_char_count, stop)

    def remove_last_delta(self, seq: Any, new_char_count: int | None = None) -> None:
        """`remove_last_delta` below, with the same default as check_stop_strings."""
        if new_char_count is None:
            new_char_count = getattr(seq, _NEW_CHARS_ATTR, 0) or 0
        remove_last_delta(seq, new_char_count)

    # ------------------------------------------------------------------ internals
    def _stream(self, seq: Any, skip_special_tokens: bool) -> str:
        """Fast tokenizers: the new output tokens through the sequence's DecodeStream."""
        if seq.decode_stream is None:
            tail = [t for t in seq.prompt_token_ids[-PROMPT_TAIL_TOKENS:] if 0 <= t < self._vocab_size]
            # The context must neither start inside a character (see _init_from_prompt) nor end
            # in bytes that do not make one: a stream primed with those takes them as unread and
            # emits them with the first output token.
            while tail and self.tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).startswith(
                    REPLACEMENT_CHAR):
                tail = tail[1:]
            while tail and self.tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).endswith(
                    REPLACEMENT_CHAR):
                tail = tail[:-1]
            seq.decode_stream = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
            seq.read_offset, seq.output_text = 0, ""
        pending = seq.output_token_ids[seq.read_offset:]
        seq.read_offset += len(pending)
        pieces, stream, backend, vocab_size = [], seq.decode_stream, self._backend, self._vocab_size
        for token_id in pending:
            if not 0 <= token_id < vocab_size:
                continue  # an id the tokenizer does not know (a padded vocabulary): no text
            try:
                piece = stream.step(backend, token_id)
            except Exception:
                piece = self._restart_stream(seq, token_id, skip_special_tokens)
                stream = seq.decode_stream
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def _restart_stream(self, seq: Any, token_id: int, skip_special_tokens: bool) -> str | None:
        """The sequence's DecodeStream could not take `token_id` (a prefix the library cannot
        extend): go on without the context, from that token."""
        seq.decode_stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return seq.decode_stream.step(self._backend, token_id)

    def _init_from_prompt(self, seq: Any, skip_special_tokens: bool):
        tail = seq.prompt_token_ids[-PROMPT_TAIL_TOKENS:]
        tokens = [self._token(t, skip_special_tokens) for t in tail]
        read = len(tokens)
        prefix = max(read - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        # The context must not start inside a character: its leading bytes would decode to U+FFFD
        # and (with byte fallback, which turns a whole invalid byte run into U+FFFD) could spoil the
        # characters of the output that follow. Start after any such token.
        while prefix < read and self._to_string(tokens[prefix:read]).startswith(REPLACEMENT_CHAR):
            prefix += 1
        seq.tokens, seq.prefix_offset, seq.read_offset = tokens, prefix, read
        seq.output_text = ""

    def _token(self, token_id: int, skip_special_tokens: bool) -> str:
        token_id = int(token_id)
        if (skip_special_tokens and token_id in self._special_ids) or not 0 <= token_id < self._vocab_size:
            return ""
        return self._id_tokens[token_id] or ""

    def _to_string(self, tokens: list[str]) -> str:
        tokens = [t for t in tokens if t]
        if not tokens:
            return ""
        # Slow tokenizers (fast ones decode through a DecodeStream) may not know their added tokens
        # (sentencepiece): convert the runs of regular tokens and keep added tokens as they are
        # (vLLM does the same).
        if not self._added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens)
        parts, run = [], []
        for t in tokens:
            if t in self._added_tokens:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(t)
            else:
                run.append(t)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return "".join(parts)

    def _step(self, seq: Any, token_id: int, skip_special_tokens: bool) -> str:
        token = self._token(token_id, skip_special_tokens)
        tokens = seq.tokens
        tokens.append(token)
        if not token:  # a skipped special token or an unknown id: the text does not change
            return ""
        prefix, read = seq.prefix_offset, seq.read_offset
        prefix_text = self._to_string(tokens[prefix:read])
        new_text = self._to_string(tokens[prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an unfinished character (or nothing new yet): wait for more tokens
        seq.prefix_offset, seq.read_offset = read, len(tokens)
        return new_text[len(prefix_text):]


# ---------------------------------------------------------------------- stop strings
def check_stop_strings(seq: Any, new_char_count: int | None, stop: Iterable[str]) -> str | None:
    """Looks for a stop string ending in the last `new_char_count` characters of seq.output_text
    (None: anywhere). On a match cuts seq.output_text just before it and returns the stop string
    (the earliest match; ties go to the first in `stop`); otherwise returns None."""
    if not stop or new_char_count == 0:
        return None
    text = seq.output_text
    best, best_index = None, -1
    for s in stop:
        if not s:
            continue
        start = 0 if new_char_count is None else max(len(text) - new_char_count - len(s) + 1, 0)
        index = text.find(s, start)
        if index != -1 and (best is None or index < best_index):
            best, best_index = s, index
    if best is not None:
        seq.output_text = text[:best_index]
    return best


def remove_last_delta(seq: Any, new_char_count: int) -> None:
    """Drops the text of the last step from seq.output_text: for EOS / stop_token_ids, whose text
    is not part of the output (vLLM's rule without include_stop_str_in_output)."""
    if new_char_count > 0:
        seq.output_text = seq.output_text[:-new_char_count]


def max_stop_string_holdback(stop: Iterable[str] | None) -> int:
    """vLLM's fixed bound: characters a streamer holds back from an unfinished sequence so that
    no part of a stop string is ever sent: len(longest stop string) - 1 (0 without stop strings)."""
    lengths = [len(s) for s in stop or () if s]
    return max(lengths) - 1 if lengths else 0


def held_back_chars(text: str, stop: Iterable[str] | None) -> int:
    """The exact hold-back: the length of the longest suffix of `text` that is a proper prefix of
    some stop string (at most max_stop_string_holdback(stop))."""
    held = 0
    if not text:
        return 0
    last = text[-1]
    for s in stop or ():
        # Only prefixes ending in text's last character can match: find them with rfind (in C).
        k = s.rfind(last, 0, min(len(s) - 1, len(text)))
        while k >= held and not text.endswith(s[:k + 1]):
            k = s.rfind(last, 0, k)
        held = max(held, k + 1)
    return held


def streamable_text(seq: Any, stop: Iterable[str] | None) -> str:
    """The part of seq.output_text that is safe to send now: all of it once the sequence is
    finished, else all but the tail that could still turn into a stop string. It only grows from
    one step to the next, so a streamer sends streamable_text(seq, stop)[len(already_sent):]."""
    text = seq.output_text
    finished = seq.is_finished() if callable(getattr(seq, "is_finished", None)) else False
    if finished or not stop:
        return text
    return text[:len(text) - held_back_chars(text, stop)]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character: printable Latin-1 bytes
    as themselves, the others as chr(256 + k) in byte order. The inverse map, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


def token_bytes_fn(tokenizer: Any):
    """A function token id -> the token's own bytes (a piece of UTF-8 that may not be a whole
    character: logprob `bytes` must show it, not U+FFFD's bytes). Byte-level BPE vocabularies map
    characters back to bytes, SentencePiece's byte fallback reads <0xHH>; other tokens are their text."""
    import json

    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
    special = set(getattr(tokenizer, "all_special_ids", ()))

    def token_bytes(token_id: int) -> bytes:
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None or token_id in special:
            return tokenizer.decode([token_id]).encode()
        if alphabet is not None and all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
        if "ByteFallback" in kinds and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode() if "Metaspace" in kinds or "Replace" in kinds \
            else tokenizer.decode([token_id]).encode()

    return token_bytes
