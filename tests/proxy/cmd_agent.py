"""An external agent for the proxy tests: a plain synchronous `openai` client configured only by the
environment (OPENAI_BASE_URL, OPENAI_API_KEY), the sample read from stdin. argv[1] picks a behaviour."""

import json
import os
import sys

import httpx
import openai

mode = sys.argv[1]
sample = json.loads(sys.stdin.read())
assert json.loads(os.environ["ASYNCRL_SAMPLE"]) == sample
assert "ASYNCRL_ENGINE_TOKEN" not in os.environ
client = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
messages = list(sample["messages"])
if mode == "two_turns":
    r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    r2 = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    httpx.post(os.environ["ASYNCRL_REWARD_URL"], json={"reward": 0.25},
               headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()
elif mode == "fail":
    client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    sys.exit("agent gave up: no answer")
