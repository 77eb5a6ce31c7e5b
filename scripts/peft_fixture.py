#!/usr/bin/env python3
"""Makes the PEFT fixture of tests/lora.rs: PEFT's logits of an adapter fitgrad trained.

    cargo test --test lora make_peft_fixture_adapter -- --ignored
    python scripts/peft_fixture.py [--dir tests/fixtures/lora]

The ignored test fine-tunes LoRA adapters (c_attn, c_proj, c_fc) of the tiny GPT-2 fixture
(tests/fixtures/hf/gpt2-tiny) with fitgrad's finetune example, saves them with
`--save-adapter` as DIR/gpt2-tiny-adapter (adapter_config.json, adapter_model.safetensors) and
writes fitgrad's logits with them over the hf fixtures' `logits_ids` to
DIR/fitgrad_logits.safetensors. This script loads the base with transformers and the adapter
with PEFT's PeftModel.from_pretrained (nothing converted), computes the same logits, fails
unless fitgrad's agree within 1e-4, checks that PEFT's merge_and_unload gives the same logits,
and writes PEFT's as DIR/expected_peft.safetensors, which the test compares fitgrad against.

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(ROOT, "tests", "fixtures", "lora"))
    args = ap.parse_args()
    hf = os.path.join(ROOT, "tests", "fixtures", "hf")
    with open(os.path.join(hf, "expected.json")) as f:
        ids = json.load(f)["logits_ids"]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(hf, "gpt2-tiny"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, os.path.join(args.dir, "gpt2-tiny-adapter")).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        peft_logits = model(input_ids=x).logits[0].float().contiguous()
        merged = model.merge_and_unload()
        merged_logits = merged(input_ids=x).logits[0].float()
    ours = load_file(os.path.join(args.dir, "fitgrad_logits.safetensors"))["logits"]
    diff = (ours - peft_logits).abs().max().item()
    merge_diff = (merged_logits - peft_logits).abs().max().item()
    print(f"fitgrad vs PEFT logits: max |diff| {diff:.3e} (tolerance {TOLERANCE})")
    print(f"PEFT merged vs unmerged: max |diff| {merge_diff:.3e}")
    if not diff <= TOLERANCE or not merge_diff <= TOLERANCE:
        sys.exit("the logits disagree")
    save_file({"logits": peft_logits}, os.path.join(args.dir, "expected_peft.safetensors"))
    print("wrote", os.path.join(args.dir, "expected_peft.safetensors"))


if __name__ == "__main__":
    main()
