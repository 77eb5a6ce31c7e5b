#!/usr/bin/env python3
"""Makes the PEFT fixtures of tests/it/lora.rs: PEFT's logits of adapters fitgrad trained.

    cargo test lora_finetune::make_peft_fixture -- --ignored
    python scripts/peft_fixture.py [--dir tests/fixtures/lora]

The ignored tests fine-tune LoRA adapters with fitgrad's finetune example and save them with
`--save-adapter`: over the tiny GPT-2 fixture (tests/fixtures/hf/gpt2-tiny; c_attn, c_proj,
c_fc) as DIR/gpt2-tiny-adapter, and over the tiny Llama fixture (tests/fixtures/hf/
llama-tiny-gqa; every projection) as DIR/llama-tiny-gqa-adapter, each with fitgrad's logits
over its hf fixture's `logits_ids` (DIR/fitgrad_logits.safetensors,
DIR/fitgrad_llama_logits.safetensors). This script loads each base with transformers and its
adapter with PEFT's PeftModel.from_pretrained (nothing converted), computes the same logits,
fails unless fitgrad's agree within 1e-4, checks that PEFT's merge_and_unload gives the same
logits, and writes PEFT's as DIR/expected_peft.safetensors and
DIR/expected_peft_llama.safetensors, which the tests compare fitgrad against.

Needs torch, transformers, peft and safetensors (a venv outside the repo). CI never runs it:
the fixtures are committed.
"""

import argparse
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4


# (base folder, expected figures with its logits_ids, adapter, fitgrad's logits, PEFT's logits)
FIXTURES = [
    ("gpt2-tiny", "expected.json", "gpt2-tiny-adapter", "fitgrad_logits", "expected_peft"),
    (
        "llama-tiny-gqa",
        "expected_llama.json",
        "llama-tiny-gqa-adapter",
        "fitgrad_llama_logits",
        "expected_peft_llama",
    ),
]


def check(lora_dir, base, expected, adapter, ours_name, peft_name):
    hf = os.path.join(ROOT, "tests", "fixtures", "hf")
    with open(os.path.join(hf, expected)) as f:
        ids = json.load(f)["logits_ids"]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(hf, base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, os.path.join(lora_dir, adapter)).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        peft_logits = model(input_ids=x).logits[0].float().contiguous()
        merged = model.merge_and_unload()
        merged_logits = merged(input_ids=x).logits[0].float()
    ours = load_file(os.path.join(lora_dir, ours_name + ".safetensors"))["logits"]
    diff = (ours - peft_logits).abs().max().item()
    merge_diff = (merged_logits - peft_logits).abs().max().item()
    print(f"{adapter}: fitgrad vs PEFT logits: max |diff| {diff:.3e} (tolerance {TOLERANCE})")
    print(f"{adapter}: PEFT merged vs unmerged: max |diff| {merge_diff:.3e}")
    if not diff <= TOLERANCE or not merge_diff <= TOLERANCE:
        sys.exit(f"{adapter}: the logits disagree")
    out = os.path.join(lora_dir, peft_name + ".safetensors")
    save_file({"logits": peft_logits}, out)
    print("wrote", out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(ROOT, "tests", "fixtures", "lora"))
    args = ap.parse_args()
    for fixture in FIXTURES:
        check(args.dir, *fixture)


if __name__ == "__main__":
    main()
