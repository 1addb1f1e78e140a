"""Helpers shared by the tests that check jpaged against Hugging Face transformers on small
random checkpoints."""

VOCAB = 259  # the tiny tokenizer's, saved with each checkpoint (the server needs one)


def save_random_llama(path, seed: int, num_hidden_layers: int = 2) -> str:
    """A random Llama (64 wide, 4 heads over 2 kv heads) written by transformers with the tiny
    tokenizer; the LM head scaled up so greedy choices are far apart, stable across float orders."""
    import torch
    import transformers

    from jpaged.models import tiny

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return str(path)


def hf_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' greedy tokens, the whole sequence recomputed each step (no EOS handling)."""
    import torch

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(steps):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        out.append(ids[0, len(prompt):].tolist())
    return out
