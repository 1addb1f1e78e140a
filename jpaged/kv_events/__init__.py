"""KV-cache events in vLLM's wire format: which blocks each replica's prefix cache stores and evicts,
published over ZMQ for fleet routers (llm-d, SGLang's model gateway, NVIDIA Dynamo) and jpaged's
own data-parallel router. `config.py`: vLLM's KVEventsConfig; `events.py`: the msgpack schema of
vLLM's `vllm/distributed/kv_events.py`; `publisher.py`: the PUB socket, its replay socket and thread."""
