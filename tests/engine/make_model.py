"""Builds the small Llama the engine tests serve: random weights and a BPE tokenizer trained
here on a made-up corpus, so nothing comes from a model hub. Runs in vLLM's venv (torch,
transformers, tokenizers). Usage: python make_model.py OUT_DIR

Its size is chosen so that a prefill is compute the engine can be timed on (~0.1-0.3 s for
1 000-2 000 tokens on two cores) while a decode step stays a few milliseconds: the phase
figures the tests compare are then the engine's work, not its fixed per-request overhead.
"""
from __future__ import annotations

import random
import sys

WORDS = ("the cache prefill decode token storage block disk model layer attention value key "
         "read write page memory offload request batch phase engine kernel server latency "
         "throughput").split()


def build(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rnd = random.Random(0)
    torch.manual_seed(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 40)))
              for _ in range(4000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    build(sys.argv[1])
