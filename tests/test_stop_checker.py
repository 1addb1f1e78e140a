"""StopChecker.append_tokens (a multi-step decode's K tokens in one call) against append_token one
token at a time, which it must equal: ids, text (multi-byte characters split over tokens, the
stop token's text dropped), status, stop reason, cumulative logprob, and the detokenizer's state
for the tokens after. Random draws from conftest's seed; tokenizers from test_detokenizer, fast
and through the slow (pure Python) detokenization path."""

import copy

import pytest

from jpaged.core.detokenizer import Detokenizer
from jpaged.core.sequence import Sequence
from jpaged.core.stop_checker import StopChecker
from jpaged.sampling_params import SamplingParams
from test_detokenizer import any_tok, byte_bpe, ctx, llama_bpe, make_rng, tiny, unigram  # noqa: F401 (fixtures)


class SlowView:
    """The tokenizer seen as a slow one: the detokenizer then decodes in Python (_step)."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def one_by_one(checker: StopChecker, sp: SamplingParams, seq: Sequence, tokens, logprobs) -> int:
    """The reference: what _process_multi_step did before append_tokens."""
    for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
        checker.append_token(sp, seq, token, logprob, None)
        if seq.is_finished():
            return i + 1
    return len(tokens)


def state(seq: Sequence) -> tuple:
    return (seq.output_token_ids, seq.output_text, seq.status, seq.stop_reason, seq.cumulative_logprob,
            seq.num_pending_tokens)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_append_tokens_equals_one_by_one(any_tok, slow):
    tok = SlowView(any_tok) if slow else any_tok
    detok = Detokenizer(tok)
    vocab, eos = len(any_tok), any_tok.eos_token_id
    rng = make_rng(f"append_tokens/{any_tok.name_or_path}/{vocab}/{slow}")
    # Tokens whose bytes are not a whole character (tiny: ids >= 0x80 are lone UTF-8 bytes).
    partial = [t for t in range(vocab) if any_tok.decode([t]).endswith("\ufffd")]
    compared = stopped_at_last = 0
    for trial in range(300):
        num_steps = rng.randint(2, 9)
        stop_ids = rng.sample(range(vocab), rng.randint(0, 2))
        max_tokens = rng.randint(1, 20)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=rng.randint(0, min(max_tokens, 6)),
                            ignore_eos=rng.random() < 0.3, stop_token_ids=stop_ids,
                            stop=rng.choice([None, None, ["e"], ["ab", "\n", " t"]]))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        checker = StopChecker(len(prompt) + rng.randint(1, 30), eos, detok)
        seq = Sequence(0, prompt)
        for _ in range(rng.randint(0, 6)):  # the detokenizer mid-stream
            checker.append_token(sp, seq, rng.randrange(vocab), -rng.random(), None)
            if seq.is_finished():
                break
        if seq.is_finished():
            continue

        def token():
            r = rng.random()
            return (eos if r < 0.1 else rng.choice(stop_ids) if r < 0.2 and stop_ids
                    else rng.choice(partial) if r < 0.5 and partial else rng.randrange(vocab))

        tokens = [token() for _ in range(num_steps)]
        if rng.random() < 0.3:
            tokens[-1] = eos  # EOS at the K-th step
        logprobs = [-rng.random() * 5 for _ in tokens]
        seq.num_pending_tokens = rng.choice([0, 0, 1])
        ref = copy.deepcopy(seq)
        expected = one_by_one(checker, sp, ref, tokens, logprobs)
        got = checker.append_tokens(sp, seq, tokens, logprobs)
        where = ctx(trial=trial, prompt=prompt, tokens=tokens, sp=sp)
        assert got == expected, where
        assert state(seq) == state(ref), where
        compared += 1
        stopped_at_last += expected == num_steps and ref.is_finished()
        if not seq.is_finished():  # the detokenizer's state carries on alike
            more = [rng.randrange(vocab) for _ in range(3)]
            one_by_one(checker, sp, ref, more, [0.0] * 3)
            one_by_one(checker, sp, seq, more, [0.0] * 3)
            assert state(seq) == state(ref), where
    assert compared > 100 and stopped_at_last > 5  # the draws reach the cases meant
