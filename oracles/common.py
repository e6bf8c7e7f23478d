"""Shared plumbing for the fixture builders: offline guard, repo paths, progress lines, file helpers.

Import this module FIRST in every oracle script: it must set the Hugging Face environment before
transformers / huggingface_hub / mlx_lm are imported, so that no oracle code can reach the network
(a mistyped local path would otherwise silently become a Hub lookup, docs/fixture-pitfalls.md, P4).
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # deterministic BPE training, no fork warnings
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # hides "PyTorch was not found" on every run
if not os.path.isdir(os.environ.get("HF_HUB_CACHE", "")):
    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="verity-hf-cache-")
    atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], ignore_errors=True)

import mlx.core as mx  # noqa: E402  (after the environment is set)

# Fixtures are built on the CPU everywhere (also on a Mac), so RNG draws, quantization scales and
# training bits do not depend on a GPU backend.
mx.set_default_device(mx.cpu)

ORACLES = Path(__file__).resolve().parent
REPO = ORACLES.parent
GOLDEN = REPO / "golden"
MODELS = GOLDEN / "models"
TOKENIZER = GOLDEN / "tokenizer"
# Loadable copies of the fixture folders whose weights are derived, not shipped (a derivation.json
# instead of model.safetensors: derive_trained.py). verity materialises the same copies there.
DERIVED = REPO / "target" / "derived-models"

# The tokenizer files every model folder carries (copied verbatim from golden/tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_T0 = time.monotonic()


def log(msg: str) -> None:
    """One progress line with the elapsed wall time, flushed at once (builds run for minutes)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def die(msg: str) -> "NoReturn":  # noqa: F821
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def write_text(path: Path, text: str) -> None:
    """Writes `text` atomically: a temporary file in the same folder, then a rename, so a killed
    run never leaves a truncated golden where a valid one was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    """Stable JSON: fixed indent, insertion order kept, trailing newline (byte-identical reruns)."""
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def model_dir(name: str) -> Path:
    """An existing fixture folder as it loads (absolute path: relative names could turn into Hub
    ids); for a derived folder, its freshly built copy under target/derived-models."""
    d = MODELS / name
    if not (d / "config.json").is_file():
        die(f"{d} is not a model folder (no config.json); build it first")
    return loadable(d)


def loadable(folder: Path) -> Path:
    """`folder` itself, or, when it holds a derivation.json, its copy under DERIVED with the
    weights rebuilt now (a second each), so an oracle never reads weights derived from older ones."""
    folder = Path(folder)
    if not (folder / "derivation.json").is_file():
        return folder
    from derive_trained import materialise  # imported here: derive_trained imports this module

    return materialise(folder)


def copy_tokenizer(dst: Path) -> None:
    """Put exactly the golden tokenizer files into a model folder (and no other tokenizer file)."""
    for name in ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json"):
        (dst / name).unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        src = TOKENIZER / name
        if not src.is_file():
            die(f"{src} missing: run make_tokenizer.py first")
        shutil.copyfile(src, dst / name)


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
