"""Train golden/models/qwen3-chat: a tiny qwen3 that answers chats the way a tool-calling, thinking
model does, for the server's tool and reasoning goldens (record_server.py).

Why a fixture of its own: mlx-lm separates reasoning only when the vocabulary holds <think> and
</think> (tokenizer_utils._infer_thinking), and no fixture model ever writes "<tool_call>". This
one has the golden tokenizer plus four non-special added tokens (<think>, </think>, <tool_call>,
</tool_call>, ids 1024-1027, as Qwen3's), the trimmed Qwen3 template of
oracles/chat_template_tools.jinja, and is trained on chats rendered through it to answer:

  tools given, a user's turn last  -> <think>..</think> a sentence, then a get_weather tool call
  no tools                         -> <think>..</think> a greeting
  a tool's result last             -> <think>..</think> the weather, in words

(the reasoning skipped when enable_thinking=false already closed the think block). The shared
tokenizer and every other golden stay as they are.

    oracles/.venv/bin/python oracles/train_chat.py

Training is not bit-reproducible across machines (threads, no pinned BLAS): the weights are
committed and CI never trains; the script refuses to save a model that misses a scripted answer.
"""

import common  # noqa: F401  (offline guard first)

import hashlib
import json
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common import MODELS, ORACLES, TOKENIZER, fresh_dir, log, read_json, write_json, write_text

OUT = MODELS / "qwen3-chat"
TEMPLATE = ORACLES / "chat_template_tools.jinja"
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
CFG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024 + len(ADDED),
           hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
           max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=[2, 0])
SEED, STEPS, BATCH, LR = 0, 600, 8, 1e-2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
QUESTIONS = ["What is the weather in Paris?", "Is it raining in Paris?", "How warm is it today?",
             "Tell me the weather.", "Should I take an umbrella?", "What's it like outside?",
             "Weather report, please.", "Is it cold in Paris right now?", "Hi!", "Hello there.",
             "Can you help me?", "What can you do?", "Good morning.", "Say hello.",
             "What does the function os.path.join do?", "Tell me about rivers."]
SYSTEMS = [None, "You are a helpful assistant.", "Answer briefly."]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
THINK = {"tool": "The user wants the weather, so I call get_weather.",
         "plain": "No tool is needed for this.",
         "result": "The tool has answered."}
SAY = {"tool": "Let me check.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>",
       "plain": "Hello! I can tell you the weather.",
       "result": "It is sunny in Paris, 21 degrees."}


def chats(rng):
    """(messages, tools, enable_thinking, kind) with every combination the goldens use."""
    out = []
    for q in QUESTIONS:
        for system in SYSTEMS:
            head = [{"role": "system", "content": system}] if system else []
            for thinking in (True, False):
                user = head + [{"role": "user", "content": q}]
                out.append((user, None, thinking, "plain"))
                for tools in ([WEATHER], [WEATHER, TIME]):
                    out.append((user, tools, thinking, "tool"))
                    call = {"id": "call_%d" % rng.integers(1000), "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
                    result = {"role": "tool", "tool_call_id": call["id"],
                              "content": rng.choice(['{"temperature": 21, "sky": "sunny"}', "sunny, 21 C",
                                                     '{"weather": "sunny"}'])}
                    out.append((user + [turn, result], tools, thinking, "result"))
    return out


def tokenizer_files(out):
    tok = read_json(TOKENIZER / "tokenizer.json")
    tok["added_tokens"] += [{"id": 1024 + i, "content": t, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": False}
                            for i, t in enumerate(ADDED)]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    template = TEMPLATE.read_text()
    config = read_json(TOKENIZER / "tokenizer_config.json")
    config["chat_template"] = template
    write_json(out / "tokenizer_config.json", config)
    write_text(out / "chat_template.jinja", template)


def main():
    out = fresh_dir(OUT)
    tokenizer_files(out)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("<think>") == 1024
    rng = np.random.default_rng(SEED)
    rows = []
    for messages, tools, thinking, kind in chats(rng):
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)
        answer = (f"<think>\n{THINK[kind]}\n</think>\n\n" if thinking else "") + SAY[kind] + "<|im_end|>"
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False)
        rows.append((p, a))
    width = max(len(p) + len(a) for p, a in rows)
    x = np.zeros((len(rows), width), np.int32)
    y = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (p, a) in enumerate(rows):
        ids = p + a
        x[i, :len(ids) - 1] = ids[:-1]
        y[i, :len(ids) - 1] = ids[1:]
        mask[i, len(p) - 1:len(ids) - 1] = 1
    log(f"{len(rows)} chats, up to {width} tokens")

    from mlx_lm.utils import _get_classes
    model_cls, args_cls = _get_classes(CFG)
    mx.random.seed(SEED)
    model = model_cls(args_cls.from_dict(dict(CFG)))
    opt = optim.AdamW(learning_rate=optim.cosine_decay(LR, STEPS, LR / 20), weight_decay=0.0)

    def loss_fn(model, x, y, m):
        ce = nn.losses.cross_entropy(model(x), y, reduction="none")
        return (ce * m).sum() / m.sum()

    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y, m):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y, m)
        opt.update(model, grads)
        return loss

    lengths = np.array([len(p) + len(a) for p, a in rows])
    for i in range(1, STEPS + 1):
        pick = rng.integers(0, len(rows), size=BATCH)
        w = min(-(-int(lengths[pick].max()) // 64) * 64, width)  # few shapes to compile for
        loss = step(mx.array(x[pick, :w]), mx.array(y[pick, :w]), mx.array(mask[pick, :w]))
        mx.eval(state)
        if i % 100 == 0:
            log(f"step {i} loss {float(loss):.4f}")

    # Greedy decoding gives the scripted answer exactly when, fed the answer, every position's
    # argmax is the answer's next token.
    wrong = 0
    for i in range(0, len(rows), 64):
        logits = model(mx.array(x[i:i + 64]))
        hit = (mx.argmax(logits, axis=-1) == mx.array(y[i:i + 64])) | (mx.array(mask[i:i + 64]) == 0)
        wrong += int((~mx.all(hit, axis=-1)).sum())
    log(f"greedy answers wrong: {wrong} of {len(rows)}")
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", CFG)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    log(f"saved {out} (model.safetensors sha256 {digest[:16]}, {sum(v.size for v in weights.values())} params)")
    if wrong:
        raise SystemExit("the model does not answer every training chat as scripted")


if __name__ == "__main__":
    main()
