"""Records request/response exchanges against mlx_lm.server on the fixtures, for the replay test
(tests/server_goldens.rs) that sends the same requests to `verity serve` over real HTTP.

Every case runs on a freshly started server (a cold prompt cache), one request at a time:
greedy and seeded, streaming and not, stop words, logprobs, a logit bias, a draft model, XTC,
and on qwen3-chat (train_chat.py: a model that thinks and calls tools) reasoning on and off
through chat_template_kwargs, tools, tool calls and tool results; the chat template with tools
also goes through `--chat-template` on qwen3-target (whose vocabulary has no <think>). Cases
where mlx_lm.server is known to be wrong name the bug of golden/known-oracle-bugs.toml; the
replay judges those at tier C (only what the bug leaves right is compared). Ids, timestamps and
fingerprints are dropped from the recording.

    oracles/.venv/bin/python oracles/record_server.py      # writes golden/server/exchanges.json
"""

import json
import urllib.request

from common import GOLDEN, log, write_json  # first: sets the offline environment
from known_bugs import MODELS, ROOT, Server

OUT = GOLDEN / "server" / "exchanges.json"
ASK = "What does the function os.path.join do?"


def chat(content=ASK, **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
TEMPLATE = "golden/models/qwen3-chat/chat_template.jinja"
# A tool's result after the call, as the OpenAI SDK sends them (arguments as a JSON string).
AFTER_CALL = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
]
NO_THINKING = {"enable_thinking": False}

# (id, server arguments, endpoint, body, known bug or None); the model is qwen3-target unless
# the server arguments start with --model.
CASES = [
    ("chat-greedy", [], "/v1/chat/completions", chat(max_tokens=40), None),
    ("chat-greedy-stream", [], "/v1/chat/completions",
     chat(max_tokens=40, stream=True, stream_options={"include_usage": True}), None),
    ("chat-greedy-eos", [], "/v1/chat/completions", chat("Say hello.", max_tokens=200), None),
    ("chat-seeded", [], "/v1/chat/completions",
     chat(max_tokens=32, temperature=0.8, top_p=0.9, seed=3), None),
    ("chat-seeded-stream", [], "/v1/chat/completions",
     chat(max_tokens=32, temperature=0.7, top_k=20, seed=11, stream=True,
          stream_options={"include_usage": True}), None),
    ("completion-greedy", [], "/v1/completions", {"prompt": "def read_config(path):", "max_tokens": 32}, None),
    ("completion-stream", [], "/v1/completions",
     {"prompt": "import os\n", "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}, None),
    ("chat-stop", [], "/v1/chat/completions", chat(max_tokens=40, stop=[" host"]), None),
    ("chat-stop-stream", [], "/v1/chat/completions",
     chat(max_tokens=40, stop=["zzz", " single host"], stream=True, stream_options={"include_usage": True}), None),
    ("chat-logprobs", [], "/v1/chat/completions", chat(max_tokens=16, logprobs=True), None),
    ("chat-top-logprobs", [], "/v1/chat/completions", chat(max_tokens=16, logprobs=True, top_logprobs=5),
     "server-top-logprobs-unsorted"),
    ("chat-logit-bias", [], "/v1/chat/completions", chat(max_tokens=24, logit_bias={"2": -100, "0": -100, "11": 5}),
     None),
    ("chat-draft", ["--draft-model", "qwen3-draft", "--num-draft-tokens", "3"], "/v1/chat/completions",
     chat(max_tokens=40), None),
    ("chat-draft-stream", ["--draft-model", "qwen3-draft", "--num-draft-tokens", "2"], "/v1/chat/completions",
     chat("Tell me about rivers.", max_tokens=40, stream=True, stream_options={"include_usage": True}), None),
    ("chat-xtc", [], "/v1/chat/completions",
     chat(max_tokens=32, temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1, seed=5), None),
    ("chat-xtc-stream", [], "/v1/chat/completions",
     chat(max_tokens=32, temperature=0.9, top_p=0.95, xtc_probability=1.0, xtc_threshold=0.05, seed=2,
          stream=True, stream_options={"include_usage": True}), None),
    ("chat-template-tools", ["--chat-template", TEMPLATE], "/v1/chat/completions",
     chat(max_tokens=24, tools=[WEATHER, TIME]), None),
    ("chat-template-tool-result", ["--chat-template", TEMPLATE], "/v1/chat/completions",
     {"messages": AFTER_CALL, "tools": [WEATHER], "max_tokens": 24,
      "chat_template_kwargs": NO_THINKING}, None),
    ("chat-reasoning", ["--model", "qwen3-chat"], "/v1/chat/completions", chat("Hello there.", max_tokens=64),
     None),
    ("chat-reasoning-stream", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("Good morning.", max_tokens=64, stream=True, stream_options={"include_usage": True}), None),
    ("chat-reasoning-off", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("Hello there.", max_tokens=64, chat_template_kwargs=NO_THINKING), None),
    ("chat-reasoning-opened", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("Hello there.", max_tokens=64, chat_template_kwargs={"open_think": True}), None),
    ("chat-reasoning-cut", ["--model", "qwen3-chat"], "/v1/chat/completions", chat("Hi!", max_tokens=5), None),
    ("chat-tools", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("What is the weather in Paris?", max_tokens=96, tools=[WEATHER]), None),
    ("chat-tools-stream", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("Should I take an umbrella?", max_tokens=96, tools=[WEATHER, TIME], stream=True,
          stream_options={"include_usage": True}), None),
    ("chat-tools-no-thinking", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("Is it raining in Paris?", max_tokens=96, tools=[WEATHER], chat_template_kwargs=NO_THINKING), None),
    ("chat-tools-cut", ["--model", "qwen3-chat"], "/v1/chat/completions",
     chat("What is the weather in Paris?", max_tokens=24, tools=[WEATHER], chat_template_kwargs=NO_THINKING),
     None),
    ("chat-tool-result", ["--model", "qwen3-chat"], "/v1/chat/completions",
     {"messages": AFTER_CALL, "tools": [WEATHER], "max_tokens": 64}, None),
    ("chat-tool-result-stream", ["--model", "qwen3-chat"], "/v1/chat/completions",
     {"messages": AFTER_CALL, "tools": [WEATHER], "max_tokens": 64, "stream": True,
      "chat_template_kwargs": NO_THINKING}, None),
]

DROPPED = ("id", "created", "system_fingerprint")


def clean(obj):
    return {k: v for k, v in obj.items() if k not in DROPPED}


def exchange(server, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not body.get("stream"):
            return clean(json.load(r))
        chunks = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return chunks
            chunks.append(clean(json.loads(data)))
    raise RuntimeError(f"{path}: the stream ended without [DONE]")


def main():
    cases = []
    for case_id, args, path, body, bug in CASES:
        log(f"{case_id}")
        model = "qwen3-target"
        if args[:1] == ["--model"]:
            model, args = args[1], args[2:]
        server_args = ["--model", str(MODELS / model)]
        for i, a in enumerate(args):
            flag = args[i - 1] if i > 0 else None
            if flag == "--draft-model":
                a = str(MODELS / a)
            elif flag == "--chat-template":  # mlx_lm.server takes the template's text
                a = (ROOT / a).read_text()
            server_args.append(a)
        with Server(*server_args) as server:
            response = exchange(server, path, body)
        cases.append({"id": case_id, "model": model, "server_args": args, "path": path,
                      "request": body, "known_bug": bug, "response": response})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_json(OUT, {"format": "verity-server-exchanges/1", "oracle": "mlx_lm.server 0.32.2 (MLX 0.32.4, cpu)",
                     "cases": cases})
    log(f"wrote {len(cases)} exchanges to {OUT}")


if __name__ == "__main__":
    main()
