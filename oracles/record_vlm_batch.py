"""Records mlx-vlm's batched MTP rounds: its BatchGenerator with a draft model
(mlx_vlm/generate/ar.py, SpeculativeGenerationBatch over _mtp_rounds_batch,
mlx_vlm/speculative/mtp.py:871), greedy, the
prompts of golden/MANIFEST.toml's [[vlm_batch]] tables decoded together (left-padded, as
mlx-vlm's batch_generate pads them), each row with its own max_tokens; a group whose drafter is
its model drafts with the target's own MTP head (load_drafter splits it off).

mlx-vlm reports no logprobs for a speculative batch's rows, so these are not traces: a file
holds each row's prompt tokens as mlx-vlm prefilled them (its left padding removed) and the
tokens the row emitted, plus the draft block size, and is written to
golden/vlm-batch/<name>.json. tests/vlm_batch.rs runs the same rows through verity's batch
with its assistant drafter and holds them to these tokens.

    oracles/.venv/bin/python oracles/record_vlm_batch.py

Recording is deterministic: rerunning leaves `git status` clean.
"""

import sys
import tomllib

import common  # noqa: F401  (first: the offline environment)
from common import GOLDEN, write_json

import mlx.core as mx
import mlx_vlm
from mlx_vlm import load
from mlx_vlm.generate.ar import BatchGenerator, _split_prompt_kwargs_per_row
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.utils import prepare_inputs

from record import ManifestError

OUT = GOLDEN / "vlm-batch"


def record(group):
    """Runs one [[vlm_batch]] group through mlx-vlm's speculative BatchGenerator."""
    for key in ("name", "model", "drafter", "block_size", "prompts", "max_tokens"):
        if key not in group:
            raise ManifestError(f"vlm_batch {group.get('name', '?')}: missing {key!r}")
    if len(group["prompts"]) != len(group["max_tokens"]) or len(group["prompts"]) < 2:
        raise ManifestError(f"vlm_batch {group['name']}: give two or more prompts, a max_tokens each")
    model, processor = load(str(GOLDEN / "models" / group["model"]))
    drafter, kind = load_drafter(str(GOLDEN / "models" / group["drafter"]), kind="mtp")
    inputs = prepare_inputs(processor, prompts=group["prompts"], add_special_tokens=True)
    input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
    embedded = model.get_input_embeddings(input_ids, None, mask=mask)
    prompt_kwargs = _split_prompt_kwargs_per_row(
        {k: v for k, v in embedded.to_dict().items() if v is not None}, len(group["prompts"]))
    gen = BatchGenerator(model.language_model, processor,
                         prefill_batch_size=len(group["prompts"]),
                         completion_batch_size=len(group["prompts"]), compute_logprobs=False,
                         draft_model=drafter, draft_kind=kind,
                         draft_block_size=group["block_size"], greedy_sampling=True)
    uids = gen.insert(input_ids, list(group["max_tokens"]), prompt_kwargs=prompt_kwargs,
                      attention_mask=mask)
    emitted = {uid: [] for uid in uids}
    while gen.has_work:
        _, responses = gen.next()
        for r in responses:
            emitted[r.uid].append(int(r.token))
    gen.close()
    rows = []
    for i, uid in enumerate(uids):
        prompt = [int(t) for t, m in zip(input_ids[i].tolist(), mask[i].tolist()) if m]
        rows.append({"prompt": prompt, "max_tokens": group["max_tokens"][i], "tokens": emitted[uid]})
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / f"{group['name']}.json", {
        "format": "verity-vlm-batch/1",
        "oracle": {"tool": "mlx-vlm", "tool_version": mlx_vlm.__version__,
                   "mlx_version": mx.__version__, "device": "cpu"},
        "model": group["model"],
        # None: the target's own MTP head (the group names the target itself).
        "drafter": None if group["drafter"] == group["model"] else group["drafter"],
        "block_size": group["block_size"],
        "rows": rows,
    })
    print(f"{group['name']}: {[len(r['tokens']) for r in rows]} tokens")


def main():
    mx.set_default_device(mx.cpu)
    manifest = tomllib.loads((GOLDEN / "MANIFEST.toml").read_text())
    try:
        for group in manifest.get("vlm_batch", []):
            record(group)
    except ManifestError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
