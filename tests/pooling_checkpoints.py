"""Tiny random pooling checkpoints, saved as sentence-transformers and transformers save them:
the references (SentenceTransformer.encode, CrossEncoder.predict) read the same directories."""

import os

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "hello", "world", "is", "good", "bad", "of", "and", "to",
         "in", "paris", "france", "capital", "city", "river", "blue", "red", "fast", "slow", "yes", "no"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# XLM-R's ids: <s> 0, <pad> 1 (its padding_idx: positions start after it), </s> 2.
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
TEXTS = ["hello world", "the cat sat on the mat", "a", "paris is the capital city of france",
         "the blue river is fast and the red river is slow " * 6, "dog", "good and bad, fast and slow!"]


def _tokenizer(path: str, roberta: bool):
    from transformers import BertTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = (ROBERTA_SPECIALS if roberta else BERT_SPECIALS) + WORDS + CHARS + ["##" + c for c in CHARS]
    vocab_file = os.path.join(path, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    if roberta:  # no token types (as XLMRobertaTokenizer)
        return BertTokenizerFast(vocab_file, cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", mask_token="<mask>", model_input_names=["input_ids",
                                                                                            "attention_mask"])
    return BertTokenizerFast(vocab_file)


def _config(kind: str, vocab_size: int, **extra):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, **extra)
    if kind == "bert":
        return transformers.BertConfig(max_position_embeddings=128, **common)
    if kind == "xlm-roberta":
        return transformers.XLMRobertaConfig(max_position_embeddings=130, pad_token_id=1, bos_token_id=0,
                                             eos_token_id=2, type_vocab_size=1, **common)
    if kind == "modernbert":  # 4 layers: global, local, local, global; an 8-token local window (4 each side);
        # a local rotary theta far from the global one, so that using the wrong one shows
        return transformers.ModernBertConfig(max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=3,
                                             global_rope_theta=160000.0, local_rope_theta=10.0, pad_token_id=0,
                                             bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                                             **{**common, "num_hidden_layers": 4})
    return transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                    **{"tie_word_embeddings": True, **common})


def make_embedder(root: str, kind: str, pooling: str, normalize: bool = True, **config_extra) -> str:
    """A SentenceTransformer (Transformer -> Pooling [-> Normalize]) of `kind` saved under root."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    torch.manual_seed(0)
    base = os.path.join(root, f"{kind}-{pooling}-base")
    tok = _tokenizer(base, roberta=kind == "xlm-roberta")
    cfg = _config(kind, len(tok.get_vocab()), **config_extra)
    model = transformers.AutoModel.from_config(cfg).eval()
    with torch.no_grad():  # random LayerNorm / RMSNorm weights too, so they are really read
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(base)
    tok.save_pretrained(base)
    modules = [models.Transformer(base), models.Pooling(cfg.hidden_size, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    out = os.path.join(root, f"{kind}-{pooling}")
    SentenceTransformer(modules=modules).save(out)
    return out


def make_cross_encoder(root: str, kind: str, **config_extra) -> str:
    """A BertForSequenceClassification, XLMRobertaForSequenceClassification or
    ModernBertForSequenceClassification with one label."""
    import torch
    import transformers

    torch.manual_seed(1)
    path = os.path.join(root, f"{kind}-reranker" + "".join(f"-{v}" for v in config_extra.values()))
    tok = _tokenizer(path, roberta=kind == "xlm-roberta")
    cfg = _config(kind, len(tok.get_vocab()), num_labels=1, **config_extra)
    cls = {"bert": transformers.BertForSequenceClassification, "xlm-roberta": transformers.XLMRobertaForSequenceClassification,
           "modernbert": transformers.ModernBertForSequenceClassification}[kind]
    model = cls(cfg).eval()
    with torch.no_grad():  # classifier weights large enough that the scores differ
        for name, p in model.named_parameters():
            if "classifier" in name or "pooler" in name or name.startswith("head."):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_causal_reranker(root: str, tied: bool) -> str:
    """A Qwen3ForCausalLM whose LM head has "yes" and "no" rows (Qwen3-Reranker's shape)."""
    import torch
    import transformers

    torch.manual_seed(2)
    path = os.path.join(root, f"qwen3-causal-reranker-{'tied' if tied else 'untied'}")
    tok = _tokenizer(path, roberta=False)
    cfg = _config("qwen3", len(tok.get_vocab()), tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # LM-head rows that make yes and no differ, not saturate
        model.lm_head.weight.normal_(0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
