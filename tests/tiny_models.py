"""Tiny random-weight models of many transformers families, built from configs (no download), each saved with
a real WordPiece tokenizer like a hub checkpoint, so the product loads them the way an operator's models load.

Used by the family tests (every family loads, passes the parity probe and moves under β), the API tests
and the browser test of the cross-attention view.
"""
from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a cat dog sat on mat rug it was tired because street animal cross did not ran sleep "
    "capital of france is paris big small red blue house car tree"
).split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","]
PAD, UNK, CLS, SEP = 0, 1, 2, 3


def save_tokenizer(folder: Path, tokenizer_class: str = "BertTokenizerFast") -> int:
    """A lower-casing WordPiece tokenizer over a small vocabulary; returns the vocabulary size. `tokenizer_class`: the
    transformers class a checkpoint of the family ships (DistilBERT's sends no token_type_ids)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = getattr(transformers, tokenizer_class)(vocab=str(folder / "vocab.txt"), do_lower_case=True)  # `vocab=`: transformers 5 ignores vocab_file
    tokenizer.save_pretrained(folder)
    return len(vocab)


def _config(family: str, vocab: int):
    import transformers as tf

    # weights larger than the usual 0.02 init, so attention is far from uniform and β visibly matters
    small = dict(vocab_size=vocab, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, initializer_range=0.3)
    decoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128, **small)
    seq2seq = dict(decoder_start_token_id=CLS, forced_eos_token_id=None, **small)
    return {
        "gpt2": lambda: (tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **small), tf.GPT2LMHeadModel),
        "llama": lambda: (tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **decoder), tf.LlamaForCausalLM),
        "qwen2": lambda: (tf.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **decoder), tf.Qwen2ForCausalLM),
        # soft-capping and a sliding window narrower than the test inputs, so both matter for parity
        "gemma2": lambda: (tf.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **decoder),
                           tf.Gemma2ForCausalLM),
        # local and global layers (every 2nd global, like Gemma 3's every 6th) with a sliding window of 8, shorter
        # than the test inputs, and q/k norms; tests of windowed attention run it past the window
        "gemma3": lambda: (tf.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                               sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=8,
                                               layer_types=["sliding_attention", "full_attention"], **decoder),
                           tf.Gemma3ForCausalLM),
        "bart": lambda: (tf.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       max_position_embeddings=128, **seq2seq), tf.BartForConditionalGeneration),
        "marian": lambda: (tf.MarianConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                           max_position_embeddings=128, **seq2seq), tf.MarianMTModel),
        "t5": lambda: (tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, **seq2seq), tf.T5ForConditionalGeneration),
        "bert": lambda: (tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=128, vocab_size=vocab,
                                       initializer_range=0.3),
                         tf.BertForMaskedLM),
        # DistilBERT (models/families/distilbert.py): a masked LM, and a bare backbone for the plain-embedding output
        "distilbert": lambda: (tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                   max_position_embeddings=128, vocab_size=vocab, pad_token_id=PAD,
                                                   initializer_range=0.3), tf.DistilBertForMaskedLM),
        "distilbert_base": lambda: (tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                        max_position_embeddings=128, vocab_size=vocab, pad_token_id=PAD,
                                                        initializer_range=0.3), tf.DistilBertModel),
    }[family]()


TEXT_FAMILIES = ("gpt2", "llama", "qwen2", "gemma2", "gemma3", "bart", "marian", "t5", "bert")
CAUSAL_FAMILIES = ("gpt2", "llama", "qwen2", "gemma2", "gemma3")
SEQ2SEQ_FAMILIES = ("bart", "marian", "t5")
DISTILBERT_FAMILIES = ("distilbert", "distilbert_base")  # built by build_text_model too, with DistilBERT's tokenizer


def build_text_model(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random model of `family` (see TEXT_FAMILIES) with its tokenizer, saved into `folder`."""
    import torch

    vocab = save_tokenizer(folder, "DistilBertTokenizerFast" if family in DISTILBERT_FAMILIES else "BertTokenizerFast")
    config, model_class = _config(family, vocab)
    torch.manual_seed(seed)
    model = model_class(config)
    if family in CAUSAL_FAMILIES + SEQ2SEQ_FAMILIES:
        model.generation_config.pad_token_id = PAD
        model.generation_config.eos_token_id = SEP
    model.save_pretrained(folder)
    return folder


def build_image_model(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random ViT classifier or CLIP vision tower, saved with an image processor config."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if family == "vit":
        config = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=32, patch_size=8, num_labels=3, initializer_range=0.3)
        model = tf.ViTForImageClassification(config)
        tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    elif family == "clip_vision":
        config = tf.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     image_size=32, patch_size=8, initializer_factor=3.0)
        model = tf.CLIPVisionModel(config)
        tf.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    else:
        raise ValueError(family)
    model.save_pretrained(folder)
    return folder


def build_llama_gguf(path: Path, seed: int = 0):
    """A llama.cpp-style GGUF file (float32 tensors, a SentencePiece-style vocabulary) of a tiny random Llama, written
    with the `gguf` package; returns the LlamaForCausalLM it was written from, to compare against. Q and K are
    stored in llama.cpp's rotary layout (transformers' GGUF loader undoes it)."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = ["<unk>", "<s>", "</s>"] + ["▁" + w for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz,.") + ["▁"]
    heads, kv_heads, hidden = 4, 2, 32
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.3, tie_word_embeddings=False,
                         rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(64)
    writer.add_block_count(2)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(tokens) - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))  # unknown, control ×2, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def rotary_layout(weight, n_heads):  # transformers' layout → llama.cpp's (pairs interleaved per head)
        return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, value in model.state_dict().items():
        value = value.numpy()
        if name in top:
            writer.add_tensor(top[name], np.ascontiguousarray(value, dtype=np.float32))
            continue
        _, _, layer, *module, _ = name.split(".")
        module = ".".join(module)
        if module == "self_attn.q_proj":
            value = rotary_layout(value, heads)
        elif module == "self_attn.k_proj":
            value = rotary_layout(value, kv_heads)
        writer.add_tensor(f"blk.{layer}.{per_layer[module]}.weight", np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
