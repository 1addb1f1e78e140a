"""The host side of multi-LoRA: adapters read once and kept (an LRU of max_cpu_loras), and the
device's max_loras slots, filled as each step's adapters need them (vLLM's LRUCacheLoRAModelManager).

`add(request)` reads and checks an adapter when a request brings it (ValueError naming what is
wrong; a request id seen before reuses what was read). `slots(ids)` gives each adapter of a step
its device slot: an adapter already in a slot keeps it; another takes a free slot or the least
recently used one no adapter of this step holds, its weights written there by the runner's one
`write_lora` executable (no compile). The scheduler puts at most max_loras adapters in a step.
"""

import collections

import numpy as np

from jpaged.lora.model import LoRATarget, slot_weights
from jpaged.lora.peft import load_peft_adapter
from jpaged.lora.request import LoRARequest


def check_lora_request(lora_request, manager: "LoRAManager | None") -> "LoRAManager":
    """The engine's manager, if `lora_request` is a LoRARequest and the engine serves LoRA."""
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    if manager is None:
        raise ValueError("lora_request needs an engine with enable_lora=True")
    return manager


class LoRAManager:
    def __init__(self, targets: dict[str, LoRATarget], runner, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, dtype):
        self.targets, self.runner = targets, runner
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype = dtype
        self._linears = list(runner.lora_linears.values())
        self._read: collections.OrderedDict[int, tuple[LoRARequest, dict]] = collections.OrderedDict()
        self._slots: list[int | None] = [None] * max_loras  # lora_int_id held by each device slot
        self._used: collections.OrderedDict[int, None] = collections.OrderedDict()  # slot ids, least recent first
        self.num_slot_writes = 0

    def add(self, request: LoRARequest) -> dict:
        """Read (or find) the request's adapter: its slot contents. ValueError if it is unusable,
        or if its id already names another adapter."""
        known = self._read.get(request.lora_int_id)
        if known is not None:
            if (known[0].lora_name, known[0].lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id={request.lora_int_id} already names adapter {known[0].lora_name!r} "
                                 f"({known[0].lora_path}); give {request.lora_name!r} another id")
            self._read.move_to_end(request.lora_int_id)
            return known[1]
        adapter = load_peft_adapter(request.lora_path, self.max_lora_rank)
        weights = slot_weights(adapter, self.targets, self.max_lora_rank, self.dtype)
        self._read[request.lora_int_id] = (request, weights)
        keep = set(self._slots) | {request.lora_int_id}
        for lora_id in list(self._read):  # the least recently used that no slot holds go first
            if len(self._read) <= self.max_cpu_loras:
                break
            if lora_id not in keep:
                del self._read[lora_id]
        return weights

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (the server's unload): its slot empties. False if it was not known."""
        found = self._read.pop(lora_int_id, None) is not None
        if lora_int_id in self._slots:
            self._slots[self._slots.index(lora_int_id)] = None
        return found

    def requests(self) -> list[LoRARequest]:
        return [request for request, _ in self._read.values()]

    def slots_of(self, scheduled_groups) -> dict[int, int]:
        """The device slot of each adapter a step's groups (ScheduledSequenceGroups) run with."""
        return self.slots({s.seq_group.lora_request.lora_int_id: s.seq_group.lora_request for s in scheduled_groups
                           if s.seq_group.lora_request is not None})

    def slots(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """The device slot of each adapter of a step ({lora_int_id: request}, at most max_loras),
        writing those not in one yet (read again if the host LRU let them go)."""
        lora_ids = set(requests)
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"{len(lora_ids)} adapters in one step; max_loras={self.max_loras}")
        out = {}
        for lora_id in lora_ids:
            if lora_id in self._slots:
                out[lora_id] = self._slots.index(lora_id)
        for lora_id in sorted(lora_ids - set(out)):
            free = [i for i, held in enumerate(self._slots) if held is None]
            if free:
                slot = free[0]
            else:  # the least recently used slot this step does not need
                slot = next(i for i in self._used if i not in out.values())
            weights = self.add(requests[lora_id])  # read again if the host LRU let it go
            self.runner.write_lora_slot(slot, [weights.get(id(linear)) or self._zeros(linear)
                                               for linear in self._linears])
            self.num_slot_writes += 1
            self._slots[slot] = lora_id
            out[lora_id] = slot
        for slot in out.values():
            self._used.pop(slot, None)
            self._used[slot] = None
        return out

    def _zeros(self, linear):
        lead = linear.kernel.shape[:linear.kernel.ndim - len(linear.in_shape) - len(linear.out_shape)]
        return (np.zeros(lead + linear.in_shape + (self.max_lora_rank,), self.dtype),
                np.zeros(lead + (self.max_lora_rank,) + linear.out_shape, self.dtype))
