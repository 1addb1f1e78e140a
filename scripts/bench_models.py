"""The benchmarks' models: random Llamas of preset shapes (`PRESETS`: micro, 25m, and the 1B and 8B
shapes for GPUs) saved as Hugging Face checkpoints, and jpaged's built-in `tiny` model as one.
bench_throughput, bench_host, bench_startup, bench_weight_updates and gpu_check build from here."""

import logging

logger = logging.getLogger("bench_throughput")

# Random-Llama presets: LlamaConfig overrides. 25m ~= 25.2M parameters (fp32 on CPU);
# 1b is Llama-3.2-1B-shaped and 8b Llama-3-8B-shaped (bf16, for GPUs).
PRESETS = {
    # The host-bound case: a model this small takes microseconds per step on the device.
    "micro": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 512, "vocab_size": 384, "max_position_embeddings": 4096,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32"},
    "25m": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
            "intermediate_size": 1344, "vocab_size": 259, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32"},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "tie_word_embeddings": True, "dtype": "bfloat16"},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "tie_word_embeddings": False, "dtype": "bfloat16"},
}
TINY_VOCAB = 259


def build_random_llama(size: str, out_dir: str, seed: int, vocab_size: int | None = None) -> str:
    """Save a randomly initialised Llama (config + safetensors [+ tiny tokenizer]) to out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(PRESETS[size])
    if vocab_size:
        spec["vocab_size"] = vocab_size
    dtype = getattr(torch, spec.pop("dtype"))
    with_tokenizer = spec["vocab_size"] == TINY_VOCAB
    special = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258} if with_tokenizer else \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    cfg = LlamaConfig(**spec, **special, rms_norm_eps=1e-5, initializer_range=0.02,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    if with_tokenizer:
        from jpaged.models.tiny import tiny_tokenizer
        tiny_tokenizer().save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    del model
    logger.info("random Llama %s: %.1fM parameters (%s) -> %s", size, n / 1e6, dtype, out_dir)
    return out_dir


def build_tiny_checkpoint(out_dir: str) -> str:
    """jpaged's built-in tiny model as an HF checkpoint dir (for the hf backend)."""
    import torch
    from transformers import LlamaForCausalLM

    from jpaged.models.tiny import tiny_config, tiny_tokenizer, tiny_weights

    cfg = tiny_config()
    model = LlamaForCausalLM(cfg).to(torch.float32)
    state = {k: torch.from_numpy(v) for k, v in tiny_weights(cfg)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"tiny weights do not match LlamaForCausalLM: {missing} {unexpected}")
    model.save_pretrained(out_dir)
    tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


def model_vocab_size(model: str) -> int:
    if model == "tiny":
        return TINY_VOCAB
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model).get_text_config().vocab_size
