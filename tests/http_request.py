"""A plain HTTP request to a live server through aiohttp (no openai client: the GPU machine lacks it), for the server
and tensor-parallel tests."""
import asyncio
import json
from dataclasses import dataclass

import aiohttp


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


async def request_async(method: str, url: str, body=None, headers=None, timeout: float = 30.0) -> Reply:
    data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.request(method, url, data=data, headers=headers) as response:
            return Reply(response.status, dict(response.headers), await response.read())


def request(method: str, url: str, body=None, headers=None, timeout: float = 30.0) -> Reply:
    return asyncio.run(request_async(method, url, body, {"Content-Type": "application/json", **(headers or {})},
                                timeout))
