"""A step's M-RoPE positions (Qwen2-VL, Qwen2.5-VL: models with `uses_mrope`), on the host.

The runner builds every step's 1-D positions (each token's place in its sequence, prepare_inputs.py);
for an M-RoPE model they become int32[3, tokens] here: a prompt's tokens take their column of the
prompt's table (jpaged/models/mrope.py, computed once per request from its token ids and its
images' grids, kept on the group), later tokens (decodes) position + delta in all three. A
prompt without images keeps its 1-D positions in all three rows (the ordinary rotary embedding).
"""

import dataclasses

from jpaged.models.mrope import step_mrope_positions

_NONE = ()  # a group whose prompt has no images: no table


def group_mrope(model, group):
    """The group's (positions [3, prompt len], delta), computed on first use and kept; None when
    its prompt has no images."""
    table = getattr(group, "mrope_table", None)
    if table is None:
        items = getattr(group, "mm_items", None) or []
        table = model.mrope_prompt(group.prompt_token_ids, [item.pixel_inputs for item in items]) if items else _NONE
        group.mrope_table = table
    return None if table is _NONE else table


def batch_mrope_positions(model, batch, positions):
    """`positions` (prepare_step's int32[tokens] for `batch`, a StepBatch) as int32[3, tokens]."""
    tables = [None] * len(batch.token_ids)
    for scheduled, first, _ in batch.groups:
        table = group_mrope(model, scheduled.seq_group)
        for j in range(first, first + len(scheduled.seqs)):
            tables[j] = table
    return step_mrope_positions(positions, [len(ids) for ids in batch.token_ids], tables)


def with_mrope_positions(model, batch, inputs):
    """The step's StepInputs (numpy, from prepare_step) with M-RoPE positions int32[3, tokens]."""
    return dataclasses.replace(inputs, positions=batch_mrope_positions(model, batch, inputs.positions))
