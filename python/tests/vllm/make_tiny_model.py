"""Makes a tiny random Llama checkpoint plus a locally trained tokenizer, for
running a real vLLM engine on a CPU in tests. Needs no network: the tokenizer
is a byte-level BPE trained on a corpus generated here from a seeded RNG, so
the same arguments give byte-identical files on any machine.

    python make_tiny_model.py OUT_DIR [--seed 0] [--family llama|gemma3]

--family gemma3 makes a Gemma 3 text model instead: a sliding-window layer
(a 64-token window) and a full-attention layer, which vLLM's hybrid KV
cache manager keeps in two KV cache groups. --family nemotronh writes the
config of a Nemotron-H model (a Mamba2 layer and an attention layer) and
no weights: it is run with vLLM's dummy weights, in float32 (the CPU Mamba
kernels need it). --family lfm2 makes an LFM2 model (a short convolution
layer, whose state vLLM keeps in a state group of its own, and an attention
layer), with weights.

OUT_DIR is a cache: when OUT_DIR/.complete exists and records the same
parameters, nothing is done. The files are written to a temporary sibling
directory and renamed into place, so concurrent runs do not see half a model.

Only the weights depend on --seed: two models of different seeds share
config.json and the tokenizer files, so one can stand in for the other at the
same path (the negative-control test relies on that).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

VOCAB = 1024
# Bump when anything below changes what is written.
FORMAT = 1


def params(seed: int, family: str = "llama") -> dict:
    p = {
        "format": FORMAT,
        "seed": seed,
        "vocab": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    if family == "gemma3":
        p.update(family=family, head_dim=64, sliding_window=64,
                 layer_types=["sliding_attention", "full_attention"])
    elif family == "nemotronh":
        p.update(family=family, head_dim=64, hybrid_override_pattern="M*", mamba_num_heads=8,
                 mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4, expand=2,
                 chunk_size=64)
    elif family == "lfm2":
        p.update(family=family, layer_types=["conv", "full_attention"], conv_L_cache=3, initializer_range=0.3)
    return p


def _corpus(n_lines: int = 4000) -> list[str]:
    """Pseudo-words from a fixed syllable list: deterministic text to train
    the tokenizer on (its content does not matter, only that it is fixed)."""
    rng = random.Random(1234)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"] + list("0123456789")
    punct = [" ", " ", " ", " ", ", ", ". ", "(", ")", " = ", "\n"]
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))))
            words.append(rng.choice(punct))
        lines.append("".join(words))
    return lines


def _write_tokenizer(out: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    hf.save_pretrained(out)
    return tok.get_vocab_size()


def _write_model(out: str, p: dict) -> None:
    import torch

    torch.manual_seed(p["seed"])
    # What every family's config takes from the parameters.
    shared = dict(
        vocab_size=p["vocab"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        max_position_embeddings=p["max_position_embeddings"],
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    family = p.get("family", "llama")
    if family == "nemotronh":
        from transformers import NemotronHConfig

        cfg = NemotronHConfig(
            **shared,
            **{k: p[k] for k in ("head_dim", "hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim",
                                 "n_groups", "ssm_state_size", "conv_kernel", "expand", "chunk_size")},
            tie_word_embeddings=False,
        )
        cfg.architectures = ["NemotronHForCausalLM"]
        cfg.save_pretrained(out)
        return
    if family == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        # vLLM ties LFM2's output to its embedding: with the usual 0.02 the
        # residual is the last token's embedding and the model repeats its
        # last token whatever came before; with 0.3 the output depends on
        # the last tokens (not on a prefix more than about 64 tokens back).
        cfg = Lfm2Config(**shared, layer_types=p["layer_types"], conv_L_cache=p["conv_L_cache"],
                         block_auto_adjust_ff_dim=False, tie_word_embeddings=True,
                         initializer_range=p["initializer_range"])
        # vLLM's LFM2 reads the convolution's and the block's widths under
        # the names of the original checkpoints' configs.
        cfg.conv_dim = cfg.conv_dim_out = cfg.block_dim = p["hidden_size"]
        model = Lfm2ForCausalLM(cfg)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        return
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(**shared, head_dim=p["head_dim"], sliding_window=p["sliding_window"],
                               layer_types=p["layer_types"])
        Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**shared, tie_word_embeddings=False)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def make(out: str, seed: int = 0, family: str = "llama") -> str:
    """Creates (or reuses) the model at `out`; returns `out`."""
    out = os.path.abspath(out)
    p = params(seed, family)
    marker = os.path.join(out, ".complete")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == p:
                return out
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        n = _write_tokenizer(tmp)
        if n != VOCAB:
            raise RuntimeError(f"tokenizer has {n} entries, expected {VOCAB}")
        _write_model(tmp, p)
        with open(os.path.join(tmp, ".complete"), "w") as f:
            json.dump(p, f)
        if os.path.exists(out):
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished first; use its copy if it is complete.
            if not os.path.exists(marker):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=["llama", "gemma3", "nemotronh", "lfm2"], default="llama")
    a = ap.parse_args(argv)
    print(make(a.out, a.seed, a.family))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
