"""Smoke-check every fixture folder with the oracles themselves; exit 1 on any failure.

Per folder: mlx_lm.load works; the tokenizer transformers builds there (it substitutes
Qwen3_5Tokenizer for qwen3_5, P1) gives the golden tokenizer's ids for raw text, for the chat
template with string and with list-of-parts content, decodes losslessly, and stops on {2, 0}; the
tokenizer files are byte copies of golden/tokenizer. Random fixtures only (trained ones are judged
by eval_spec.py): every norm has an effective scale near 1 and a 48-token greedy continuation of a
code prompt is not degenerate. For qwen3_5 and qwen3_5-trained also: mlx_vlm.load works, mlx_vlm
plain greedy == mlx_lm plain greedy, and mlx_vlm native-MTP speculative greedy (drafter split in
memory from the same folder) == plain greedy (the drafter's norms checked on the random one only). A DFlash drafter folder (config with dflash_config, no tokenizer:
train_dflash.py) is only loaded through mlx_vlm's load_drafter and bound to its target. A split
MTP drafter folder (model_type qwen3_5_mtp: split_mtp.py) is loaded the same way, and mlx_vlm's MTP
loop with it on its source target equals the loop with the head split in memory.

A derived folder (derivation.json, no weights: derive_trained.py) is loaded as its rebuilt copy
under target/derived-models.

Usage: check_fixtures.py [NAME ...]      (default: every folder under golden/models)
"""

import common  # noqa: F401  (offline guard first)

import argparse
import sys

from common import MODELS, TOKENIZER, die, log
from make_models import SPECS

CODE_PROMPT = 'def read_config(path):\n    """Read a JSON config file."""\n    with open(path) as f:\n'
TEXT = "Héllo wörld\r\n\tx = 12345 + y_z  # it's\n\n<|im_start|>user\nok<|im_end|>\n"
MESSAGES = [{"role": "user", "content": "What does the function os.path.join do?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What does the function os.path.join do?"}]}]
MAX_TOKENS = 48


def greedy(model, tok, prompt, **kw):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out = list(stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS,
                               sampler=make_sampler(temp=0.0), **kw))
    return [r.token for r in out], out[-1].finish_reason


def check_drafter(path) -> list[str]:
    """A DFlash drafter folder: mlx_vlm loads it (strict) as a dflash drafter that binds to its target."""
    from mlx_vlm import load as vlm_load
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_lm import load
    import mlx.core as mx

    target = common.read_json(path / "training_log.json")["target"]
    drafter, kind = load_drafter(str(path), kind="dflash")
    tpath = str(common.REPO / target)
    model = vlm_load(tpath)[0] if "vision_config" in common.read_json(common.REPO / target / "config.json") else load(tpath)[0]
    drafter.bind(model)
    errs = [] if kind == "dflash" else [f"load_drafter resolved kind {kind!r}"]
    borrowed = [k for k in mx.load(str(path / "model.safetensors")) if k.startswith(("embed_tokens", "lm_head"))]
    return errs + [f"saves the target's weights {borrowed}"] * bool(borrowed)


def check_split_mtp(path) -> list[str]:
    """A split MTP drafter folder (split_mtp.py): mlx_vlm loads it as an mtp drafter, and its MTP
    loop on the source target drafts and accepts exactly what the head split in memory does."""
    import mlx.core as mx
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.speculative.drafters import load_drafter

    source = MODELS / path.name.removesuffix("-mtp")
    model, processor = vlm_load(str(source))
    errs = []
    runs = []
    for drafter_path in (path, source):
        drafter, kind = load_drafter(str(drafter_path), kind="mtp")
        errs += [] if kind == "mtp" else [f"{drafter_path.name}: load_drafter resolved kind {kind!r}"]
        toks = vlm_tokens(vlm_stream(model, processor, CODE_PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     draft_model=drafter, draft_kind=kind))
        runs.append((toks, list(drafter.accept_lens), list(drafter.draft_lens)))
        mx.clear_cache()
    if runs[0] != runs[1]:
        errs.append(f"the split head's MTP loop differs from {source.name}'s own head's")
    log(f"  split head == in-folder head (tokens, accepted per round): {runs[0] == runs[1]}; "
        f"accepted {sum(runs[0][1])}/{sum(runs[0][2])} drafted")
    return errs


def check_tokenizer(name, tok, ref) -> list[str]:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    errs = []
    ids = tok.encode(TEXT, add_special_tokens=False)
    if ids != ref.encode(TEXT, add_special_tokens=False):
        errs.append(f"{type(tok._tokenizer).__name__} ids differ from the golden tokenizer")
    if tok.decode(ids) != TEXT:
        errs.append("decode(encode(text)) != text")
    want = ref.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    for msgs in (MESSAGES, PARTS):
        got = tok.apply_chat_template(msgs, add_generation_prompt=True)
        if list(got) != list(want):
            errs.append("chat template ids differ")
    if tok.eos_token_ids != {0, 2}:
        errs.append(f"eos ids {tok.eos_token_ids} != {{0, 2}}")
    if not isinstance(tok.detokenizer, BPEStreamingDetokenizer):
        errs.append(f"detokenizer {type(tok.detokenizer).__name__}")
    return errs


def vlm_tokens(responses) -> list[int]:
    """mlx_vlm's stream_generate yields one result per token and then a final summary result that
    repeats the last token (and carries a stopping EOS that was never yielded on its own); its
    token_ids field is the whole generation (mlx_vlm/generate/dispatch.py, end of stream_generate)."""
    return list(responses)[-1].token_ids


def check_norms(module, gemma: bool) -> list[str]:
    """Every loaded RMSNorm must have an effective scale near 1 (catches a 1+w vs w / HF-shift mix-up)."""
    from mlx.utils import tree_flatten

    from make_models import is_norm

    errs = []
    for k, v in tree_flatten(module.parameters()):
        if is_norm(k) and v.ndim == 1:
            mean = float(v.mean()) + (1.0 if gemma else 0.0)
            if not 0.8 < mean < 1.2:
                errs.append(f"norm {k} has effective mean {mean:.3f}")
    return errs


# Multimodal fixtures whose drafter is an assistant folder beside them (make_gemma4_assistant.py).
ASSISTANTS = {"gemma4-vlm": "gemma4-assistant"}


def check_vlm(path, lm_model, lm_tok, is_random: bool) -> list[str]:
    import mlx.core as mx
    from mlx_vlm import load as vlm_load
    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.speculative.drafters import load_drafter

    errs = []
    model, processor = vlm_load(str(path))
    # A Gemma 4 fixture drafts with its assistant folder, a Qwen3.5 one with its own MTP head.
    drafter, kind = load_drafter(str(MODELS / ASSISTANTS.get(path.name, path.name)), kind="mtp")
    if is_random:
        errs += check_norms(model.language_model, False) + check_norms(drafter, False)
    for label, prompt in (("raw", CODE_PROMPT),
                          ("chat", lm_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))):
        lm_toks, _ = greedy(lm_model, lm_tok, prompt)
        vlm = vlm_tokens(vlm_stream(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0))
        mtp = vlm_tokens(vlm_stream(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    draft_model=drafter, draft_kind=kind))
        acc, drafted = sum(drafter.accept_lens), sum(drafter.draft_lens)
        mx.clear_cache()
        if vlm != lm_toks:
            errs.append(f"{label}: mlx_vlm greedy != mlx_lm greedy")
        if mtp != vlm:
            errs.append(f"{label}: mlx_vlm MTP greedy != plain greedy")
        log(f"  {label}: mlx_vlm == mlx_lm: {vlm == lm_toks}; MTP == plain: {mtp == vlm}; "
            f"MTP accepted {acc}/{drafted} drafted")
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    from mlx_lm import load
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER))
    names = args.names or sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
    if not names:
        die(f"no fixture folders under {MODELS}")
    failed = []
    for name in names:
        path = MODELS / name
        if not (path / "config.json").is_file():
            die(f"{path} is not a fixture folder")
        cfg = common.read_json(path / "config.json")
        if "dflash_config" in cfg:
            errs = check_drafter(path)
            log(f"{name:24s} DFlash drafter of {common.read_json(path / 'training_log.json')['target']}")
            for e in errs:
                log(f"  FAIL {name}: {e}")
            failed += [name] if errs else []
            continue
        if cfg.get("model_type") == "gemma4_assistant":
            log(f"{name:24s} Gemma 4 assistant drafter (checked with its target's MTP loop)")
            continue
        if cfg.get("model_type") == "qwen3_5_mtp":
            log(f"{name:24s} split MTP drafter of {name.removesuffix('-mtp')}")
            errs = check_split_mtp(path)
            errs += [f"{f} is not a copy of golden/tokenizer/{f}" for f in ("tokenizer.json", "tokenizer_config.json")
                     if (path / f).read_bytes() != (TOKENIZER / f).read_bytes()]
            for e in errs:
                log(f"  FAIL {name}: {e}")
            failed += [name] if errs else []
            continue
        model, tok = load(str(common.loadable(path)))
        is_random = name.removesuffix("-4bit") in SPECS  # trained norms drift anywhere; skip those checks
        errs = check_tokenizer(name, tok, ref)
        if is_random:
            errs += check_norms(model, cfg["model_type"].startswith("gemma"))
        errs += [f"{f} is not a copy of golden/tokenizer/{f}" for f in common.TOKENIZER_FILES
                 if not (path / f).is_file() or (path / f).read_bytes() != (TOKENIZER / f).read_bytes()]
        toks, finish = greedy(model, tok, CODE_PROMPT)
        distinct = len(set(toks))
        if is_random and len(toks) >= 16 and distinct < len(toks) // 4:
            errs.append(f"degenerate greedy output ({distinct} distinct of {len(toks)})")
        log(f"{name:24s} greedy {len(toks):2d} tokens, {distinct:2d} distinct, finish={finish}")
        if "vision_config" in cfg:
            errs += check_vlm(path, model, tok, is_random)
        for e in errs:
            log(f"  FAIL {name}: {e}")
        failed += [name] if errs else []
    if failed:
        log(f"FAILED: {failed}")
        sys.exit(1)
    log(f"all {len(names)} fixture folders OK")


if __name__ == "__main__":
    main()
