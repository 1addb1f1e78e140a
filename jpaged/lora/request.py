"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` >= 1 names the adapter inside the engine (its slot, its prefix-cache keys);
    `lora_path` is a PEFT adapter directory or hub id, read the first time the id is seen."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r}; expected a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r}; expected an integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r}; expected an adapter directory or hub id")
