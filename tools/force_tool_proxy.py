"""A test-only HTTP proxy for tools/agents_smoke.sh: forwards everything to a kvfold server, but
rewrites the first POST /v1/responses of a conversation (no function_call_output in its input)
to force one call of FUNCTION, whose parameters are narrowed to {"cmd": COMMAND} (an enum, so the
grammar makes the random `tiny` model write exactly that command and nothing else gets run).
That is how the smoke test gets a tool call the agent executes out of a model that never writes
one by itself. Usage: python tools/force_tool_proxy.py UPSTREAM PORT FUNCTION COMMAND"""
import json
import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

UPSTREAM, PORT, FUNCTION, COMMAND = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
client = httpx.AsyncClient(base_url=UPSTREAM, timeout=None)


def rewrite(body: dict) -> dict:
    answered = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body.get("input") or ())
    if answered or not any(t.get("name") == FUNCTION for t in body.get("tools") or ()):
        return body
    # strict: a function Codex sends with strict false has its schema not enforced by the grammar
    tools = [dict(t, strict=True, parameters={"type": "object", "properties": {"cmd": {"type": "string", "enum": [COMMAND]}},
                                 "required": ["cmd"], "additionalProperties": False})
             if t.get("name") == FUNCTION else t for t in body["tools"]]
    print(f"force_tool_proxy: forcing {FUNCTION}({{'cmd': {COMMAND!r}}})", file=sys.stderr, flush=True)
    return {**body, "tools": tools, "tool_choice": {"type": "function", "name": FUNCTION},
            "parallel_tool_calls": False}


async def forward(request: Request) -> Response:
    body = await request.body()
    if request.method == "POST" and request.url.path == "/v1/responses":
        body = json.dumps(rewrite(json.loads(body))).encode()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
    upstream = await client.send(client.build_request(request.method, request.url.path, params=request.query_params,
                                                      headers=headers, content=body), stream=True)
    return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                             headers={k: v for k, v in upstream.headers.items()
                                      if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")},
                             background=None)


app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "DELETE"])])
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
