"""The built-in `tiny` model: a 3.3M-parameter Llama with seeded weights and a byte-level
tokenizer, so everything runs on a fresh machine with no files and no network.

Its text is meaningless. Weights are drawn with a gain large enough that greedy choices are
decisive (the top two logits are far apart), so outputs are stable across backends and
batch shapes. It goes through the same loader path as a real checkpoint.
"""

import functools
from typing import TYPE_CHECKING, Iterator

import numpy as np
from transformers import PretrainedConfig, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformers import LlamaConfig

SEED = 0
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


CONFIG = dict(
    vocab_size=259, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    architectures=["LlamaForCausalLM"], dtype="float32",
)
# What LlamaConfig adds to CONFIG (transformers 5's defaults; tests/test_tiny.py checks them).
LLAMA_DEFAULTS = dict(hidden_act="silu", attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                      initializer_range=0.02, use_cache=True, pretraining_tp=1,
                      rope_parameters={"rope_type": "default", "rope_theta": CONFIG["rope_theta"]})


def tiny_config() -> "LlamaConfig":
    """tiny's config as transformers' LlamaConfig: to save it as a checkpoint or build the HF model."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


class TinyLlamaConfig(PretrainedConfig):
    model_type = "llama"


def tiny_engine_config() -> PretrainedConfig:
    """The config the engine loads `tiny` with: tiny_config()'s fields and values on transformers'
    base config class. LlamaConfig, like any class under transformers.models, would import that
    package, which indexes its ~1,700 files again for its lazy imports (about 0.4 s of a 2 s start)."""
    return TinyLlamaConfig(**CONFIG, **LLAMA_DEFAULTS)


def tiny_weights(cfg) -> Iterator[tuple[str, np.ndarray]]:
    """Seeded weights in Hugging Face naming and layout ([out, in] for linear layers)."""
    rng = np.random.default_rng(SEED)
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def linear(out_dim, in_dim, gain=1.0):
        return (rng.standard_normal((out_dim, in_dim)) * gain / np.sqrt(in_dim)).astype(np.float32)

    yield "model.embed_tokens.weight", rng.standard_normal((cfg.vocab_size, e)).astype(np.float32)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", np.ones(e, np.float32)
        # A larger query/key gain gives peaked attention, so context matters to the output.
        yield f"{p}.self_attn.q_proj.weight", linear(q, e, 2.0)
        yield f"{p}.self_attn.k_proj.weight", linear(kv, e, 2.0)
        yield f"{p}.self_attn.v_proj.weight", linear(kv, e)
        yield f"{p}.self_attn.o_proj.weight", linear(e, q)
        yield f"{p}.post_attention_layernorm.weight", np.ones(e, np.float32)
        yield f"{p}.mlp.gate_proj.weight", linear(f, e)
        yield f"{p}.mlp.up_proj.weight", linear(f, e)
        yield f"{p}.mlp.down_proj.weight", linear(e, f)
    yield "model.norm.weight", np.ones(e, np.float32)
    yield "lm_head.weight", linear(cfg.vocab_size, e, 6.0)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: token id = byte value, then <s>=256, </s>=257, <pad>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab.update({BOS: 256, EOS: 257, PAD: 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=4096)
