"""Clients for a running Pagoda (or any OpenAI-compatible) server.

`clients.loadtest` measures TTFT/ITL/TPOT/E2E latency and throughput under load;
`clients/examples/` shows plain curl and openai-SDK use.
"""
