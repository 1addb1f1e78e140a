"""The host side of multi-LoRA: adapters read once and kept (an LRU of max_cpu_loras), and the
device's max_loras slots, filled as each step's adapters need them (vLLM's LRUCacheLoRAModelManager).

`add(request)` reads and checks an adapter when a request brings it (ValueError naming what is
wrong; a request id seen before reuses what was read). A server reads its adapters elsewhere
(`read`, in a worker thread: never on the engine thread) and hands them over with `register`:
those are kept (compact, unpadded) until `remove`, so the engine thread never reads their files
again. `remove` while requests still run with the adapter retires it: new requests with it are
refused, the running ones finish with it, and it is forgotten once none is left.

`slots(ids)` gives each adapter of a step its device slot: an adapter already in a slot keeps it;
another takes a free slot or the least recently used one no adapter of this step holds, its
weights written there by the runner's one `write_lora` executable (no compile). The scheduler
puts at most max_loras adapters in a step.
"""

import collections

import numpy as np

from jpaged.lora.model import LoRATarget, slot_weights
from jpaged.lora.peft import PeftAdapter, load_peft_adapter
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
        self._linears = list(runner.lora_linears.items())  # (nnx path, Linear), the runner's order
        self._read: collections.OrderedDict[int, tuple[LoRARequest, dict]] = collections.OrderedDict()
        self._slots: list[int | None] = [None] * max_loras  # lora_int_id held by each device slot
        self._used: collections.OrderedDict[int, None] = collections.OrderedDict()  # slot ids, least recent first
        self.num_slot_writes = 0
        # Adapters handed over read (register): lora_int_id -> (request, adapter), until removed.
        self._sources: dict[int, tuple[LoRARequest, PeftAdapter]] = {}
        self._retired: dict[int, list] = {}  # removed while these groups ran with them
        self._removed: set[int] = set()  # registered ids removed: never read from their path again

    def read(self, request: LoRARequest, **options) -> tuple[PeftAdapter, dict]:
        """The request's adapter read and checked against the model (its slot contents too),
        touching nothing of the manager: safe in any thread. ValueError if it is unusable;
        `options` go to load_peft_adapter (download, allowed_dirs)."""
        adapter = load_peft_adapter(request.lora_path, self.max_lora_rank, **options)
        return adapter, slot_weights(adapter, self.targets, self.max_lora_rank, self.dtype)

    def register(self, request: LoRARequest, adapter: PeftAdapter, weights: dict | None = None):
        """Keep an adapter read elsewhere (`read`) under the request's id until `remove`."""
        self._check_id(request)
        if request.lora_int_id in self._removed:
            raise ValueError(f"lora_int_id={request.lora_int_id} named an adapter that was removed; give "
                             f"{request.lora_name!r} another id")
        self._sources[request.lora_int_id] = (request, adapter)
        self._keep(request, weights if weights is not None else
                   slot_weights(adapter, self.targets, self.max_lora_rank, self.dtype))

    def _check_id(self, request: LoRARequest):
        known = self._read.get(request.lora_int_id) or self._sources.get(request.lora_int_id)
        if known is not None and (known[0].lora_name, known[0].lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id={request.lora_int_id} already names adapter {known[0].lora_name!r}; "
                             f"give {request.lora_name!r} another id")

    def add(self, request: LoRARequest) -> dict:
        """Read (or find) the request's adapter: its slot contents. ValueError if it is unusable,
        if its id already names another adapter, or if it was registered and then removed."""
        self._collect()
        if request.lora_int_id in self._retired or request.lora_int_id in self._removed:
            raise ValueError(f"The lora adapter '{request.lora_name}' was unloaded.")
        return self._weights(request)

    def _weights(self, request: LoRARequest) -> dict:
        self._check_id(request)
        known = self._read.get(request.lora_int_id)
        if known is not None:
            self._read.move_to_end(request.lora_int_id)
            return known[1]
        source = self._sources.get(request.lora_int_id)
        if source is not None:  # registered: rebuilt from what was read, no file touched
            weights = slot_weights(source[1], self.targets, self.max_lora_rank, self.dtype)
        else:
            weights = self.read(request)[1]
        return self._keep(request, weights)

    def _keep(self, request: LoRARequest, weights: dict) -> dict:
        self._read[request.lora_int_id] = (request, weights)
        self._read.move_to_end(request.lora_int_id)
        keep = set(self._slots) | {request.lora_int_id}
        for lora_id in list(self._read):  # the least recently used that no slot holds go first
            if len(self._read) <= self.max_cpu_loras:
                break
            if lora_id not in keep:
                del self._read[lora_id]
        return weights

    def remove(self, lora_int_id: int, live_groups=()) -> bool:
        """Forget an adapter (the server's unload). Of `live_groups` (the engine's unfinished
        SequenceGroups), those running with it finish with it: until then it is retired (new
        requests refused), then forgotten. False if it was not known."""
        found = lora_int_id in self._read or lora_int_id in self._sources
        if lora_int_id in self._sources:
            self._removed.add(lora_int_id)
        users = [g for g in live_groups if g.lora_request is not None and g.lora_request.lora_int_id == lora_int_id]
        if users:
            self._retired[lora_int_id] = users
        else:
            self._forget(lora_int_id)
        return found

    def _forget(self, lora_int_id: int):
        self._retired.pop(lora_int_id, None)
        self._sources.pop(lora_int_id, None)
        self._read.pop(lora_int_id, None)
        if lora_int_id in self._slots:
            self._slots[self._slots.index(lora_int_id)] = None

    def _collect(self):
        """Forget retired adapters whose last request finished."""
        for lora_int_id, users in list(self._retired.items()):
            if all(g.is_finished() for g in users):
                self._forget(lora_int_id)

    def requests(self) -> list[LoRARequest]:
        return [request for request, _ in self._read.values()]

    def slots_of(self, scheduled_groups) -> dict[int, int]:
        """The device slot of each adapter a step's groups (ScheduledSequenceGroups) run with."""
        return self.slots({s.seq_group.lora_request.lora_int_id: s.seq_group.lora_request for s in scheduled_groups
                           if s.seq_group.lora_request is not None})

    def slots(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """The device slot of each adapter of a step ({lora_int_id: request}, at most max_loras),
        writing those not in one yet (read again if the host LRU let them go)."""
        self._collect()
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
            weights = self._weights(requests[lora_id])  # read again if the host LRU let it go
            self.runner.write_lora_slot(slot, [weights.get(path) or self._zeros(linear)
                                               for path, linear in self._linears])
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
