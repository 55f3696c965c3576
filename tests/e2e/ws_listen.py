"""Record a ComfyUI websocket's messages to a file, one JSON line each (binary frames as their type and size).

Run with ComfyUI's own Python (it has aiohttp): `python ws_listen.py ws://host:port/ws?clientId=ID OUT_FILE`.
The end-to-end tests start it in the background and stop it when done.
"""

import asyncio
import json
import sys

import aiohttp


async def listen(url: str, out_path: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            with open(out_path, "w") as out:
                out.write(json.dumps({"type": "connected"}) + "\n")
                out.flush()
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        out.write(message.data.strip() + "\n")
                    elif message.type == aiohttp.WSMsgType.BINARY:
                        event = int.from_bytes(message.data[:4], "big")
                        out.write(json.dumps({"type": "binary", "event": event, "bytes": len(message.data)}) + "\n")
                    out.flush()


if __name__ == "__main__":
    asyncio.run(listen(sys.argv[1], sys.argv[2]))
