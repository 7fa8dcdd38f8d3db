"""Hugging Face transformers: models built from configs (random weights, nothing downloaded)
for the scenarios, and ``MemfitCallback`` for the Trainer (integrations/hf_trainer.py, imported on first use
so that this module, like ``import memfit``, does not import transformers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError


def __getattr__(name: str) -> Any:
    if name == "MemfitCallback":
        try:
            from memfit.integrations.hf_trainer import MemfitCallback
        except ImportError as exc:
            raise MemfitError(f"memfit.hf.MemfitCallback needs Hugging Face transformers ({exc}): pip install "
                              "'memfit[hf]'") from None
        return MemfitCallback
    raise AttributeError(f"module 'memfit.hf' has no attribute {name!r}")


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
    seed: int = 0, intermediate: int | None = None, kv_heads: int | None = None, tied: bool | None = None,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Llama; ``intermediate`` (default 8/3 of ``hidden``) and ``kv_heads`` (default half the
    heads) as in the published configs, e.g. Llama-2-7B: 32 layers, 4096, 11008, 32 heads, 32 KV heads;
    ``tied``: the head tied to the input embedding (None: the config's default)."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=intermediate or hidden * 8 // 3,
        num_attention_heads=n_head, num_key_value_heads=kv_heads or max(1, n_head // 2), vocab_size=vocab,
        max_position_embeddings=max(seq, 128), use_cache=False, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0, **({} if tied is None else {"tie_word_embeddings": tied}),
    )
    return tf.LlamaForCausalLM(config), _tokens(batch, seq, vocab)


def gpt_neox(
    batch: int = 4, seq: int = 128, n_layer: int = 4, hidden: int = 256, n_head: int = 4, vocab: int = 4096,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A GPT-NeoX (Pythia's architecture): rotary attention and a parallel residual; its config
    declares a tensor-parallel plan, and its fused q/k/v projection is laid out head by head, so a
    column-wise split hands each rank whole heads."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.GPTNeoXConfig(
        num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=n_head,
        vocab_size=vocab, max_position_embeddings=max(seq, 128), use_cache=False, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0,
    )
    return tf.GPTNeoXForCausalLM(config), _tokens(batch, seq, vocab)


def bert(
    batch: int = 8, seq: int = 128, n_layer: int = 4, hidden: int = 256, n_head: int = 4, vocab: int = 30522,
    intermediate: int | None = None, seed: int = 0, task: str = "mlm", attention: str = "sdpa",
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """BERT for masked-language-model pre-training (every token a label, for a loss), or with
    ``task="classify"`` for sequence classification (two labels, as ``AutoModelForSequenceClassification``
    builds it by default). ``attention``: the config's implementation (``eager`` as in 2022)."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.BertConfig(
        num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head, vocab_size=vocab,
        intermediate_size=intermediate or 4 * hidden, max_position_embeddings=max(seq, 512),
        attn_implementation=attention,
    )
    ids = torch.randint(0, vocab, (batch, seq))
    if task == "classify":
        return tf.BertForSequenceClassification(config), {"input_ids": ids, "labels": torch.randint(0, 2, (batch,))}
    if task != "mlm":
        raise MemfitError(f"task is 'mlm' or 'classify', got {task!r}")
    return tf.BertForMaskedLM(config), {"input_ids": ids, "labels": ids.clone()}


def vit(
    batch: int = 8, image: int = 224, patch: int = 16, n_layer: int = 4, hidden: int = 256, n_head: int = 4,
    intermediate: int | None = None, classes: int = 1000, seed: int = 0, attention: str = "sdpa",
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Vision Transformer classifier on random images; ``attention``: the config's
    implementation (``eager`` writes it out: q.k^T, softmax, dropout, .v)."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.ViTConfig(
        num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head, image_size=image,
        patch_size=patch, intermediate_size=intermediate or 4 * hidden, num_labels=classes,
        attn_implementation=attention,
    )
    model = tf.ViTForImageClassification(config)  # on fake tensors: profiler/fake_build.py skips the init
    pixels = torch.randn(batch, 3, image, image)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, classes, (batch,))}


class DecoderStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder LM laid out as Llama is (``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: Llama, Qwen2, Mistral):
    its share of the decoder layers (keyed by their index, so that unit and parameter names are
    the model's less its ``model.`` prefix), the embeddings on the first stage and the final norm
    and head on the last, run as the model's own forward runs them: rotary embeddings and the
    causal mask made on every stage. Input: token ids on the first stage, hidden states after;
    output: hidden states, or logits on the last."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        base = model.model
        self.config = model.config
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None

    def get_input_embeddings(self) -> nn.Module | None:
        """The token embedding on the first stage (None on the others), as the model's own."""
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        """The head on the last stage (None on the others), as the model's own."""
        return self.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        # SDPA without padding runs causal by itself, which create_causal_mask says with None; it
        # cannot tell on fake tensors (estimate mode) and makes a (b, 1, s, s) mask instead
        mask = None if self.config._attn_implementation == "sdpa" else create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def decoder_stages(model: nn.Module, n: int) -> list[DecoderStage]:
    """``model``'s decoder layers in ``n`` stages of equal counts, as torchtitan splits Llama (the
    modules themselves, not copies: on a rank, build the model and keep its own stage)."""
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        raise MemfitError(f"{type(model).__name__} is not laid out as Llama is (model.embed_tokens, model.layers, "
                          "model.norm, model.rotary_emb, lm_head): cut it into stage modules yourself")
    if getattr(model.config, "tie_word_embeddings", False):
        raise MemfitError("the input embedding is tied to the head, and the first and last stages would share it: "
                          "build the model with tie_word_embeddings=False, as torchtitan does for pipelines")
    count = len(base.layers)
    if n < 2 or count % n:
        raise MemfitError(f"{count} decoder layers do not split evenly into {n} stages")
    per = count // n
    return [DecoderStage(model, list(range(s * per, (s + 1) * per)), s == 0, s == n - 1) for s in range(n)]
