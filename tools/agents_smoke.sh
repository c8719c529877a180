#!/usr/bin/env bash
# Claude Code against `kvfold serve` through the Anthropic Messages API (POST /v1/messages):
# installs @anthropic-ai/claude-code from npm into a temporary prefix, serves the built-in `tiny`
# model (DeepSeek-V4's chat format: tools and thinking) on a free local port, and runs one
# non-interactive turn; then the same with OpenAI's Codex CLI (@openai/codex) through the Responses
# API (POST /v1/responses, a `wire_api = "responses"` provider in a temporary CODEX_HOME). The tiny model's reply is documentation-like nonsense; what this checks
# is that the turn completes without an error. Not part of `make test` (it needs npm and the
# network). Usage: tools/agents_smoke.sh [PROMPT]
# env: PYTHON, AGENTS (default "claude codex": which to run), CLAUDE_CODE_VERSION, CODEX_VERSION,
# CODEX_TOOL=0 (skip the second Codex turn, whose exec_command call tools/force_tool_proxy.py forces), MAX_SEQ_LEN, THINKING=1 (keep Claude Code's adaptive thinking:
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

AGENTS=${AGENTS:-claude codex}
wants() { case " $AGENTS " in *" $1 "*) return 0;; esac; return 1; }
if wants claude; then
    echo "== installing @anthropic-ai/claude-code${CLAUDE_CODE_VERSION:+@$CLAUDE_CODE_VERSION} into $WORK/npm"
    npm install --silent --no-fund --no-audit --prefix "$WORK/npm" "@anthropic-ai/claude-code${CLAUDE_CODE_VERSION:+@$CLAUDE_CODE_VERSION}"
    CLAUDE="$WORK/npm/node_modules/.bin/claude"
    "$CLAUDE" --version
fi
if wants codex; then
    echo "== installing @openai/codex${CODEX_VERSION:+@$CODEX_VERSION} into $WORK/npm"
    npm install --silent --no-fund --no-audit --prefix "$WORK/npm" "@openai/codex${CODEX_VERSION:+@$CODEX_VERSION}"
    CODEX="$WORK/npm/node_modules/.bin/codex"
    "$CODEX" --version
fi

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

status=0
if wants claude; then
    echo "== claude -p \"$PROMPT\" --model tiny"
    thinking=()
    [ "${THINKING:-0}" = 1 ] || thinking=(MAX_THINKING_TOKENS=0)  # Claude Code then sends no `thinking`
    # a fresh HOME: no settings, login or history of the user's own Claude Code; the haiku-class
    # model Claude Code uses for side requests is the served one too
    env HOME="$WORK/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=k \
        ANTHROPIC_DEFAULT_HAIKU_MODEL=tiny ANTHROPIC_SMALL_FAST_MODEL=tiny DISABLE_TELEMETRY=1 \
        DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "${thinking[@]}" \
        timeout 900 "$CLAUDE" -p "$PROMPT" --model tiny || status=$?
    echo "== claude exited $status"
fi
if wants codex; then
    # a temporary CODEX_HOME: none of the user's own config, login or sessions; the provider is
    # kvfold's Responses API, the key comes from $KVFOLD_API_KEY
    mkdir -p "$WORK/codex"
    cat >"$WORK/codex/config.toml" <<TOML
model = "tiny"
model_provider = "kvfold"

[model_providers.kvfold]
name = "kvfold"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
env_key = "KVFOLD_API_KEY"
TOML
    echo "== codex exec --skip-git-repo-check \"$PROMPT\""
    codex_status=0
    (cd "$WORK" && env HOME="$WORK/home" CODEX_HOME="$WORK/codex" KVFOLD_API_KEY=k \
        timeout 900 "$CODEX" exec --skip-git-repo-check "$PROMPT" </dev/null) || codex_status=$?
    echo "== codex exited $codex_status"
    [ "$status" != 0 ] || status=$codex_status
    if [ "${CODEX_TOOL:-1}" = 1 ]; then
        # the random tiny model never calls a tool by itself: a test-only proxy forces the first
        # request's call of exec_command, its `cmd` narrowed to one harmless command (an enum the
        # grammar holds the model to); Codex runs it and sends the result back for a second request
        PROXY_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        "$PYTHON" tools/force_tool_proxy.py "http://127.0.0.1:$PORT" "$PROXY_PORT" exec_command "echo kvfold-tool-call-ok" \
            >"$WORK/proxy.log" 2>&1 &
        PROXY_PID=$!
        for _ in $(seq 30); do curl -s "http://127.0.0.1:$PROXY_PORT/health" >/dev/null && break; sleep 0.5; done
        sed "s|127.0.0.1:$PORT/v1|127.0.0.1:$PROXY_PORT/v1|" "$WORK/codex/config.toml" >"$WORK/codex/config.toml.new"
        mv "$WORK/codex/config.toml.new" "$WORK/codex/config.toml"
        echo "== codex exec --skip-git-repo-check \"run echo\" (exec_command forced by tools/force_tool_proxy.py)"
        tool_status=0
        (cd "$WORK" && env HOME="$WORK/home" CODEX_HOME="$WORK/codex" KVFOLD_API_KEY=k \
            timeout 900 "$CODEX" exec --skip-git-repo-check "run echo" </dev/null) 2>&1 | tee "$WORK/codex-tool.log" \
            || tool_status=$?
        kill "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true
        cat "$WORK/proxy.log"
        if grep -q "kvfold-tool-call-ok" "$WORK/codex-tool.log"; then
            echo "== codex ran the forced exec_command call"
        else
            echo "== codex did not run the forced call"; tool_status=1
        fi
        echo "== codex (tool call) exited $tool_status"
        [ "$status" != 0 ] || status=$tool_status
    fi
fi

echo "== the server's requests:"
grep -E '"(POST|GET|HEAD) ' "$WORK/server.log" || true
exit "$status"
