"""The Proposer interface (jpaged/spec_decode/proposer.py) seen from the runner: the pools that
share block ids, and the forward's optional hidden states of the sampled rows."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jpaged
from jpaged.spec_decode.draft_model import DraftModelProposer
from jpaged.spec_decode.ngram import NgramProposer
from jpaged.spec_decode.proposer import Proposer

LIMITS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True)
GREEDY = jpaged.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_runner_pools_are_its_own_and_the_proposers():
    plain = jpaged.LLM("tiny", **LIMITS).llm_engine
    assert type(plain.runner.proposer) is Proposer and plain.runner.pools == [plain.runner]
    ngram = jpaged.LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **LIMITS)
    engine = ngram.llm_engine
    assert isinstance(engine.proposer, NgramProposer) and engine.scheduler.speculator.proposer is engine.proposer
    assert engine.runner.pools == [engine.runner]
    draft = jpaged.LLM("tiny", speculative_config={"method": "draft_model", "model": "tiny",
                                                   "num_speculative_tokens": 2}, **LIMITS).llm_engine
    assert isinstance(draft.proposer, DraftModelProposer) and draft.runner.proposer is draft.proposer
    assert draft.runner.pools == [draft.runner, draft.proposer.runner]
    assert draft.proposer.runner.proposer is not draft.proposer  # the draft's runner has no proposer of its own
    assert not hasattr(draft.runner, "draft") and not hasattr(draft.runner, "is_draft")


def test_forward_returns_the_sampled_rows_hidden_states_only_when_asked():
    # (Synchronous: with a step in flight when the last token is read, the last forward would be that step's.)
    llm = jpaged.LLM("tiny", async_scheduling=False, **LIMITS)
    runner = llm.llm_engine.runner
    prompt = [5, 9, 11, 3, 7]
    reference = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not runner.return_hidden and runner.hidden_states is None  # off by default
    runner.return_hidden = True  # what a proposer with needs_hidden_states sets up
    runner.bypass_executable_cache()
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == reference  # the same logits, the same tokens
    hidden = runner.hidden_states
    model = nnx.merge(runner.graphdef, runner.state)
    assert hidden.ndim == 2 and hidden.shape[0] >= 1
    # The last step's first row: the hidden state the last token was sampled from.
    logits = np.asarray(model.compute_logits(hidden[:1]).astype(jnp.float32))
    assert int(logits[0].argmax()) == reference[-1]
