"""Connections for the load test: a stack of one-connection httpx clients.

A request takes an idle client (or a new one) and gives it back when its
stream is done, so each connection carries one request at a time and is kept
alive for the next, as a population of users (or the OpenAI SDK's pool) would.
One shared httpx client cannot do this at scale: on every request taken or
given back, its pool walks every connection it holds and, for each idle one,
builds a list of all of them again. With hundreds kept alive that cost a client
process more CPU than the streams: a closed loop ran at under half the rate of
one with a fresh connection per request on the CPU box, a third on the H100.
Here a request touches one client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl

import httpx


class Connections:
    def __init__(self, args: argparse.Namespace) -> None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self._ssl = ssl.create_default_context()
        self._make = lambda: httpx.AsyncClient(
            base_url=args.base_url,
            headers=headers,
            timeout=httpx.Timeout(args.timeout),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            # One SSL context for all: httpx builds one per client otherwise (~20 ms).
            verify=self._ssl,
        )
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    def take(self) -> httpx.AsyncClient:
        return self._idle.pop() if self._idle else self._new()

    def _new(self) -> httpx.AsyncClient:
        client = self._make()
        self._all.append(client)
        return client

    def give(self, client: httpx.AsyncClient) -> None:
        self._idle.append(client)

    def reserve(self, count: int) -> None:
        """Have `count` clients made (not connected): an open loop's burst then does
        not build them inside the measured time (~0.2 ms each)."""
        self._idle += [self._new() for _ in range(count - len(self._idle))]

    async def open(self, count: int) -> None:
        """Have `count` connections open and idle (part of the warmup): a closed loop's
        first requests then do not set them up inside the measured time."""
        clients = [self.take() for _ in range(count)]

        async def one(client: httpx.AsyncClient) -> None:
            with contextlib.suppress(httpx.HTTPError):
                await client.get("/v1/models")

        await asyncio.gather(*(one(c) for c in clients))
        for client in reversed(clients):
            self.give(client)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._all), return_exceptions=True)
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
