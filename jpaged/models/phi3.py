"""Phi-3 (and Phi-4-mini): Llama's structure with q/k/v fused in one `qkv_proj` and gate/up in one
`gate_up_proj`, split at load time; LongRoPE ("longrope", formerly "su") scaling and a partial
rotary factor as the config says; a sliding window over every layer when the config sets one."""

from flax import nnx

from jpaged.models.layers import GatedMLP, HFWeights, fused_rows
from jpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM, llama_attention


class Phi3DecoderLayer(LlamaDecoderLayer):
    def hf_weights(self, prefix: str) -> HFWeights:
        attn, mlp = self.self_attn.hf_weights(f"{prefix}.self_attn"), self.mlp.hf_weights(f"{prefix}.mlp")
        part = lambda specs, name: specs.pop(f"{prefix}.{name}.weight")  # noqa: E731
        qkv = fused_rows(part(attn, "self_attn.q_proj"), part(attn, "self_attn.k_proj"), part(attn, "self_attn.v_proj"))
        gate_up = fused_rows(part(mlp, "mlp.gate_proj"), part(mlp, "mlp.up_proj"))
        return {**self.input_layernorm.hf_weights(f"{prefix}.input_layernorm"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **attn, **mlp, f"{prefix}.self_attn.qkv_proj.weight": qkv, f"{prefix}.mlp.gate_up_proj.weight": gate_up}


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_layer(cfg, *, ops, dtype, max_model_len) -> nnx.Module:
        attn = llama_attention(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len)
        return Phi3DecoderLayer(attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype),
                                cfg, dtype=dtype)
