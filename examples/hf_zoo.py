"""Tiny Hugging Face models built from configs in code (no downloads), passed to autopar
as they are: ``build(name)`` returns the unmodified ``transformers`` model and one batch
of keyword arguments, called as ``model(**batch)`` with labels so the output has a loss.

Dropout is off so single-process and parallel runs can be compared exactly (see
docs/training.md for what dropout means under autopar).
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAMES = ("llama", "mistral", "qwen2", "mixtral", "bert", "t5", "vit", "gpt2")

# Megatron-style tensor-parallel pins per model (column-parallel S(0), row-parallel S(1));
# the last mesh axis carries them, others replicate (see tp_pins)
TP = {
    "llama": {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
              "*o_proj.weight": "S(1)", "*gate_proj.weight": "S(0)", "*up_proj.weight": "S(0)",
              "*down_proj.weight": "S(1)"},
    "mistral": {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
                "*o_proj.weight": "S(1)", "*gate_proj.weight": "S(0)", "*up_proj.weight": "S(0)",
                "*down_proj.weight": "S(1)"},
    "qwen2": {"*q_proj.weight": "S(0)", "*q_proj.bias": "S(0)", "*k_proj.weight": "S(0)",
              "*k_proj.bias": "S(0)", "*v_proj.weight": "S(0)", "*v_proj.bias": "S(0)",
              "*o_proj.weight": "S(1)", "*gate_proj.weight": "S(0)", "*up_proj.weight": "S(0)",
              "*down_proj.weight": "S(1)"},
    "mixtral": {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
                "*o_proj.weight": "S(1)"},
    "bert": {"*attention.self.query.weight": "S(0)", "*attention.self.query.bias": "S(0)",
             "*attention.self.key.weight": "S(0)", "*attention.self.key.bias": "S(0)",
             "*attention.self.value.weight": "S(0)", "*attention.self.value.bias": "S(0)",
             "*attention.output.dense.weight": "S(1)", "*intermediate.dense.weight": "S(0)",
             "*intermediate.dense.bias": "S(0)", "*layer.*.output.dense.weight": "S(1)"},
    "t5": {"*DenseReluDense.wi.weight": "S(0)", "*DenseReluDense.wo.weight": "S(1)"},
    "vit": {"*attention.q_proj.weight": "S(0)", "*attention.q_proj.bias": "S(0)",
            "*attention.k_proj.weight": "S(0)", "*attention.k_proj.bias": "S(0)",
            "*attention.v_proj.weight": "S(0)", "*attention.v_proj.bias": "S(0)",
            "*attention.o_proj.weight": "S(1)", "*mlp.fc1.weight": "S(0)",
            "*mlp.fc1.bias": "S(0)", "*mlp.fc2.weight": "S(1)"},
    "gpt2": {"*mlp.c_fc.weight": "S(1)", "*mlp.c_fc.bias": "S(0)", "*mlp.c_proj.weight": "S(0)",
             "*attn.c_proj.weight": "S(0)"},
}


def tp_pins(name: str, mesh: tuple[int, ...]) -> dict[str, str]:
    """Tensor parallel on the last mesh axis of ``mesh`` for model ``name``."""
    rest = "R" * (len(mesh) - 1)
    return {k: rest + v for k, v in TP[name].items()}


def _quiet() -> None:
    from transformers.utils import logging
    logging.set_verbosity_error()


def pack(batch: dict) -> dict:
    """The right-padded rows of ``batch`` (``input_ids`` and ``attention_mask``) packed into
    one row by Hugging Face's ``DataCollatorWithFlattening``, padding dropped: the
    sequences back to back, ``position_ids`` restarting at each, the first label of each
    -100 (nothing is predicted across a boundary), no ``attention_mask`` (the model then
    keeps each sequence from attending to the others by its positions)."""
    from transformers import DataCollatorWithFlattening

    rows = [{"input_ids": ids[:k].tolist(), "labels": ids[:k].tolist()}
            for ids, k in zip(batch["input_ids"], batch["attention_mask"].sum(1).tolist())]
    return dict(DataCollatorWithFlattening()(rows))


def build(name: str = "llama", batch: int = 4, seq: int = 16) -> tuple[nn.Module, dict]:
    """The tiny model ``name`` (one of :data:`NAMES`) and a batch of keyword arguments."""
    import transformers as tf

    _quiet()
    torch.manual_seed(0)
    vocab = 128
    ids = torch.randint(0, vocab, (batch, seq))
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        return tf.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "mistral":  # GQA with a sliding window shorter than the sequence
        cfg = tf.MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, sliding_window=8)
        return tf.MistralForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "qwen2":  # GQA with biased q/k/v projections
        cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, tie_word_embeddings=False)
        return tf.Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "mixtral":
        cfg = tf.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64)
        return tf.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        labels = ids.clone()
        labels[:, ::2] = -100  # only some positions are masked-LM targets
        return tf.BertForMaskedLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "labels": labels}
    if name == "t5":
        cfg = tf.T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                          num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids.flip(1)}
    if name == "vit":
        cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_labels=10, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return tf.ViTForImageClassification(cfg), {
            "pixel_values": torch.randn(batch, 3, 16, 16), "labels": torch.randint(0, 10, (batch,))}
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=seq,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
