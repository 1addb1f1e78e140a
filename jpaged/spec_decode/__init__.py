"""Speculative decoding (vLLM's `speculative_config`): proposers guess the next tokens of a
decoding sequence, the target model verifies them all in one forward, and the rejection rule
keeps exactly the target's distribution.

  config.py     SpeculativeConfig: the options, checked (ValueError naming the field)
  proposer.py   the Proposer interface: drafts while scheduling or after the plan's block moves,
                and the hooks the target's runner calls (each step's K/V forward, pools that
                share block ids for copies and swaps, device operations, warm-up, sleep)
  ngram.py      NgramProposer, prompt lookup: the tokens that followed the last occurrence of
                the sequence's own suffix (host, numpy)
  ahead.py      drafts computed right after the target step that sampled, the host's side
                (vLLM v1's order; the EAGLE head's and the draft model's): which rows verify
                which drafts, the scratch blocks past the target's, and AheadProposer, which
                dispatches them with the step, reads them with its tokens and puts them in the
                next plan (Scheduler.set_drafts, in place of the reserved ones)
  draft_model.py  DraftModelProposer, a smaller checkpoint of the same vocabulary: loaded and
                checked here; it owns the draft's DraftRunner (pages, forward, executables)
  draft_ahead.py  the draft model's k decode steps from each sequence's new last token (its
                accepted drafts counted on the device), dispatched right after the target
                step that sampled, its drafts read with that step's tokens
  eagle_head.py the EAGLE-3 head (fc, one midlayer, norm, a reduced-vocabulary LM head, d2t/t2d)
                and the EAGLE-1/2 head (fc over the embedding and the target's output, one decoder
                layer, the target's LM head), in the public checkpoints' layouts, loaded and checked
                against the target
  eagle.py      EagleProposer: the head's pages (one layer, the target's block ids), its pass over
                every target step (the target's hidden states entering three of its layers, or its
                output) and its k-draft chain on the device (eagle_ahead.py), dispatched right
                after the target step that sampled, its drafts read with that step's tokens
  speculator.py which sequences speculate and how many drafts they take this step, and the
                counters (stats(), Prometheus); the acceptance is Scheduler._accept's

How a step speculates (the scheduler owns it, as every sequence update): a decoding sequence's
drafts d1..dk ride with its last token as a k+1-token chunk at positions L-1 .. L+k-1, in
lookahead slots; the runner samples a row at each of those k+1 positions, row i with the key of
output position len+i, exactly as a step without speculation would. update_from_output accepts
drafts while row i's token equals d(i+1), then appends the first token that differs, or the
bonus token after all k: the rejection rule of Leviathan et al. 2023 for a draft that proposes
d with probability 1 (accept with p(d); else draw from p without d, renormalised) is the same
joint law as "draw y ~ p, accept if y == d, else emit y". Greedy rows are argmax agreement.
A draft model's drafts are drawn with the same keys as the target's rows (shared Gumbel noise),
so the same rule emits exactly the target's draws (draft_model.py).
Drafts that were rejected leave K/V past the sequence's computed tokens, which nothing reads and
later tokens overwrite; prefix-cache hashes cover accepted tokens only.
With LoRA, the target's rows verify with each request's adapter (a draft model drafts without
adapters: fewer drafts are accepted, the output is the adapted target's; an EAGLE head reads the
hidden states of the target with the request's adapter, and the target's current embedding). With async scheduling,
a step that may take drafts waits for the last step's tokens (drafts start from the last token,
and a step that verified drafts leaves the accepted count unknown until read): the speculator's
`may_draft`, in step_needs.can_overlap; other steps (above disable_by_batch_size, requests that
cannot speculate) overlap as without speculation. Steps above disable_by_batch_size
(SchedulerOutputs.spec_disabled) also skip the proposer's per-step hooks (the runner's
`hookless_from`): a draft model's or EAGLE head's pages then miss those steps' tokens, which
lowers later acceptance, never changes the output.
"""
