#!/usr/bin/env bash
# Claude Code against `kvfold serve` through the Anthropic Messages API (POST /v1/messages):
# installs @anthropic-ai/claude-code from npm into a temporary prefix, serves the built-in `tiny`
# model (DeepSeek-V4's chat format: tools and thinking) on a free local port, and runs one
# non-interactive turn. The tiny model's reply is documentation-like nonsense; what this checks
# is that the turn completes without an error. Not part of `make test` (it needs npm and the
# network). Usage: tools/agents_smoke.sh [PROMPT]
# env: PYTHON, CLAUDE_CODE_VERSION, MAX_SEQ_LEN, THINKING=1 (keep Claude Code's adaptive thinking:
# the tiny model then answers with a thinking block only, so Claude Code prints nothing visible)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PROMPT=${1:-say hi}
# Claude Code's system prompt and tool definitions alone are tens of thousands of tokens of the
# tiny model's tokenizer: the context must hold them (max_tokens past it is cut to what fits)
MAX_SEQ_LEN=${MAX_SEQ_LEN:-65536}
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "== installing @anthropic-ai/claude-code${CLAUDE_CODE_VERSION:+@$CLAUDE_CODE_VERSION} into $WORK/npm"
npm install --silent --no-fund --no-audit --prefix "$WORK/npm" "@anthropic-ai/claude-code${CLAUDE_CODE_VERSION:+@$CLAUDE_CODE_VERSION}"
CLAUDE="$WORK/npm/node_modules/.bin/claude"
"$CLAUDE" --version

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "== kvfold serve --model tiny --port $PORT --max-seq-len $MAX_SEQ_LEN"
"$PYTHON" -m kvfold serve --model tiny --port "$PORT" --max-seq-len "$MAX_SEQ_LEN" --api-key k \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
    sleep 1
done

echo "== claude -p \"$PROMPT\" --model tiny"
status=0
thinking=()
[ "${THINKING:-0}" = 1 ] || thinking=(MAX_THINKING_TOKENS=0)  # Claude Code then sends no `thinking`
# a fresh HOME: no settings, login or history of the user's own Claude Code; the haiku-class
# model Claude Code uses for side requests is the served one too
env HOME="$WORK/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=k \
    ANTHROPIC_DEFAULT_HAIKU_MODEL=tiny ANTHROPIC_SMALL_FAST_MODEL=tiny DISABLE_TELEMETRY=1 \
    DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "${thinking[@]}" \
    timeout 900 "$CLAUDE" -p "$PROMPT" --model tiny || status=$?

echo "== claude exited $status; the server's requests:"
grep -E '"(POST|GET|HEAD) ' "$WORK/server.log" || true
exit "$status"
