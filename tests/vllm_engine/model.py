"""A tiny Llama made here, nothing downloaded: random weights, local tokenizer.

2 layers, hidden size 128, 4 heads of 32 (vLLM's CPU attention takes head
sizes 32 to 256), 2 KV heads, fp32, weights drawn with a fixed seed at std
0.2 so that greedy outputs depend on the context. The byte-level BPE
tokenizer is trained on the repository's own Markdown.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 2048
MAX_MODEL_LEN = 1024


def _corpus() -> list[str]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [f.read_text() for f in files]


def make_model(directory: Path, seed: int = 0) -> Path:
    """Write the model and its tokenizer into ``directory``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
