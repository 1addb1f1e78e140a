"""Incremental detokenization and stop strings (jpaged/core/detokenizer.py).

Random texts and token ids are drawn from one seed (conftest's DEFAULT_SEED, or JPAGED_TEST_SEED=<int>
for another draw), named in every failure message. Tokenizers: the built-in byte tokenizer of `tiny`, and three
trained here from a small corpus (no network): a GPT-2-style byte-level BPE, a Llama-2-style BPE
with byte fallback (Prepend/Replace normalizer, Replace+ByteFallback+Fuse+Strip decoder) and a
Unigram with the Metaspace pre-tokenizer and decoder.
"""

import json
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jpaged.core import detokenizer as detok_mod
from jpaged.core.detokenizer import (
    REPLACEMENT_CHAR, Detokenizer, check_stop_strings, held_back_chars, max_stop_string_holdback,
    remove_last_delta, streamable_text)
from jpaged.core.sequence import Sequence, SequenceStatus
from jpaged.models.tiny import tiny_tokenizer
from conftest import DEFAULT_SEED

SEED = int(os.environ.get("JPAGED_TEST_SEED") or DEFAULT_SEED)
BOS, EOS = 256, 257  # tiny


def make_rng(name: str) -> random.Random:
    return random.Random(f"{SEED}/{name}")


def ctx(**kw) -> str:
    return f"JPAGED_TEST_SEED={SEED} " + " ".join(f"{k}={v!r}" for k, v in kw.items())


# ---------------------------------------------------------------------- random material
WORDS = ("the quick brown fox jumps over lazy dog hello world token stream decode text model "
         "serving café naïve über straße garçon año résumé 東京 日本語 中文 漢字 ひらがな "
         "カタカナ 한국어 "
         "😀 🎉 🚀 👍🏽 Привет мир Ελληνικά עברית العربية ∑ ∞ ≠ € £ ¥").split()
PUNCT = [" ", " ", " ", ", ", ". ", "! ", "\n", "  ", "'", "-", "(", ")"]


def random_char(rng: random.Random) -> str:
    """A character of 1, 2, 3 or 4 UTF-8 bytes (no surrogates, no U+FFFD)."""
    lo, hi = rng.choice([(0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF)])
    while True:
        cp = rng.randint(lo, hi)
        if not 0xD800 <= cp <= 0xDFFF and cp != 0xFFFD:
            return chr(cp)


def random_utf8_text(rng: random.Random, n: int) -> str:
    return "".join(random_char(rng) for _ in range(n))


def random_sentence(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        r = rng.random()
        parts.append(rng.choice(WORDS) if r < 0.8 else random_utf8_text(rng, rng.randint(1, 3)))
        parts.append(rng.choice(PUNCT))
    return "".join(parts).strip() or "x"


CORPUS = [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(300)] + [
    "Hello world, this is a test of the tokenizer.", "The quick brown fox jumps over the lazy dog!"] * 20


# ---------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def byte_bpe():
    """GPT-2-style byte-level BPE, with one extra non-special added token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 clean_up_tokenization_spaces=False)
    hf.add_tokens(["<|tool|>"])
    return hf


@pytest.fixture(scope="module")
def llama_bpe():
    """Llama-2-style SentencePiece BPE with byte fallback (as in its tokenizer.json)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)  # train on words
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  limit_alphabet=80)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces, as SentencePiece has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def unigram():
    """Unigram with the Metaspace pre-tokenizer and decoder (unknown characters -> <unk>)."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module", params=["tiny", "byte_bpe", "llama_bpe", "unigram"])
def any_tok(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------------- helpers
def stream(detok: Detokenizer, prompt: list[int], output: list[int], skip: bool = True, rng=None):
    """Appends `output` to a fresh sequence (one token per call, or random chunks with `rng`) and
    returns (seq, deltas)."""
    seq = Sequence(0, prompt)
    deltas, i = [], 0
    while i < len(output):
        k = 1 if rng is None else rng.choice([1, 1, 1, 2, 3, 5])
        for t in output[i:i + k]:
            seq.append_token_id(t, 0.0)
        i += k
        delta = detok.decode_sequence_incrementally(seq, skip_special_tokens=skip)
        deltas.append(delta)
        assert "".join(deltas) == seq.output_text
    return seq, deltas


def continuation(tok, prompt: list[int], output: list[int], skip: bool):
    """The text `output` adds to `prompt` per tokenizer.decode, or None when that is not well
    defined (invalid UTF-8 anywhere, or the prompt's text is not a prefix of the whole)."""
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    pre = tok.decode(prompt, skip_special_tokens=skip)
    if REPLACEMENT_CHAR in full or not full.startswith(pre):
        return None
    return full[len(pre):]


def whole_char_ids(tok) -> list[int]:
    """Ids whose token decodes alone to valid, non-empty text (no partial characters)."""
    ids = []
    for i in range(len(tok)):
        text = tok.decode([i])
        if text and REPLACEMENT_CHAR not in text:
            ids.append(i)
    return ids


# ---------------------------------------------------------------------- byte-level: tiny
@pytest.mark.parametrize("chunked", [False, True])
def test_tiny_random_utf8_streams_without_replacement_chars(tiny, chunked):
    rng = make_rng(f"tiny-utf8-{chunked}")
    detok = Detokenizer(tiny)
    for trial in range(150):
        prompt_text, text = random_utf8_text(rng, rng.randint(0, 8)), random_utf8_text(rng, rng.randint(1, 40))
        prompt = [BOS] + list(prompt_text.encode())
        output = list(text.encode())
        seq, deltas = stream(detok, prompt, output, rng=rng if chunked else None)
        where = ctx(trial=trial, prompt=prompt_text, text=text)
        assert all(REPLACEMENT_CHAR not in d for d in deltas), where
        assert seq.output_text == text == tiny.decode(output, skip_special_tokens=True), where
        if not chunked:  # a character comes out exactly when its last byte does
            assert [d for d in deltas if d] == list(text), where
        # Bookkeeping: every output id fed to the decode stream once (a fast tokenizer).
        assert seq.tokens is None and seq.read_offset == len(output), where


def test_tiny_special_tokens_skipped_or_kept(tiny):
    rng = make_rng("tiny-special")
    detok = Detokenizer(tiny)
    for trial in range(100):
        chars = [random_char(rng) for _ in range(rng.randint(1, 15))]
        output = []
        for ch in chars:  # specials between characters
            if rng.random() < 0.3:
                output.append(rng.choice([BOS, EOS, 258]))
            output.extend(ch.encode())
        for skip in (True, False):
            seq, deltas = stream(detok, [BOS] + list(b"hi"), output, skip=skip)
            where = ctx(trial=trial, output=output, skip=skip)
            assert seq.output_text == tiny.decode(output, skip_special_tokens=skip), where
            assert ("<s>" in seq.output_text or "</s>" in seq.output_text or "<pad>" in seq.output_text) == (
                not skip and any(t >= 256 for t in output)), where
            assert all(REPLACEMENT_CHAR not in d for d in deltas), where


def test_tiny_random_invalid_bytes_do_not_crash(tiny):
    rng = make_rng("tiny-invalid")
    detok = Detokenizer(tiny)
    for trial in range(200):
        prompt = [rng.randint(0, 258) for _ in range(rng.randint(1, 10))]
        # Arbitrary bytes, specials, and ids outside the tokenizer (a model's vocab may be larger).
        output = [rng.choice([rng.randint(0x80, 0xFF), rng.randint(0, 258), rng.randint(0, 0x7F), 300, 10**6])
                  for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            seq, _ = stream(detok, prompt, output, skip=skip, rng=rng if trial % 2 else None)
            where = ctx(trial=trial, prompt=prompt, output=output, skip=skip)
            assert isinstance(seq.output_text, str), where
            # Byte-level text is emitted in prefix-stable pieces; only a held-back tail can be missing.
            expected = continuation(tiny, prompt, output, skip)
            if expected is not None:
                assert seq.output_text == expected, where


def test_tiny_output_equals_decode_of_output_ids(tiny):
    """Byte-level: the deltas add up to decode(output_ids), whatever the (valid) prompt."""
    rng = make_rng("tiny-decode")
    detok = Detokenizer(tiny)
    for trial in range(100):
        prompt = list(random_utf8_text(rng, rng.randint(1, 12)).encode())
        output = list(random_utf8_text(rng, rng.randint(1, 12)).encode()) + [EOS]
        seq, _ = stream(detok, prompt, output)
        assert seq.output_text == tiny.decode(output, skip_special_tokens=True), ctx(trial=trial)


def test_tiny_prompt_ending_in_broken_bytes_stays_out_of_the_output(tiny):
    """A prompt of random bytes (its tail may be invalid UTF-8 or a cut character): the output
    text is that of the output ids alone, never the prompt's bytes."""
    rng = make_rng("tiny-broken-prompt")
    detok = Detokenizer(tiny)
    for trial in range(100):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        output = list(random_utf8_text(rng, rng.randint(1, 12)).encode())
        seq, _ = stream(detok, prompt, output)
        assert seq.output_text == tiny.decode(output), ctx(trial=trial, prompt=prompt, text=seq.output_text)


# ---------------------------------------------------------------------- trained tokenizers
@pytest.mark.parametrize("chunked", [False, True])
def test_encoded_sentences_match_full_decode(any_tok, chunked):
    tok = any_tok
    rng = make_rng(f"sentences-{tok.__class__.__name__}-{len(tok)}-{chunked}")
    detok = Detokenizer(tok)
    checked = 0
    for trial in range(60):
        text = random_sentence(rng, rng.randint(2, 12))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cut = rng.randint(0, len(ids) - 1)
        prompt = [tok.bos_token_id] + ids[:cut]
        output = ids[cut:] + ([tok.eos_token_id] if rng.random() < 0.5 else [])
        for skip in (True, False):
            seq, deltas = stream(detok, prompt, output, skip=skip, rng=rng if chunked else None)
            expected = continuation(tok, prompt, output, skip)
            where = ctx(trial=trial, text=text, prompt=prompt, output=output, skip=skip)
            if expected is None:  # the prompt was cut inside a character
                assert REPLACEMENT_CHAR in tok.decode(prompt, skip_special_tokens=skip) or \
                    REPLACEMENT_CHAR in tok.decode(output, skip_special_tokens=skip), where
                continue
            checked += 1
            assert seq.output_text == expected, where
            assert all(REPLACEMENT_CHAR not in d for d in deltas), where
            if cut == 0 and skip:  # only <s> before: exactly decode(output_ids)
                assert seq.output_text == tok.decode(output, skip_special_tokens=True), where
    assert checked >= 40  # most of the 120 cases (cuts inside a multi-byte character are skipped)


def test_random_ids_match_full_decode(any_tok):
    tok = any_tok
    rng = make_rng(f"random-ids-{tok.__class__.__name__}-{len(tok)}")
    detok = Detokenizer(tok)
    whole = whole_char_ids(tok)
    checked = 0
    for trial in range(150):
        # Mostly whole-character tokens (so most cases are valid text), some arbitrary ids.
        def draw():
            return rng.choice(whole) if rng.random() < 0.85 else rng.randrange(len(tok) + 5)
        prompt = [draw() for _ in range(rng.randint(1, 10))]
        output = [draw() for _ in range(rng.randint(1, 25))]
        for skip in (True, False):
            seq, deltas = stream(detok, prompt, output, skip=skip, rng=rng if trial % 3 == 0 else None)
            expected = continuation(tok, prompt, output, skip)
            if expected is None:
                continue  # invalid UTF-8 somewhere: only "does not crash"
            checked += 1
            where = ctx(trial=trial, prompt=prompt, output=output, skip=skip)
            assert seq.output_text == expected, where
            assert all(REPLACEMENT_CHAR not in d for d in deltas), where
    assert checked >= 50


def test_sentencepiece_leading_space(llama_bpe, unigram):
    for tok in (llama_bpe, unigram):
        detok = Detokenizer(tok)
        hello = tok("hello", add_special_tokens=False)["input_ids"]
        world = tok("hello world", add_special_tokens=False)["input_ids"][len(hello):]
        assert tok.convert_ids_to_tokens(world)[0].startswith("▁")
        seq, _ = stream(detok, [tok.bos_token_id] + hello, world)
        assert seq.output_text == " world"  # the completion keeps its space...
        assert tok.decode(world) == "world"  # ...which decoding it alone drops
        seq, _ = stream(detok, [tok.bos_token_id], world)
        assert seq.output_text == "world"  # nothing before it but <s>: as decode(output_ids)


def test_byte_fallback_prompt_tail_cut_inside_a_character(llama_bpe):
    """The prompt's context window must not start inside a character: with byte fallback that
    would turn the output's characters into U+FFFD."""
    tok, detok = llama_bpe, Detokenizer(llama_bpe)
    text = "ꙮꙮꙮ"  # not in the corpus: 3 byte-fallback tokens per character
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 9 and all(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids[1:]))
    out_ids = tok("ꙮ😀", add_special_tokens=False)["input_ids"][1:]  # drop the leading "▁"
    seq, deltas = stream(detok, [tok.bos_token_id] + ids, out_ids)
    assert seq.output_text == "ꙮ😀"
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_fork_and_catch_up(byte_bpe):
    tok, detok = byte_bpe, Detokenizer(byte_bpe)
    ids = tok("hello world, café 東京 😀 the end", add_special_tokens=False)["input_ids"]
    seq = Sequence(0, [tok.bos_token_id] + ids[:3])
    for t in ids[3:6]:
        seq.append_token_id(t, 0.0)
        detok.decode_sequence_incrementally(seq)
    child = seq.fork(1)
    for s in (seq, child):
        for t in ids[6:]:
            s.append_token_id(t, 0.0)
        detok.decode_sequence_incrementally(s)  # several tokens in one call
        assert detok.decode_sequence_incrementally(s) == ""  # nothing new: nothing emitted
        assert s.output_text == tok.decode(ids[3:])


# ---------------------------------------------------------------------- stop strings
def run_with_stops(detok, prompt, output, stop, skip=True):
    """The engine's per-token loop: detokenize, then check stop strings; stream with hold-back."""
    seq = Sequence(0, prompt)
    sent, matched = "", None
    for t in output:
        seq.append_token_id(t, 0.0)
        delta = detok.decode_sequence_incrementally(seq, skip_special_tokens=skip)
        matched = check_stop_strings(seq, len(delta), stop)
        if matched is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
        streamed = streamable_text(seq, stop)
        assert streamed.startswith(sent), (streamed, sent)  # only ever grows
        assert len(seq.output_text) - len(streamed) <= max_stop_string_holdback(stop)
        sent = streamed
        if matched is not None:
            break
    return seq, matched, sent


def test_stop_string_spanning_two_tokens(byte_bpe):
    tok, detok = byte_bpe, Detokenizer(byte_bpe)
    ids = tok("hello world again", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:2] == ["hello", " world"], pieces
    seq, matched, sent = run_with_stops(detok, [tok.bos_token_id], ids, ["lo wor"])
    assert matched == "lo wor" and seq.output_text == sent == "hel"
    assert seq.get_output_len() == 2  # found on the token that completes it


def test_stop_string_at_the_very_start(tiny):
    detok = Detokenizer(tiny)
    seq, matched, sent = run_with_stops(detok, [BOS], list("STOP and more".encode()), ["STOP"])
    assert matched == "STOP" and seq.output_text == sent == ""
    # A multi-byte stop string: held until complete, matched at the start.
    seq, matched, _ = run_with_stops(detok, [BOS], list("東京 tower".encode()), ["東京"])
    assert matched == "東京" and seq.output_text == "" and seq.get_output_len() == 6


def test_stop_strings_earliest_match_wins_and_truncates(tiny):
    detok = Detokenizer(tiny)
    seq = Sequence(0, [BOS])
    for b in b"abcdefgh":  # several tokens, one detokenization call
        seq.append_token_id(b, 0.0)
    delta = detok.decode_sequence_incrementally(seq)
    assert delta == "abcdefgh"
    assert check_stop_strings(seq, len(delta), ["fg", "cd", "zz"]) == "cd"
    assert seq.output_text == "ab"  # the stop string and everything after it are gone
    seq.output_text = "abcdefgh"
    assert check_stop_strings(seq, 8, ["cde", "cd"]) == "cde"  # same start: first listed
    assert seq.output_text == "ab"
    # The method form takes the new characters from the last call.
    seq.output_text = "abcdefgh"
    assert detok.check_stop_strings(seq, ["h", "ab"]) == "ab" and seq.output_text == ""


def test_stop_strings_only_search_the_new_tail(tiny):
    seq = Sequence(0, [BOS])
    seq.output_text = "xx STOP yy"
    assert check_stop_strings(seq, 2, ["STOP"]) is None  # already searched (and passed) text
    assert check_stop_strings(seq, 0, ["STOP"]) is None
    assert check_stop_strings(seq, 4, ["STOP"]) == "STOP" and seq.output_text == "xx "  # ends in new text
    seq.output_text = "xx STOP yy"
    assert check_stop_strings(seq, None, ["STOP"]) == "STOP"  # None: search everything
    assert check_stop_strings(seq, 5, []) is None


def test_stop_string_waits_for_an_unfinished_character(tiny):
    """While a character is held back no characters are new, so nothing is searched; the token
    that completes it brings the match."""
    detok = Detokenizer(tiny)
    seq, matched, sent = run_with_stops(detok, [BOS], list("ab€cd".encode()), ["b€"])
    assert matched == "b€" and seq.output_text == sent == "a" and seq.get_output_len() == 5


def test_stop_strings_random_streaming(tiny):
    """Random texts over a small alphabet, streamed byte by byte with hold-back: the streamed
    text never shows a stop string and ends as the text cut at the first completed stop string."""
    rng = make_rng("stop-random")
    detok = Detokenizer(tiny)
    for trial in range(300):
        alphabet = rng.choice(["ab", "abc", "aé"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        seq, matched, sent = run_with_stops(detok, [BOS], list(text.encode()), stop)
        # Reference: the first character position where some stop string ends; among those the
        # longest (earliest start) one.
        expected, expected_match = text, None
        for end in range(1, len(text) + 1):
            hits = [s for s in stop if text[:end].endswith(s)]
            if hits:
                expected_match = max(hits, key=len)
                expected = text[:end - len(expected_match)]
                break
        where = ctx(trial=trial, text=text, stop=stop)
        assert seq.output_text == expected, where
        assert (matched is None) == (expected_match is None), where
        if matched is not None:
            assert text[len(expected):].startswith(matched), where
        else:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            sent = streamable_text(seq, stop)  # finished: nothing held back
        assert sent == expected, where
        assert not any(s in sent for s in stop), where


def test_held_back_length():
    assert max_stop_string_holdback(None) == max_stop_string_holdback([]) == 0
    assert max_stop_string_holdback(["a"]) == 0
    assert max_stop_string_holdback(["STOP", "ab"]) == 3
    assert held_back_chars("hello ST", ["STOP"]) == 2
    assert held_back_chars("hello STO", ["STOP", "Ox"]) == 3
    assert held_back_chars("hello STOx", ["STOP", "Oxy"]) == 2
    assert held_back_chars("hello", ["STOP"]) == 0
    assert held_back_chars("S", ["STOP"]) == 1
    assert held_back_chars("", ["STOP"]) == 0
    seq = Sequence(0, [BOS])
    seq.output_text = "hello ST"
    assert streamable_text(seq, ["STOP"]) == "hello "
    assert streamable_text(seq, None) == "hello ST"
    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    assert streamable_text(seq, ["STOP"]) == "hello ST"


def test_remove_last_delta_for_stop_tokens(byte_bpe):
    """EOS / stop_token_ids: the stop token's own text is not part of the output."""
    tok, detok = byte_bpe, Detokenizer(byte_bpe)
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    seq = Sequence(0, [tok.bos_token_id])
    for t in ids:  # (a request's skip_special_tokens holds for its whole output)
        seq.append_token_id(t, 0.0)
        detok.decode_sequence_incrementally(seq, skip_special_tokens=False)
    detok.remove_last_delta(seq)  # ids[-1] was a stop token id
    assert seq.output_text == tok.decode(ids[:-1])
    seq.append_token_id(tok.eos_token_id, 0.0)
    delta = detok.decode_sequence_incrementally(seq, skip_special_tokens=False)
    assert delta == "</s>"
    remove_last_delta(seq, len(delta))
    assert seq.output_text == tok.decode(ids[:-1])


def test_token_bytes_are_the_tokens_own_bytes():
    """Logprob `bytes` of a token that is part of a character are its own bytes, not U+FFFD's:
    over any text, the tokens' bytes concatenate to the text's UTF-8 (tiny's byte vocabulary and a
    GPT-2-style byte-level BPE with multi-byte merges)."""
    import random

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from jpaged.core.detokenizer import token_bytes_fn
    from jpaged.models.tiny import tiny_tokenizer

    rng = random.Random()
    alphabet = "abc héllo wörld €uro 日本語 🙂 ñ"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(50)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts * 20, vocab_size=400, min_frequency=2, show_progress=False)
    gpt2_like = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    # tiny: every byte its own token (partial characters); the BPE: merged multi-byte tokens.
    for tokenizer, case in ((tiny_tokenizer(), "partial"), (gpt2_like, "multi_byte")):
        token_bytes = token_bytes_fn(tokenizer)
        partial = multi_byte = 0
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert b"".join(token_bytes(i) for i in ids) == text.encode()
            partial += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
            multi_byte += sum(len(token_bytes(i)) > 1 and max(token_bytes(i)) > 127 for i in ids)
        assert {"partial": partial, "multi_byte": multi_byte}[case] > 0  # the case that matters was seen
