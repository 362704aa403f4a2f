"""A tiny Llama-architecture GGUF model with random weights, for tests that
run a real ``llama-server`` (gibberish text, real server behaviour).

One block, 32-wide embeddings, a SentencePiece-style vocabulary of the
control tokens, the 256 byte tokens (so any text tokenizes by byte fallback)
and a few words, a ChatML chat template. Written with the ``gguf`` package
(llama.cpp's own writer); float32 throughout, a few hundred kilobytes.
"""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_WORDS = ["▁the", "▁tide", "▁gate", "▁river", "▁stream", "▁model", "▁token", "▁a", "▁is",
          "<|im_start|>", "<|im_end|>"]


def write_tiny_llama(path: Path, *, seed: int = 7, n_embd: int = 32, n_ff: int = 64,
                     n_head: int = 2, n_ctx: int = 512) -> Path:
    """Write the model to ``path``; returns it. Deterministic for a seed."""
    import gguf
    import numpy as np

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + _WORDS
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(_WORDS) - 2)
             + [gguf.TokenType.CONTROL] * 2)
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:  # type: ignore[type-arg]
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tidegate-tiny-llama")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    writer.add_tensor("token_embd.weight", weight(vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(vocab, n_embd))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weight(n_embd, n_embd))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", weight(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", weight(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
