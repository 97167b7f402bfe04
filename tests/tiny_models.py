"""Tiny random causal LMs built from configs (offline, seconds on CPU) and helpers shared by the tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, Qwen2Config, Qwen3Config

PAD, EOS, BOS = 0, 1, 2

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=BOS,
    tie_word_embeddings=False,
)

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma": GemmaConfig,
}


def tiny_model(kind: str = "llama", vocab_size: int = 64, seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A random model; ``logit_scale`` sharpens its next-token distributions so tests can see differences."""
    torch.manual_seed(seed)
    kwargs = dict(_COMMON, vocab_size=vocab_size)
    if kind == "gemma":
        kwargs.update(head_dim=8, tie_word_embeddings=True)
    if kind == "gemma2":
        from transformers import Gemma2Config

        kwargs.update(head_dim=8, tie_word_embeddings=True, final_logit_softcapping=5.0, sliding_window=4,
                      query_pre_attn_scalar=8)
        config = Gemma2Config(**{**kwargs, **overrides})
    else:
        config = CONFIGS[kind](**{**kwargs, **overrides})
    # Gemma-2 soft-caps attention scores, which only eager attention applies (transformers >= 5.2x refuses sdpa).
    attention = "eager" if kind == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    model.generation_config.pad_token_id = PAD
    return model


def padded_prompts(lengths: list[int], vocab_size: int = 64, seed: int = 0):
    """Left-padded random prompts of the given lengths (token ids >= 3) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab_size, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def char_tokenizer(vocab_size: int = 64):
    """A character-level fast tokenizer (offline): ids 0/1/2 are pad/eos/bos, then printable characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,:;()ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: vocab_size - 3]
    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        bos_token="<s>", padding_side="left")
    return tokenizer


def save_with_char_tokenizer(model, path, chat_template: str | None = None):
    """``model`` and ``char_tokenizer(64)`` (with ``chat_template``, if given) saved to ``path``, as a Hub folder."""
    model.save_pretrained(path)
    tokenizer = char_tokenizer(64)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path
