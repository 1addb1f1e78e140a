"""The Proposer interface: what speculative decoding asks of a way to guess the next tokens.

A proposer drafts at one of two times. At scheduling (`draft`: host-only proposers such as the
n-gram lookup), the drafts go straight into the plan. After scheduling and the step's block moves
(`drafts_after_scheduling`: a draft model, whose K/V writes need the slots the scheduler
allocates), the scheduler reserves DRAFT_PENDING placeholders and `propose` puts the drafts in
(`Scheduler.set_drafts`). A proposer may compute them a step early on the device, right after
the target step that sampled (`after_dispatch`, read with that step's tokens by `read_ahead`: an
EAGLE head's chain, eagle_ahead.py, or a draft model's k decode steps, draft_ahead.py; the host's
side of both in ahead.py), so that `propose` makes no device call.

A proposer with device state hooks into the target's runner (jpaged/runner/model_runner.py), which
calls the hooks and knows nothing else of it: `shared_pools` are KV pools addressed by the
target's block ids (block copies and swaps iterate over them with the runner's own), `forward_kv`
sees every step's forward inputs (a draft model keeps its pages level with the target's),
`after_sample` every step's sampled tokens on the device,
`attach` hands it the target's runner (whose weights an EAGLE head reads),
`device_ops` are its device operations by name (a multi-host driver sends those too),
`warm_up` compiles its executables, and `check_sleep` refuses sleep when it cannot follow.
The defaults are a proposer with no device state; `Proposer()` itself proposes nothing (the
runner's default: no speculation).
"""

from jpaged.runner.step_memory import step_state_bytes

# A draft that comes after scheduling: the plan reserves each sequence's drafts as this
# placeholder, and Scheduler.set_drafts puts them in.
DRAFT_PENDING = -1


class Proposer:
    # True: `propose` drafts after the plan's block moves (the scheduler reserves DRAFT_PENDING);
    # False: `draft` drafts while scheduling.
    drafts_after_scheduling = False
    # True: the target's forward also returns its sampled rows' hidden states
    # (ModelRunner.hidden_states, on the device), for a proposer that drafts from them.
    needs_hidden_states = False
    # With needs_hidden_states: the hidden states entering these target layers at every token
    # instead (EAGLE-3's low, middle and high features), with the step's input ids.
    aux_hidden_layers: tuple[int, ...] = ()
    # True: `after_dispatch` drafts the next step from the step just dispatched (ahead.py): the
    # runner keeps that step's host inputs (`ModelRunner.last_prepared`).
    drafts_ahead = False

    # ------------------------------------------------------------------ drafts
    def draft(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts after a sequence's `token_ids`, while scheduling (empty: none)."""
        return []

    def propose(self, plan, scheduler, runner, seed_of) -> None:
        """The drafts of the groups `plan` reserved DRAFT_PENDING for, into the plan
        (Scheduler.set_drafts), after the plan's block moves. `seed_of(params, seq)`: the seed
        the target's rows sample with."""

    def after_dispatch(self, dispatched, runner) -> None:
        """Right after a target step's dispatch (`dispatched`: its DispatchedStep), before any
        host read: start the next step's drafts on the device from the tokens it samples (an
        EAGLE head's chain, eagle_ahead.py)."""

    def read_ahead(self, dispatched, runner) -> None:
        """When `dispatched`'s sampled tokens are read: read the drafts `after_dispatch` started
        for it, for the next step's `propose`."""

    # ------------------------------------------------------------------ the runner's hooks
    def attach(self, runner) -> None:
        """The target's runner, once built. A proposer that uses the target's weights (an EAGLE
        head: its embedding) reads them from `runner.state` at every call: LoRA slot writes
        (donated) and load_weights replace those arrays."""

    def shared_pools(self) -> list:
        """KV pools addressed by the target's block ids: each has copy_pool_blocks(src, dst),
        swap_pool_out(gpu, cpu) and swap_pool_in(cpu, gpu) (a ModelRunner does)."""
        return []

    def forward_kv(self, num_tokens: int, inputs, last_tokens, block_table) -> None:
        """Every target step's packed forward inputs (before `last_tokens` is donated), with the
        target's device block table they index."""

    def after_step(self, num_tokens: int, inputs, hidden, sampled, block_table) -> None:
        """With needs_hidden_states: every target step's packed inputs, the forward's hidden
        states (on the device), the sampler's packed output (on the device) and the target's
        device block table."""

    def after_sample(self, sampled, block_table) -> None:
        """Every target step's sampler's packed output (on the device) and the target's device
        block table, unless the step skipped the hooks: what a proposer that drafts right after
        the step (`after_dispatch`) reads in its device operation (multi-host: on every process)."""

    def device_ops(self) -> dict:
        """Device operations by name, run by the target runner's dispatch (multi-host: everywhere)."""
        return {}

    def warm_up(self, stop=None) -> None:
        """Compile (or load) the proposer's executables."""

    def bypass_executable_cache(self) -> None:
        """Forget what warm_up loaded and load nothing more from disk."""

    @property
    def num_compilations(self) -> int:
        return 0

    @property
    def executable_cache_hits(self) -> int:
        return 0

    def is_alive(self) -> bool:
        """False once its device state is gone (a step that failed after donating it)."""
        return True

    def check_sleep(self) -> None:
        """ValueError if the engine cannot sleep with this proposer."""


class RunnerProposer(Proposer):
    """A proposer that owns a ModelRunner (`self.runner`: a draft model's or an EAGLE head's),
    whose pages are addressed by the target's block ids: its hooks are that runner's."""
    drafts_after_scheduling = True
    runner = None  # set by the subclass's __init__
    method = ""  # speculative_config's method, for the sleep refusal

    @classmethod
    def device_state_bytes(cls, model, *, max_num_seqs: int, max_model_len: int, **shape) -> int:
        """Bytes per device its runner will hold besides its share of every KV block (which the
        pool's bytes per block count): the runner's step state. Known before the pool is sized
        (engine/start_up.kv_pool_size plans them); `model` is what the proposer is built from (a
        DraftModel, an EagleHead), `shape` the target runner's."""
        return step_state_bytes(max_num_seqs, max_model_len, model.kv_cache_spec.block_size)

    def shared_pools(self) -> list:
        return [self.runner]

    def bypass_executable_cache(self) -> None:
        self.runner.bypass_executable_cache()

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    @property
    def executable_cache_hits(self) -> int:
        return self.runner.executable_cache.hits

    def is_alive(self) -> bool:
        return self.runner.is_alive()

    def check_sleep(self) -> None:
        raise ValueError(f"sleep is not supported with speculative_config method '{self.method}'")
