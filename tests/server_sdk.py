"""Drives `verity serve` with the official OpenAI Python SDK (run by tests/server_sdk.rs, which
starts the server and compares what this prints with its own raw HTTP requests).

    python tests/server_sdk.py BASE_URL
"""

import json
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {"sdk_version": openai.__version__}

model = client.models.list().data[0].id
out["model"] = model

messages = [{"role": "user", "content": "What does the function os.path.join do?"}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
out["chat"] = {
    "content": chat.choices[0].message.content,
    "finish_reason": chat.choices[0].finish_reason,
    "completion_tokens": chat.usage.completion_tokens,
    "prompt_tokens": chat.usage.prompt_tokens,
}

stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}
)
text, finish, usage = "", None, None
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens
out["stream"] = {"content": text, "finish_reason": finish, "completion_tokens": usage}

logprobs = client.chat.completions.create(
    model=model, messages=messages, max_tokens=6, logprobs=True, top_logprobs=3
)
out["logprobs"] = [
    {"token": e.token, "logprob": e.logprob, "top": [t.token for t in e.top_logprobs]}
    for e in logprobs.choices[0].logprobs.content
]

completion = client.completions.create(model=model, prompt="def read_config(path):", max_tokens=16)
out["completion"] = {"text": completion.choices[0].text, "finish_reason": completion.choices[0].finish_reason}

schema = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}}, "required": ["pick"],
          "additionalProperties": False}
constrained = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Pick one."}], max_tokens=64,
    response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
)
out["json"] = json.loads(constrained.choices[0].message.content)

try:
    client.chat.completions.create(model=model, messages=messages, temperature=-1)
    out["bad"] = "accepted"
except openai.BadRequestError as e:
    out["bad"] = {"status": e.status_code, "param": e.param, "type": e.type}

print(json.dumps(out))
