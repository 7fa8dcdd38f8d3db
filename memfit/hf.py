"""Hugging Face transformers models built from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from memfit.errors import MemfitError


def _transformers():  # type: ignore[no-untyped-def]
    try:
        import transformers
    except ImportError:
        raise MemfitError("this scenario needs Hugging Face transformers: pip install 'memfit[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _tokens(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}  # type: ignore[dict-item]


def gpt2(
    batch: int = 4, seq: int = 128, n_layer: int = 4, n_embd: int = 256, n_head: int = 4, vocab: int = 4096,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=max(seq, 128),
        use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(config), _tokens(batch, seq, vocab)


def llama(
    batch: int = 4, seq: int = 128, n_layer: int = 4, hidden: int = 256, n_head: int = 4, vocab: int = 4096,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_attention_heads=n_head, num_key_value_heads=max(1, n_head // 2), vocab_size=vocab,
        max_position_embeddings=max(seq, 128), use_cache=False, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0,
    )
    return tf.LlamaForCausalLM(config), _tokens(batch, seq, vocab)
