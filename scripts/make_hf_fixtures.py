#!/usr/bin/env python3
"""Makes the Hugging Face fixtures of tests/it/hf.rs and checks fitgrad's exported folders.

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]
    python scripts/make_hf_fixtures.py llama [OUT]
    python scripts/make_hf_fixtures.py check-export DIR --eval-text FILE --context N --expect LOSS

The first form trains a small byte-level BPE tokenizer on the start of the embedded plays,
builds tiny random GPT-2 models with transformers and torch, saves each as a Hugging Face
folder (config.json, model.safetensors or a sharded index, tokenizer.json) in the layouts and
dtypes the loader must read, and writes what transformers and tokenizers compute on them:
per-position logits of a short sequence (expected.safetensors), the eval loss of eval.txt in
the windows of `finetune --eval-text` at two contexts, and the tokenizer's ids and decoded
text of tricky strings (expected.json); then tiny random Llama models with the same tokenizer and
text (expected_llama.json and .safetensors; the `llama` form makes only these). The last loads a folder fitgrad exported in
transformers and checks that its eval loss on a text is LOSS within 1e-4.

Needs torch, transformers, tokenizers, safetensors and numpy (a venv outside the repo). CI never
runs it: the fixtures are committed.
"""

import argparse
import gzip
import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 320
EOT = "<|endoftext|>"
# The contexts the eval loss is computed at: the model's whole position table and half of it.
CONTEXTS = (32, 16)
# Tokens of the sequence whose per-position logits are stored.
LOGITS_T = 16

EVAL_TEXT = """\
ROMEO. But, soft! what light through yonder window breaks?
It is the east, and Juliet is the sun.
\tArise, fair sun, and kill the envious moon,
Who is already sick and pale with grief,   that thou her maid art far more fair than she.

JULIET. O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name; — café, naïve, Ωμέγα, 日本語 and 😀 too.
    Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.\r
"""

# Strings whose ids and decoded text tests/it/hf.rs compares with the Rust tokenizers crate.
TOKENIZER_CASES = [
    "Hello, world!",
    "",
    " ",
    "   leading spaces and   runs    of     spaces   ",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\n",
    "Unicode: café naïve Ωμέγα 日本語 😀 ﬁ ÅÅ",
    "mixed \t\n \u00a0non-breaking\u2003em space",
    "digits 12345 and 3.14159, it's we'll they're",
    f"special {EOT} token{EOT}",
]


def plays_start(chars):
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt", encoding="utf-8") as f:
        return f.read(chars)


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([plays_start(60_000)], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def randomize(model, seed):
    """Weights far from GPT-2's tiny init, so a wrong layout or formula shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.3 * noise)


def gpt2(seed, eps):
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=24,
        n_layer=2,
        n_head=3,
        layer_norm_epsilon=eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    randomize(model, seed)
    return model


def state_dict(model, dtype, prefix):
    """The model's tensors in `dtype`, named with or without `transformer.`, head omitted."""
    out = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        name = k if prefix else k.removeprefix("transformer.")
        out[name] = v.detach().to(dtype).contiguous()
    return out


def save_sharded(folder, tensors, shards):
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def window_loss(model, ids, context):
    """Token-weighted mean next-token cross-entropy (nats) over windows of context + 1 tokens,
    one starting every `context` tokens; the last may be shorter. Also the tokens counted."""
    total, count = 0.0, 0
    for start in range(0, len(ids), context):
        w = ids[start:start + context + 1]
        if len(w) < 2:
            continue
        x = torch.tensor([w[:-1]])
        y = torch.tensor(w[1:])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        total += float(nll.double().sum())
        count += len(w) - 1
    return total / count, count


def load_hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def make(out):
    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer()
    with open(os.path.join(out, "eval.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(EVAL_TEXT)
    eval_ids = tok.encode(EVAL_TEXT, add_special_tokens=False).ids
    logits_ids = eval_ids[:LOGITS_T]

    # name: (seed, layer_norm_epsilon, dtype, `transformer.` prefix, shards, extra tensors)
    specs = {
        # save_pretrained's own layout: one f32 file, `transformer.` names, no head.
        "gpt2-tiny": (1, 1e-5, torch.float32, True, 0, False),
        # f16 without the prefix, sharded over two files with an index.
        "gpt2-tiny-f16-sharded": (2, 1e-5, torch.float16, False, 2, False),
        # bf16 without the prefix, an eps that shows, the causal-mask buffers and a head
        # equal to wte, as old checkpoints hold them.
        "gpt2-tiny-bf16": (3, 1e-3, torch.bfloat16, False, 0, True),
    }
    expected = {
        "eval_text": "eval.txt",
        "eval_ids": eval_ids,
        "logits_ids": logits_ids,
        "contexts": list(CONTEXTS),
        "models": {},
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
    }
    logits = {}
    for name, (seed, eps, dtype, prefix, shards, extra) in specs.items():
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        for f in os.listdir(folder):
            os.remove(os.path.join(folder, f))
        model = gpt2(seed, eps)
        if dtype == torch.float32 and prefix and shards == 0 and not extra:
            model.save_pretrained(folder)
        else:
            model.config.save_pretrained(folder)
            tensors = state_dict(model, dtype, prefix)
            if extra:
                t = model.config.n_positions
                mask = torch.tril(torch.ones(t, t, dtype=dtype)).view(1, 1, t, t)
                for i in range(model.config.n_layer):
                    tensors[f"h.{i}.attn.bias"] = mask.clone()
                    tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4, dtype=dtype)
                tensors["lm_head.weight"] = tensors["wte.weight"].clone()
            if shards:
                save_sharded(folder, tensors, shards)
            else:
                save_file(tensors, os.path.join(folder, "model.safetensors"),
                          metadata={"format": "pt"})
        tok.save(os.path.join(folder, "tokenizer.json"))
        # What transformers computes from the folder as saved (f16 / bf16 weights upcast).
        loaded = load_hf(folder)
        with torch.no_grad():
            logits[name] = loaded(input_ids=torch.tensor([logits_ids])).logits[0].float().contiguous()
        losses = {}
        for c in CONTEXTS:
            loss, count = window_loss(loaded, eval_ids, c)
            losses[str(c)] = {"eval_loss": loss, "tokens": count}
        expected["models"][name] = {
            "dtype": str(dtype).removeprefix("torch."),
            "layer_norm_epsilon": eps,
            "eval": losses,
        }
        print(f"{name}: eval_loss {losses}")

    expected["tokenizer"] = [
        {
            "text": text,
            "ids": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(tok.encode(text, add_special_tokens=False).ids,
                                  skip_special_tokens=False),
        }
        for text in TOKENIZER_CASES
    ]
    save_file(logits, os.path.join(out, "expected.safetensors"))
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    make_llama(out)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out}: {size} bytes")


def llama(seed, heads, kv_heads, tied, bias, eps, theta):
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        rms_norm_eps=eps,
        rope_theta=theta,
        tie_word_embeddings=tied,
        attention_bias=bias,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.3 * noise)
    return model


def make_llama(out):
    """The Llama fixtures, with the tokenizer and eval text of the GPT-2 ones (made first):
    per-position logits (expected_llama.safetensors) and eval losses (expected_llama.json)."""
    tok = Tokenizer.from_file(os.path.join(out, "gpt2-tiny", "tokenizer.json"))
    with open(os.path.join(out, "eval.txt"), encoding="utf-8", newline="") as f:
        eval_ids = tok.encode(f.read(), add_special_tokens=False).ids
    logits_ids = eval_ids[:LOGITS_T]
    # name: (seed, heads, kv heads, tied, attention_bias, rms_norm_eps, rope_theta, dtype)
    specs = {
        # grouped-query attention (4 query heads over 2 kv heads), untied head, f32 as
        # save_pretrained writes it.
        "llama-tiny-gqa": (11, 4, 2, False, False, 1e-5, 500.0, torch.float32),
        # one kv head per query head, the head tied to the embedding, attention biases, bf16.
        "llama-tiny-tied": (12, 4, 4, True, True, 1e-3, 10000.0, torch.bfloat16),
    }
    expected = {"logits_ids": logits_ids, "contexts": list(CONTEXTS), "models": {}}
    logits = {}
    for name, (seed, heads, kv, tied, bias, eps, theta, dtype) in specs.items():
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        for f in os.listdir(folder):
            os.remove(os.path.join(folder, f))
        model = llama(seed, heads, kv, tied, bias, eps, theta)
        if dtype == torch.float32:
            model.save_pretrained(folder)
        else:
            model.config.save_pretrained(folder)
            tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
                       if not (tied and k == "lm_head.weight")}
            save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        tok.save(os.path.join(folder, "tokenizer.json"))
        loaded = load_hf(folder)
        with torch.no_grad():
            logits[name] = loaded(input_ids=torch.tensor([logits_ids])).logits[0].float().contiguous()
        losses = {}
        for c in CONTEXTS:
            loss, count = window_loss(loaded, eval_ids, c)
            losses[str(c)] = {"eval_loss": loss, "tokens": count}
        expected["models"][name] = {"dtype": str(dtype).removeprefix("torch."), "eval": losses}
        print(f"{name}: eval_loss {losses}")
    save_file(logits, os.path.join(out, "expected_llama.safetensors"))
    with open(os.path.join(out, "expected_llama.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


def check_export(folder, eval_text, context, expect):
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    with open(eval_text, encoding="utf-8", newline="") as f:
        ids = tok.encode(f.read(), add_special_tokens=False).ids
    loss, count = window_loss(load_hf(folder), ids, context)
    diff = abs(loss - expect)
    print(f"{folder}: transformers eval_loss {loss:.6f} over {count} tokens, fitgrad {expect:.6f}, "
          f"difference {diff:.2e}")
    return diff <= 1e-4


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "check-export":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("folder")
        p.add_argument("--eval-text", required=True)
        p.add_argument("--context", type=int, required=True)
        p.add_argument("--expect", type=float, required=True)
        a = p.parse_args()
        sys.exit(0 if check_export(a.folder, a.eval_text, a.context, a.expect) else 1)
    if len(sys.argv) > 1 and sys.argv[1] == "llama":
        make_llama(sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "tests", "fixtures", "hf"))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "hf"))
    a = p.parse_args()
    np.random.seed(0)
    make(a.out)


if __name__ == "__main__":
    main()
