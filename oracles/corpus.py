"""The text corpus behind the tokenizer and the trained fixtures: pinned CPython 3.11 stdlib sources.

Why the stdlib: it is on every machine that has Python 3.11, so the tokenizer can be rebuilt
anywhere without downloads. Why pinned: stdlib files change between patch releases and distro
patches, and the tokenizer (hence every fixture) must come out byte-identical. So the corpus is an
explicit sorted list of files with their sha256 (stdlib_corpus.txt); a missing or different file is
a hard error, never a silent change. The list was chosen (`python corpus.py --pin REFERENCE`) as the
.py files that are byte-identical in two different 3.11 builds (pyenv 3.11.7 and Debian's patched
3.11.2), i.e. the files that are stable across patch releases.

Also here: the synthetic chat pairs (question about a stdlib function, answer = first paragraph of
its docstring), the train / held-out split, and the held-out evaluation prompts.
"""

import argparse
import ast
import hashlib
import re
import sys
import sysconfig
from pathlib import Path

PIN_FILE = Path(__file__).resolve().parent / "stdlib_corpus.txt"

# Directories never taken into the corpus (tests, data tables, optional or platform-specific parts).
EXCLUDED_DIRS = (
    "test", "tests", "idle_test", "site-packages", "encodings", "lib2to3", "distutils", "ensurepip",
    "__phello__", "idlelib", "tkinter", "turtledemo", "pydoc_data",
)
EXCLUDED_FILES = ("html/entities.py",)  # a table of unicode entities, not text

HELDOUT_EVERY = 20  # every 20th pinned file (index % 20 == 10) is held out from training
MAX_ANSWER_CHARS = 300


class CorpusError(RuntimeError):
    pass


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def pinned() -> list[tuple[str, str]]:
    """(sha256, relative path) pairs from stdlib_corpus.txt, in file order (sorted by path)."""
    rows = []
    for line in PIN_FILE.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            digest, rel = line.split(maxsplit=1)
            rows.append((digest, rel))
    if [r for _, r in rows] != sorted(r for _, r in rows):
        raise CorpusError(f"{PIN_FILE} is not sorted by path")
    return rows


def load_sources() -> list[tuple[str, str]]:
    """(relative path, text) for every pinned file; raises CorpusError naming what does not match."""
    if sys.version_info[:2] != (3, 11):
        raise CorpusError(f"the corpus is pinned to CPython 3.11 stdlib sources, this is {sys.version.split()[0]}")
    root = stdlib_root()
    missing, changed, out = [], [], []
    for digest, rel in pinned():
        path = root / rel
        if not path.is_file():
            missing.append(rel)
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            changed.append(rel)
            continue
        out.append((rel, data.decode("utf-8")))
    if missing or changed:
        raise CorpusError(
            f"stdlib at {root} does not match {PIN_FILE.name} "
            f"({len(missing)} missing, {len(changed)} different; "
            f"first: {(missing + changed)[:5]}). The tokenizer would not be byte-identical: "
            "use a CPython 3.11 whose stdlib has these files unchanged (checked: Debian 3.11.2, CPython 3.11.7)."
        )
    return out


def split(sources):
    """Deterministic train / held-out split by pinned-file index."""
    train = [s for i, s in enumerate(sources) if i % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    held = [s for i, s in enumerate(sources) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    return train, held


def module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def chat_pairs(sources) -> list[tuple[str, str]]:
    """(question, answer) pairs about public functions / classes / methods with a docstring."""
    pairs, seen = [], set()
    for rel, text in sources:
        mod = module_name(rel)
        if any(part.startswith("_") for part in mod.split(".")):
            continue  # private modules (_pydecimal, _pyio, ...) make odd questions
        try:
            tree = ast.parse(text)
        except SyntaxError as e:  # every pinned file parses on 3.11; keep the error readable anyway
            raise CorpusError(f"{rel}: {e}") from e
        items = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                items.append((node, f"{mod}.{node.name}"))
                if isinstance(node, ast.ClassDef):
                    items += [(m, f"{mod}.{node.name}.{m.name}") for m in node.body
                              if isinstance(m, ast.FunctionDef)]
        for node, qual in items:
            if any(part.startswith("_") for part in qual[len(mod) + 1:].split(".")):
                continue
            doc = ast.get_docstring(node)
            answer = _first_paragraph(doc) if doc else ""
            if not 20 <= len(answer) <= MAX_ANSWER_CHARS or qual in seen:
                continue
            seen.add(qual)
            kind = "class" if isinstance(node, ast.ClassDef) else (
                "method" if qual.count(".") > mod.count(".") + 1 else "function")
            question = (
                f"What does the {kind} {qual} do?",
                f"Explain {qual} in one sentence.",
                f"What is {qual} for?",
            )[len(pairs) % 3]
            pairs.append((question, answer))
    return pairs


def eval_prompts(held) -> list[dict]:
    """8 held-out prompts: 6 raw code prefixes (a def and its first lines) and 2 chat questions.

    Each is {"id", "kind": "raw"|"chat", "text"}; chat prompts get the chat template applied by the
    caller. Taken from held-out files only, so the trained fixtures never saw them.
    """
    prompts = []
    for rel, text in held:
        m = re.search(r"^(?:    )?def [a-z]\w*\(.*\n(?: {4,}\S.*\n){3}", text, re.M)
        if m and len(prompts) < 6:
            prompts.append({"id": f"raw:{rel}", "kind": "raw", "text": m.group(0)})
    pairs = chat_pairs(held)
    for q, _ in pairs[:: max(1, len(pairs) // 2)][:2]:
        prompts.append({"id": f"chat:{q}", "kind": "chat", "text": q})
    if len(prompts) != 8:
        raise CorpusError(f"expected 8 held-out prompts, got {len(prompts)}")
    return prompts


def write_pin(reference: Path | None) -> None:
    """Regenerate stdlib_corpus.txt from the selection rule (only when deliberately re-pinning)."""
    root = stdlib_root()
    rows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if set(rel.split("/")[:-1]) & set(EXCLUDED_DIRS) or rel in EXCLUDED_FILES:
            continue
        if reference is not None:
            other = reference / rel
            if not other.is_file() or other.read_bytes() != path.read_bytes():
                continue
        rows.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}")
    header = f"# sha256  path (relative to the CPython 3.11 stdlib); generated by corpus.py --pin\n"
    PIN_FILE.write_text(header + "\n".join(rows) + "\n", encoding="utf-8")
    print(f"pinned {len(rows)} files to {PIN_FILE}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pin", metavar="REFERENCE_STDLIB", nargs="?", const="",
                    help="re-pin the file list; keep only files identical in REFERENCE_STDLIB")
    args = ap.parse_args()
    if args.pin is not None:
        write_pin(Path(args.pin) if args.pin else None)
    else:
        src = load_sources()
        train, held = split(src)
        print(f"{len(src)} files, {sum(len(t) for _, t in src)} chars; "
              f"train {len(train)} / held-out {len(held)} files; "
              f"{len(chat_pairs(train))} train chat pairs, {len(chat_pairs(held))} held-out")
        for p in eval_prompts(held):
            print(repr(p["text"][:100]))
