"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch.

  request.py  LoRARequest (vLLM's): which adapter a request runs with
  peft.py     reading and checking PEFT adapters (adapter_config.json + safetensors)
  model.py    the adapter slots in the model's projections, and one slot's contents
  manager.py  host side: adapters read once (an LRU of max_cpu_loras), device slots
              (max_loras) filled as steps need them, without compiling anything

A token's adapter is its slot index (ForwardContext.lora_slots); Linear adds x·A·B of that slot.
The scheduler keeps at most max_loras adapters in a step; a block's prefix-cache hash starts
from its adapter, so two adapters never share K/V.
"""
