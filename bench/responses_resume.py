"""Time to first token of a conversation's next turn over POST /v1/responses: resumed with
`previous_response_id` (the stored snapshot, kvfold/engine/checkpoint.py) against a cold run of
the same conversation sent whole.

    .venv/bin/python bench/responses_resume.py --model tiny --history 4096 --repeats 5 --threads 1

A live server (in this process, uvicorn on a thread) serves the model in its chat format with the
prefix cache off, so nothing but the response store can skip the history. Turn 1's input is cut
so that the conversation before turn 2's input (turn 1's prompt and its `--output` tokens) is
about `--history` tokens; turn 2 adds a short user message and asks for one token.
  resume  turn 2 with previous_response_id (store false, so every repeat resumes the same record);
  cold    the same conversation as input items (store false): the whole history is prefilled.
TTFT is from sending the streamed request to its first output item (response.output_item.added),
read off the wire. The two alternate, `--repeats` times each; the report gives min / median / max,
the ratio of the medians, the tokens each prefilled (input_tokens - cached_tokens), and whether
every run wrote the same (greedy) token.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import httpx
import torch

import kvfold
from kvfold.server.app import create_app

NEXT = "What happened next?"
TEXT = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree by the river. "


class Server:
    """The app served on 127.0.0.1 (a free port) from a background thread."""

    def __init__(self, app):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def first_item(url: str, body: dict) -> tuple[float, dict]:
    """(seconds to the first output item, the final response) of a streamed request."""
    start, first, final = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "response.output_item.added" and first is None:
                first = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    return first, final


def history_input(app, history: int, output: int) -> str:
    """Turn 1's input text: its prompt is `history - output` tokens, or just under."""
    template = app.state.server.template
    text = TEXT * (history // 8)
    while len(template.render([{"role": "user", "content": text}])) > history - output:
        text = text[:-max(1, (len(template.render([{"role": "user", "content": text}])) - history + output) // 2)]
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--history", type=int, default=4096, help="tokens before turn 2's input (default 4096)")
    ap.add_argument("--output", type=int, default=16, help="turn 1's output tokens (default 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = kvfold.load_model(args.model)
    engine = kvfold.Engine(model, max_seq_len=args.history + 512, max_running=2, prefix_cache_bytes=0)
    app = create_app(engine, model_name=args.model, web_page=False)
    base = {"model": args.model, "max_output_tokens": 1, "temperature": 0, "store": False}
    with Server(app) as url:
        first_item(url, {**base, "input": TEXT})  # builds and loads the kernels
        text = history_input(app, args.history, args.output)
        turn1 = httpx.post(url + "/v1/responses", json={"model": args.model, "input": text, "temperature": 0,
                                                        "max_output_tokens": args.output}, timeout=600).json()
        whole = [{"role": "user", "content": text}] + turn1["output"] + [{"role": "user", "content": NEXT}]
        cells: dict[str, list] = {"resume": [], "cold": []}
        for _ in range(args.repeats):
            cells["resume"].append(first_item(url, {**base, "input": NEXT, "previous_response_id": turn1["id"]}))
            cells["cold"].append(first_item(url, {**base, "input": whole}))
    report = {"model": args.model, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "turn1_prompt_tokens": turn1["usage"]["input_tokens"], "turn1_output_tokens": args.output,
              "stored_response_bytes": app.state.responses.get(turn1["id"]).nbytes}  # mostly its snapshot
    for name, runs in cells.items():
        ms = sorted(1000 * t for t, _ in runs)
        use = runs[0][1]["usage"]
        cached = use["input_tokens_details"]["cached_tokens"]
        report[name] = {"ttft_ms_min": ms[0], "ttft_ms_median": statistics.median(ms), "ttft_ms_max": ms[-1],
                        "input_tokens": use["input_tokens"], "cached_tokens": cached,
                        "prefilled_tokens": use["input_tokens"] - cached}
    report["cold_over_resume"] = report["cold"]["ttft_ms_median"] / report["resume"]["ttft_ms_median"]
    texts = {"".join(p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"])
             for _, r in cells["resume"] + cells["cold"]}
    report["same_output"] = len(texts) == 1  # greedy: resumed and cold agree
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
