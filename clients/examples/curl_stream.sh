#!/usr/bin/env bash
# Stream a completion from Pagoda with curl. -N turns off curl's output
# buffering so each `data: {...}` SSE line shows as the server sends it.
#
#   clients/examples/curl_stream.sh                      # 127.0.0.1:8000
#   BASE_URL=http://127.0.0.1:9000 MODEL=gpt2 clients/examples/curl_stream.sh
set -euo pipefail

BASE_URL="${BASE_URL:-http://127.0.0.1:8000}"
# Without MODEL, ask the server which model it serves.
MODEL="${MODEL:-$(curl -s "$BASE_URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')}"
AUTH=()
if [[ -n "${API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer $API_KEY"); fi

curl -N -sS "$BASE_URL/v1/completions" \
  "${AUTH[@]}" \
  -H "Content-Type: application/json" \
  -d "{
    \"model\": \"$MODEL\",
    \"prompt\": \"The quick brown fox\",
    \"max_tokens\": 32,
    \"stream\": true,
    \"stream_options\": {\"include_usage\": true}
  }"
echo
