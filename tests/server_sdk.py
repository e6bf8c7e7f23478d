"""Drives `verity serve` with the official OpenAI Python SDK (run by tests/server_sdk.rs, which
starts the server and compares what this prints with its own raw HTTP requests).

    python tests/server_sdk.py BASE_URL          # chat, streaming, logprobs, completions, ...
    python tests/server_sdk.py BASE_URL tools    # a tool call round trip (qwen3-chat)
"""

import json
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {"sdk_version": openai.__version__}

model = client.models.list().data[0].id
out["model"] = model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_round_trip():
    """Ask, get a tool call, send the tool's result back as the SDK's docs do, get the answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=96)
    message = asked.choices[0].message
    call = message.tool_calls[0]
    out["call"] = {"name": call.function.name, "arguments": call.function.arguments, "type": call.type,
                   "finish_reason": asked.choices[0].finish_reason, "content": message.content,
                   "reasoning": (message.model_extra or {}).get("reasoning"), "calls": len(message.tool_calls)}
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    answered = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=96)
    out["answer"] = {"content": answered.choices[0].message.content,
                     "finish_reason": answered.choices[0].finish_reason,
                     "prompt_tokens": answered.usage.prompt_tokens, "messages": messages}
    stream = client.chat.completions.create(model=model, messages=messages[:1], tools=[WEATHER], max_tokens=96,
                                            stream=True)
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            for c in chunk.choices[0].delta.tool_calls or []:
                calls.append({"index": c.index, "name": c.function.name, "arguments": c.function.arguments})
            finish = chunk.choices[0].finish_reason or finish
    out["stream_call"] = {"calls": calls, "finish_reason": finish}
    forced = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there."}], tools=[WEATHER], max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced.choices[0].message.tool_calls[0]
    out["forced"] = {"name": call.function.name, "arguments": json.loads(call.function.arguments),
                     "finish_reason": forced.choices[0].finish_reason}
    print(json.dumps(out))
    sys.exit(0)


if sys.argv[2:] == ["tools"]:
    tool_round_trip()

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
